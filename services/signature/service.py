"""The signature service: caches per-KV-block expert counts and assembles request signatures.

Each replica reads the BLOCKS stream back from its start and then follows it live, so every
replica holds every block its budget has room for (replicated, not partitioned: see
docs/ARCHITECTURE.md, "Signature service: replication"). Only once the read-back has caught up
with the stream as it was at start does the replica join the `signature` queue group on
`{ns}.sig.assemble` and report ready, so a cold replica never answers with blocks it has
not read yet.

An assembly whose blocks are not all cached may wait (up to `wait_ms`, capped by
`max_wait_ms`) for them: a prefill worker publishes its block summaries just before its
PrefillDone, so a request can overtake its own blocks. The wait is event-driven: the block
handler wakes the waiters of each block it caches.
"""

from __future__ import annotations

import asyncio
import logging
import time

from prometheus_client import CollectorRegistry

from eldr.aio import wait_event
from eldr.bus import SIGNATURE_QUEUE, Delivery, Reject, stream_name
from eldr.bus.topology import BLOCKS, IDENTITY
from eldr.runtime import ServiceContext, service_main
from eldr.signature.state import (
    Outcome,
    RejectReason,
    SeqEvent,
    SignatureState,
)
from eldr.wire import AssembleReply, AssembleRequest, BlockSummaryBatch

from .metrics import SignatureMetrics, StateCollector
from .settings import SignatureSettings

log = logging.getLogger(__name__)

SERVICE_NAME = "signature"

REFUSAL_OF = {
    RejectReason.GEOMETRY_MISMATCH: "geometry_mismatch",
    RejectReason.COUNT_OVERFLOW: "inconsistent",
    RejectReason.INCONSISTENT: "inconsistent",
    RejectReason.TOO_MANY_MODELS: "over_limit",
}
"""The bus refusal reason (`eldr.bus.REFUSAL_REASONS`) of each batch rejection."""


class Replica:
    """The handlers of one replica and what they share."""

    def __init__(self, settings: SignatureSettings, registry: CollectorRegistry) -> None:
        self.settings = settings
        self.registry = registry
        self.state = SignatureState(
            settings.cache_max_bytes,
            max_models=settings.max_models,
            limits=settings.geometry_limits(),
            trusted_writers=frozenset(settings.trusted_block_writers),
        )
        self.metrics = SignatureMetrics(registry)
        self.collector = StateCollector(self.state, None)
        registry.register(self.collector)

    async def on_batch(self, batch: BlockSummaryBatch, delivery: Delivery) -> None:
        state, metrics = self.state, self.metrics
        metrics.batches_received.inc()
        result = state.ingest(batch)
        if result.seq.event is SeqEvent.GAP:
            metrics.seq_gaps.inc(result.seq.missed)
            log.warning(
                "blocks from %s: seq %d after a gap of %d batches (stream seq %s)",
                batch.worker_id,
                batch.seq,
                result.seq.missed,
                delivery.stream_seq,
            )
        elif result.seq.event is SeqEvent.DUPLICATE:
            metrics.seq_duplicates.inc()
            log.debug("blocks from %s: duplicate seq %d", batch.worker_id, batch.seq)
        elif result.seq.event is SeqEvent.RESTART:
            metrics.publisher_restarts.inc()
            log.info("blocks from %s: publisher restarted (seq 0)", batch.worker_id)
        if result.rejected is not None:
            # Counted here by reason; the bus logs it (rate-limited), counts it and
            # dead-letters it (every replica refuses it alike; the DLQ keeps it once).
            metrics.batches_rejected.labels(result.rejected.value).inc()
            raise Reject(
                REFUSAL_OF[result.rejected],
                f"blocks from {batch.worker_id} seq {batch.seq}: {result.rejected.value}: "
                f"{result.detail}",
            )
        metrics.blocks_received.inc(result.blocks)
        if result.blocks_conflicting:
            metrics.block_conflicts.labels("own").inc(
                result.blocks_conflicting - result.blocks_trusted
            )
            metrics.block_conflicts.labels("trusted").inc(result.blocks_trusted)
            log.warning(
                "blocks from %s seq %d: %d summaries differ from the cached ones (kept as %s; "
                "%d replaced them as a trusted writer's)",
                batch.worker_id,
                batch.seq,
                result.blocks_conflicting,
                batch.worker_id,
                result.blocks_trusted,
            )

    async def on_assemble(self, request: AssembleRequest) -> AssembleReply:
        state, metrics = self.state, self.metrics
        started = time.perf_counter()
        wait_s = min(request.wait_ms, self.settings.max_wait_ms) / 1000.0
        if wait_s > 0:
            missing = state.missing_keys(request.model, request.block_hashes)
            if missing:
                waiter = state.waiters.register(missing)
                try:
                    await wait_event(waiter.done, wait_s)  # else answer with what is there
                finally:
                    state.waiters.remove(waiter)
                metrics.wait_seconds.observe(time.perf_counter() - started)
        result = state.assemble(request)
        metrics.assemblies.labels(result.outcome.value).inc()
        if result.outcome is Outcome.ERROR:
            log.warning("assemble %s: %s", request.request_id, result.reply.error)
        else:
            metrics.missing_blocks.inc(result.missing)
            if result.missing:
                log.debug(
                    "assemble %s: %d of %d blocks missing",
                    request.request_id,
                    result.missing,
                    len(request.block_hashes),
                )
        metrics.assembly_seconds.observe(time.perf_counter() - started)
        return result.reply


