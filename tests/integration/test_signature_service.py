"""The signature service in-process against a real nats-server: assembly of exact prefill
counts (prefix sharing included), missing blocks, the request/blocks race, replicas and
warm-up from the stream, bad input, and the byte budget."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from eldr.bus import Bus, Delivery, Topology, apply_topology, stream_name
from eldr.bus.topology import BLOCKS, DLQ
from eldr.core.signature.blocks import BlockSummary, hash_chain, summarize_blocks
from eldr.core.workload.synthetic import SyntheticSpec, SyntheticWorld, generate, make_world
from eldr.core.workload.trace import RequestTrace, expert_counts
from eldr.runtime import run_service
from eldr.settings import BusSettings, RetentionSettings
from eldr.wire import (
    AssembleReply,
    AssembleRequest,
    BlockSummaryBatch,
    BlockSummaryMsg,
    DeadLetter,
    SparseCounts,
)
from eldr_services.signature.service import SignatureService
from eldr_services.signature.settings import SignatureSettings

pytestmark = pytest.mark.integration

WAIT_S = 10.0
"""Generous bound on awaiting an event (the machine is shared)."""
WAIT_S_MS = int(WAIT_S * 1000)
MODEL = "synthetic-moe"
SPEC = SyntheticSpec(
    num_moe_layers=6,
    num_experts=16,
    top_k=2,
    prompt_len_range=(20, 120),
    shared_prefix_blocks=2,
)
L, E, BLOCK = SPEC.num_moe_layers, SPEC.num_experts, SPEC.block_size


@dataclass
class Replica:
    service: SignatureService
    stop: asyncio.Event
    task: asyncio.Task[None]

    async def ready(self) -> None:
        """Wait until the replica serves (fails fast if the service task died)."""
        ready = asyncio.create_task(self.service.ready.wait())
        done, _ = await asyncio.wait(
            {ready, self.task}, timeout=WAIT_S, return_when=asyncio.FIRST_COMPLETED
        )
        ready.cancel()
        if self.task in done:
            self.task.result()  # raises the service's error
            pytest.fail("signature service stopped before it was ready")
        assert self.service.ready.is_set(), "signature service not ready in time"

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        replica = self.service.replica
        assert replica is not None
        value = replica.registry.get_sample_value(name, labels or {})
        return 0.0 if value is None else float(value)


StartReplica = Callable[..., Awaitable[Replica]]


@pytest.fixture
async def start_replica(
    bus_settings: BusSettings, retention: RetentionSettings, bus_factory: Any
) -> AsyncIterator[StartReplica]:
    """Start signature replicas in-process (`await start_replica(**settings)`, not yet
    ready); all are stopped at the end of the test, before the namespace is deleted."""
    replicas: list[Replica] = []

    async def start(**overrides: Any) -> Replica:
        settings = SignatureSettings(
            **bus_settings.model_dump(), **retention.model_dump(), **overrides
        )
        service = SignatureService()
        stop = asyncio.Event()
        task = asyncio.create_task(
            run_service(
                "signature", settings, service.setup, stop=stop, install_signal_handlers=False
            )
        )
        replica = Replica(service, stop, task)
        replicas.append(replica)
        return replica

    yield start
    for replica in replicas:
        replica.stop.set()
    await asyncio.wait_for(asyncio.gather(*(r.task for r in replicas)), timeout=WAIT_S)


async def ready_replica(start_replica: StartReplica, **overrides: Any) -> Replica:
    replica = await start_replica(**overrides)
    await replica.ready()
    return replica


# --- workload helpers ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def world() -> SyntheticWorld:
    return make_world(SPEC, np.random.default_rng(11))


def traces(world: SyntheticWorld, n: int, seed: int) -> list[RequestTrace]:
    return list(generate(SPEC, n, np.random.default_rng(seed), world=world).traces)


def summaries(trace: RequestTrace) -> tuple[list[BlockSummary], BlockSummary | None]:
    assert trace.token_ids is not None
    return summarize_blocks(trace.token_ids, trace.prefill, BLOCK, E)


def batch(
    blocks: list[BlockSummary],
    seq: int,
    *,
    worker: str = "p0",
    model: str = MODEL,
    shape: tuple[int, int] = (L, E),
) -> BlockSummaryBatch:
    return BlockSummaryBatch(
        worker_id=worker,
        seq=seq,
        ts_s=time.time(),
        model=model,
        num_moe_layers=shape[0],
        num_experts=shape[1],
        block_size=BLOCK,
        blocks=[
            BlockSummaryMsg(
                block_hash=b.block_hash or 0,
                parent_hash=b.parent_hash,
                n_tokens=b.n_tokens,
                counts=SparseCounts.from_dense(b.counts),
            )
            for b in blocks
        ],
    )


def assemble_request(
    request_id: str,
    hashes: list[int],
    partial: BlockSummary | None,
    *,
    wait_ms: int = 0,
    model: str = MODEL,
) -> AssembleRequest:
    return AssembleRequest(
        request_id=request_id,
        model=model,
        block_hashes=hashes,
        partial=SparseCounts.from_dense(partial.counts) if partial is not None else None,
        wait_ms=wait_ms,
    )


def request_for(trace: RequestTrace, *, wait_ms: int = 0) -> AssembleRequest:
    full, partial = summaries(trace)
    return assemble_request(
        trace.request_id, [b.block_hash or 0 for b in full], partial, wait_ms=wait_ms
    )


async def publish(bus: Bus, message: BlockSummaryBatch) -> None:
    await bus.js_publish(bus.subjects.blocks(message.worker_id), message)


async def assemble(bus: Bus, request: AssembleRequest) -> AssembleReply:
    return await bus.request(bus.subjects.sig_assemble, request, AssembleReply, timeout_s=WAIT_S)


def counts_of(reply: AssembleReply) -> np.ndarray:
    assert reply.counts is not None, reply.error
    return reply.counts.to_numpy()


# --- tests ---------------------------------------------------------------------------------


async def test_assembly_equals_exact_prefill_counts(
    bus: Bus, start_replica: StartReplica, world: SyntheticWorld
) -> None:
    await ready_replica(start_replica)
    requests = traces(world, 12, seed=1)
    for seq, trace in enumerate(requests):
        await publish(bus, batch(summaries(trace)[0], seq))
    for trace in requests:
        # wait_ms: the replica may not have read the last batches yet
        reply = await assemble(bus, request_for(trace, wait_ms=WAIT_S_MS))
        assert reply.blocks_found == reply.blocks_total
        assert reply.missing == []
        np.testing.assert_array_equal(counts_of(reply), expert_counts(trace.prefill, E))


async def test_prefix_blocks_published_by_an_earlier_request_count(
    bus: Bus, start_replica: StartReplica, world: SyntheticWorld
) -> None:
    """B extends A by less than a block: B's full blocks are all A's, B carries only its
    partial block, and B's assembly is still exactly B's prefill counts."""
    await ready_replica(start_replica)
    rng = np.random.default_rng(5)
    tokens_a = np.concatenate(
        [world.prefixes[0], world.sample_topic_tokens(0, 3 * BLOCK, rng)]
    ).astype(np.uint32)
    tokens_b = np.concatenate([tokens_a, world.sample_topic_tokens(0, BLOCK - 3, rng)])
    prefill_a, prefill_b = world.route_prefill(tokens_a), world.route_prefill(tokens_b)
    np.testing.assert_array_equal(prefill_b[: len(tokens_a)], prefill_a)  # causal routing
    full_a, partial_a = summarize_blocks(tokens_a, prefill_a, BLOCK, E)
    assert partial_a is None
    await publish(bus, batch(full_a, 0))
    hashes_b = hash_chain(tokens_b, BLOCK)
    assert hashes_b == [b.block_hash for b in full_a]
    _, partial_b = summarize_blocks(tokens_b, prefill_b, BLOCK, E)
    reply = await assemble(bus, assemble_request("b", hashes_b, partial_b, wait_ms=WAIT_S_MS))
    assert reply.blocks_found == len(hashes_b)
    np.testing.assert_array_equal(counts_of(reply), expert_counts(prefill_b, E))


async def test_missing_blocks_are_reported_not_guessed(
    bus: Bus, start_replica: StartReplica, world: SyntheticWorld
) -> None:
    replica = await ready_replica(start_replica)
    (trace,) = traces(world, 1, seed=2)
    full, partial = summaries(trace)
    assert len(full) >= 3
    published, withheld = full[:-2], full[-2:]
    await publish(bus, batch(published, 0))
    hashes = [b.block_hash or 0 for b in full]
    # Wait (event-driven) for the published blocks only, then ask without waiting.
    await assemble(bus, assemble_request("warm", hashes[:-2], None, wait_ms=WAIT_S_MS))
    reply = await assemble(bus, assemble_request(trace.request_id, hashes, partial))
    assert reply.blocks_total == len(full)
    assert reply.blocks_found == len(published)
    assert reply.missing == [b.block_hash for b in withheld]
    expected = expert_counts(trace.prefill, E) - sum(b.counts.astype(np.int32) for b in withheld)
    np.testing.assert_array_equal(counts_of(reply), expected)
    assert replica.metric("eldr_signature_assemblies_total", {"outcome": "partial"}) == 1
    assert replica.metric("eldr_signature_missing_blocks_total") == 2


async def test_a_block_arriving_within_wait_ms_is_included(
    bus: Bus, start_replica: StartReplica, world: SyntheticWorld
) -> None:
    """The prefill worker's PrefillDone can overtake its blocks: the assembly waits."""
    replica = await ready_replica(start_replica, max_wait_ms=WAIT_S_MS)
    (trace,) = traces(world, 1, seed=3)
    full, _ = summaries(trace)
    await publish(bus, batch(full[:-1], 0))
    replica_state = replica.service.replica
    assert replica_state is not None
    waiting = asyncio.Event()
    replica_state.state.waiters.on_register = lambda _waiter: waiting.set()
    pending = asyncio.create_task(assemble(bus, request_for(trace, wait_ms=WAIT_S_MS)))
    await asyncio.wait_for(waiting.wait(), WAIT_S)  # the request is in, its last block is not
    await publish(bus, batch(full[-1:], 1))
    reply = await pending
    assert reply.missing == []
    np.testing.assert_array_equal(counts_of(reply), expert_counts(trace.prefill, E))
    assert replica.metric("eldr_signature_assembly_wait_seconds_count") == 1
    assert replica.metric("eldr_signature_assemblies_total", {"outcome": "complete"}) == 1


async def test_wait_is_capped_by_max_wait_ms(
    bus: Bus, start_replica: StartReplica, world: SyntheticWorld
) -> None:
    replica = await ready_replica(start_replica, max_wait_ms=50)
    (trace,) = traces(world, 1, seed=4)
    started = time.perf_counter()
    reply = await assemble(bus, request_for(trace, wait_ms=60_000))
    assert time.perf_counter() - started < WAIT_S
    assert reply.blocks_found == 0
    assert replica.metric("eldr_signature_assembly_wait_seconds_count") == 1


async def test_two_replicas_share_the_load_with_identical_answers(
    bus: Bus, start_replica: StartReplica, world: SyntheticWorld
) -> None:
    replicas = [await start_replica(), await start_replica()]
    for replica in replicas:
        await replica.ready()
    requests = traces(world, 8, seed=6)
    for seq, trace in enumerate(requests):
        await publish(bus, batch(summaries(trace)[0], seq))
    expected = {t.request_id: expert_counts(t.prefill, E) for t in requests}
    n_rounds = 6
    for _ in range(n_rounds):
        for trace in requests:
            reply = await assemble(bus, request_for(trace, wait_ms=WAIT_S_MS))
            np.testing.assert_array_equal(counts_of(reply), expected[trace.request_id])
    answered = [
        r.metric("eldr_signature_assemblies_total", {"outcome": "complete"}) for r in replicas
    ]
    assert sum(answered) == n_rounds * len(requests)
    assert all(n > 0 for n in answered), answered  # P(all 48 to one replica) = 2**-47