class SignatureService:
    """`setup` is what `run_service` calls; `ready` is set once the replica serves."""

    def __init__(self) -> None:
        self.ready = asyncio.Event()
        self.replica: Replica | None = None

    async def setup(self, ctx: ServiceContext[SignatureSettings]) -> None:
        settings = ctx.settings
        replica = Replica(settings, ctx.registry)
        self.replica = replica
        bus = ctx.bus
        blocks_stream = stream_name(settings.namespace, BLOCKS)
        # Deliver-all from the stream's first message, then live ones: every replica
        # rebuilds the same cache from the stream.
        reader = await bus.read_back(
            blocks_stream,
            bus.subjects.blocks_all,
            BlockSummaryBatch,
            replica.on_batch,
            identity=IDENTITY[BlockSummaryBatch],
        )
        replica.collector.read_back = reader
        ctx.add_health_check("blocks_replay_caught_up", reader.caught_up.is_set)
        log.info(
            "signature %s replaying %s (cache budget %d bytes)",
            settings.instance_id,
            blocks_stream,
            settings.cache_max_bytes,
        )
        if not await _first_of(reader.caught_up, ctx.stopping):
            return
        state = replica.state
        log.info(
            "signature %s caught up with %s at seq %d: %d blocks cached (%d bytes), %d models",
            settings.instance_id,
            blocks_stream,
            reader.last_stream_seq,
            len(state.cache),
            state.cache.bytes_used,
            len(state.geometries),
        )
        # Join the queue group only now, so no request reaches a replica still warming up.
        await bus.serve(
            bus.subjects.sig_assemble,
            SIGNATURE_QUEUE,
            AssembleRequest,
            replica.on_assemble,
            max_concurrency=settings.assemble_max_concurrency,
        )
        ctx.set_ready()
        self.ready.set()


async def _first_of(wanted: asyncio.Event, stop: asyncio.Event) -> bool:
    """Wait until `wanted` or `stop` is set; True if `wanted` is."""
    tasks = {asyncio.create_task(wanted.wait()), asyncio.create_task(stop.wait())}
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
    return wanted.is_set()


async def setup(ctx: ServiceContext[SignatureSettings]) -> None:
    """Wire a signature replica into a running service context."""
    await SignatureService().setup(ctx)


def main() -> int:
    """`eldr serve signature`: settings from `ELDR_*`, run until SIGTERM/SIGINT."""
    return service_main(SERVICE_NAME, SignatureSettings, setup)