async def test_late_replica_warms_up_from_the_stream_before_ready(
    bus: Bus, start_replica: StartReplica, world: SyntheticWorld, topology: Topology
) -> None:
    await apply_topology(bus, topology)
    requests = traces(world, 300, seed=7)
    n_blocks = 0
    for seq, trace in enumerate(requests):
        full = summaries(trace)[0]
        n_blocks += len(full)
        await publish(bus, batch(full, seq))
    replica = await start_replica()
    await replica.ready()
    # Ready means caught up: every batch published before the start has been read.
    assert replica.metric("eldr_signature_batches_received_total") == len(requests)
    assert replica.metric("eldr_signature_blocks_received_total") == n_blocks
    assert replica.metric("eldr_signature_replay_caught_up") == 1
    for trace in requests[:5]:
        reply = await assemble(bus, request_for(trace))  # no waiting needed
        np.testing.assert_array_equal(counts_of(reply), expert_counts(trace.prefill, E))


async def test_bad_batches_are_counted_and_the_service_keeps_serving(
    bus: Bus, start_replica: StartReplica, world: SyntheticWorld, namespace: str
) -> None:
    replica = await ready_replica(start_replica)
    first, second = traces(world, 2, seed=8)
    await publish(bus, batch(summaries(first)[0], 0))
    await bus.publish_raw(bus.subjects.blocks("p0"), b"\x93not a batch")
    # Tokens of no topic (so no block is shared with other requests), one MoE layer short.
    odd_tokens = np.random.default_rng(8).integers(0, 2**31, size=3 * BLOCK).astype(np.uint32)
    mismatched, _ = summarize_blocks(odd_tokens, world.route_prefill(odd_tokens)[:, 1:], BLOCK, E)
    await publish(bus, batch(mismatched, 2, shape=(L - 1, E)))
    await publish(bus, batch(summaries(second)[0], 3))
    # The replay is ordered: once `second` is assembled, the bad ones have been handled.
    reply = await assemble(bus, request_for(second, wait_ms=WAIT_S_MS))
    np.testing.assert_array_equal(counts_of(reply), expert_counts(second.prefill, E))
    assert (
        replica.metric("eldr_signature_batches_rejected_total", {"reason": "geometry_mismatch"})
        == 1
    )
    assert (
        replica.metric(
            "eldr_bus_messages_rejected_total", {"family": "blocks", "reason": "invalid"}
        )
        == 1
    )
    assert (
        replica.metric(
            "eldr_bus_messages_rejected_total",
            {"family": "blocks", "reason": "geometry_mismatch"},
        )
        == 1
    )
    assert replica.metric("eldr_signature_publisher_seq_gaps_total") == 1  # seq 1 was the bad one
    # Both are dead-lettered: the malformed bytes, then the refused batch.
    letters: list[DeadLetter] = []

    async def on_letter(letter: DeadLetter, _: Delivery) -> None:
        letters.append(letter)

    reader = await bus.read_back(
        stream_name(namespace, DLQ),
        bus.subjects.dlq(stream_name(namespace, BLOCKS)),
        DeadLetter,
        on_letter,
        stop_at_end=True,
    )
    await reader.wait_caught_up(timeout_s=10)
    assert [letter.payload == b"\x93not a batch" for letter in letters] == [True, False]
    assert "geometry_mismatch" in letters[1].error
    # The mismatched batch's blocks were not cached.
    mismatched_hashes = [b.block_hash or 0 for b in mismatched]
    reply = await assemble(bus, assemble_request("x", mismatched_hashes, None))
    assert reply.blocks_found == 0


async def test_unknown_model_without_partial_gets_an_error_reply(
    bus: Bus, start_replica: StartReplica
) -> None:
    replica = await ready_replica(start_replica)
    reply = await assemble(bus, assemble_request("u", [1, 2], None, model="never-seen"))
    assert reply.counts is None
    assert reply.blocks_found == 0
    assert reply.error is not None
    assert replica.metric("eldr_signature_assemblies_total", {"outcome": "error"}) == 1


async def test_byte_budget_bounds_the_cache(
    bus: Bus, start_replica: StartReplica, world: SyntheticWorld
) -> None:
    budget = 32 << 10
    replica = await ready_replica(start_replica, cache_max_bytes=budget)
    requests = traces(world, 60, seed=9)
    last_full: list[BlockSummary] = []
    for seq, trace in enumerate(requests):
        last_full = summaries(trace)[0]
        await publish(bus, batch(last_full, seq))
    # The newest block is the most recently used: waiting for it waits for every batch.
    newest = last_full[-1]
    reply = await assemble(
        bus, assemble_request("newest", [newest.block_hash or 0], None, wait_ms=WAIT_S_MS)
    )
    assert reply.blocks_found == 1
    service = replica.service.replica
    assert service is not None
    assert 0 < service.state.cache.bytes_used <= budget
    assert replica.metric("eldr_signature_cache_bytes") <= budget
    assert replica.metric("eldr_signature_cache_evictions_total") > 0
