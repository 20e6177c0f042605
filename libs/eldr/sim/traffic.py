"""Trace driver: a simulated prefill worker plus gateway, driving the pipeline over NATS.

For each request it does what a prefill worker and the gateway in front of it would do, with
the same role code: the prefill producer (`eldr.roles.prefill.PrefillProducer`: batches,
local summary store, PrefillDone) and the requester (`eldr.roles.requester`: decision
waiters, finish events). Its own are the stand-ins for the engine (a trace's recorded
routing; the set of blocks published so far as the prefix cache) and the hand-off of each
job to a simulated decode worker:

1. Cut the prompt into KV blocks (`eldr.core.signature.blocks.summarize_blocks`, with the
   trace's own token ids or deterministic stand-ins) and publish a `BlockSummaryBatch` on
   `{ns}.blocks.{prefill_worker}` holding only the full blocks this driver has not
   published before. The set of published hashes plays the prefill worker's prefix cache:
   a cached block is not recomputed, so its summary is not published again, and the
   signature service must supply it from its own cache.
2. Publish `PrefillDone` on `{ns}.prefill.done.{prefill_worker}` with the block hashes, the
   trailing partial block's counts and a `reply_to` inbox this driver listens on; and,
   as the capture plugin does, the whole prompt's `signature` when it holds its own
   summary of every cached block (`local_signatures`), else the counts of what it
   computed (`computed`), leaving the cached blocks to the signature service.
   (`send_computed` off: no counts at all, every block from the signature service.)
3. Wait for the router's `Decision` on that inbox (after `decision_timeout_s`, read it from
   the DECISIONS stream instead: the router may have decided while the reply was lost).
4. Send a `DecodeJob` to the chosen simulated decode worker (`{ns}.sim.decode.{worker}`),
   retrying once when nobody answered in time.
5. When the worker says the request's decode ended (`DecodeJobDone` on this driver's
   done inbox: the simulated end of the response stream), publish the same
   `RequestFinished` event a real gateway publishes on `{ns}.finished.{prefill worker}`;
   a request that got no decision or whose job was refused ends in one with reason
   "error". So the routers' and the trainer's bookkeeping gets the finish signal it gets
   in production, whether or not the simulated workers publish decode summaries.

It records per request the PrefillDone-publish -> Decision latency (monotonic clock), the
chosen worker and any error, and summarises a run. Arrivals are Poisson at a given rate
(seeded) or "as fast as allowed" (bounded by `max_in_flight`), the latter for the pipeline
benchmark. A library class with no global state: tests, `eldr demo` and the `simprefill`
service each make their own.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from eldr.aio import wait_event
from eldr.bus import Bus, BusError, BusTimeoutError, Delivery, NoRespondersError, Subscription
from eldr.bus import stream_name as make_stream_name
from eldr.bus.topology import DECISIONS
from eldr.core.signature.blocks import DEFAULT_BLOCK_SIZE, summarize_blocks, trace_token_ids
from eldr.core.workload.trace import EXPERT_ID_DTYPE, TraceSet
from eldr.roles.prefill import LocalSummaries, PendingBlock, PrefillProducer
from eldr.roles.requester import DecisionWaiters, FinishTracker, InFlight
from eldr.wire import (
    Decision,
    DecodeJob,
    DecodeJobAck,
    DecodeJobDone,
    NdArray,
    WireError,
)
from eldr.wire.messages import FinishReason, SignatureSource

log = logging.getLogger(__name__)

MAX_DECODING_TRACKED = 100_000
"""Jobs remembered between their DecodeJob and their DecodeJobDone (oldest dropped beyond:
a worker that died never says done)."""
MAX_ERRORS_KEPT = 20
"""Distinct error messages kept in a summary (the counts are exact)."""
_STOP_CHECK_S = 0.05
"""Gaps longer than this wait on the stop event; shorter ones just sleep."""


@dataclass(frozen=True)
class TrafficConfig:
    prefill_worker: str = "prefill-0"
    """Subject token of the simulated prefill worker (blocks and prefill-done subjects)."""
    model: str = "sim"
    block_size: int = DEFAULT_BLOCK_SIZE
    rate_per_s: float | None = 20.0
    """Poisson arrival rate; None = as fast as allowed (at most `max_in_flight` open)."""
    seed: int = 0
    """Seeds the trace choice and the arrival gaps: same seed, same requests and times."""
    decision_timeout_s: float = 5.0
    job_timeout_s: float = 2.0
    send_jobs: bool = True
    """Send each decided request to its simulated decode worker."""
    max_in_flight: int = 4096
    """Requests between PrefillDone and the end of their DecodeJob, at most."""
    send_computed: bool = True
    """Carry the counts of what this prefill computed in the PrefillDone (`computed`, with
    `cached_prefix_blocks`), so routers ask the signature service only for prefix-cache
    hits; False: every block's counts come from the signature service (and
    `local_signatures` is off too)."""
    local_signatures: bool = True
    """Keep a summary of every block published (as the capture plugin keeps one of every
    block its instance computed, `eldr.roles.prefill.LocalSummaries`): a request whose
    cached blocks are all held carries the whole `signature` and routers ask the signature
    service nothing. False: prefix-cache hits always go to the service (before v4)."""
    local_summary_blocks: int | None = None
    """Blocks the local store holds at most (least recently used evicted: a hit on an
    evicted block goes to the service); None: every block published, as many as the
    prefix cache."""
    request_id_prefix: str | None = None
    """Request ids are f"{prefix}-{n:06d}"; None = prefill worker + a random run token (the
    DECISIONS stream keeps the first decision per id, so ids must not repeat across runs)."""
    publish_finished: bool = True
    """Publish a `RequestFinished` per request, as the gateway does (the finish signal the
    routers and the trainer rely on); the gateway id is `prefill_worker`."""
    block_hash_key: bytes = b""
    """The deployment's block-hash key (`eldr.settings.BlockHashSettings`; empty: unkeyed)."""

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.rate_per_s is not None and not self.rate_per_s > 0:
            raise ValueError(f"rate_per_s must be positive or None, got {self.rate_per_s}")
        if self.decision_timeout_s <= 0 or self.job_timeout_s <= 0:
            raise ValueError("timeouts must be positive")
        if self.max_in_flight <= 0:
            raise ValueError(f"max_in_flight must be positive, got {self.max_in_flight}")
        if self.local_summary_blocks is not None and self.local_summary_blocks < 0:
            raise ValueError(
                f"local_summary_blocks must be >= 0 or None, got {self.local_summary_blocks}"
            )


@dataclass
class RequestRecord:
    """What happened to one replayed request."""

    request_id: str
    trace_index: int
    label: str
    scheduled_s: float
    """Planned start, seconds after the run's start."""
    lag_s: float = 0.0
    """How late it started (the in-flight bound or a busy loop)."""
    blocks_published: int = 0
    sent: bool = False
    """Its PrefillDone was stored by the PREFILL stream."""
    decision_latency_s: float | None = None
    """PrefillDone publish -> Decision on the inbox; None if the decision came otherwise."""
    router_decide_s: float | None = None
    """The router's own part of it (`Decision.decide_s`: PrefillDone taken -> decision
    built, signature fetch included; its publish not)."""
    worker_id: str | None = None
    policy: str | None = None
    fallback: str | None = None
    recovered: bool = False
    """The inbox timed out and the decision was read from the DECISIONS stream."""
    job_accepted: bool | None = None
    error: str | None = None
    signature_source: SignatureSource | None = None
    """Where its PrefillDone leaves the router to find its counts
    (`PrefillDone.signature_source`: "event", "computed", "service", ...)."""


@dataclass(frozen=True)
class TrafficSummary:
    sent: int
    """PrefillDone events published."""
    decided: int
    """Requests with a decision (on the inbox or, late, from the stream)."""
    recovered: int
    """... of which the decision was read from the stream after the inbox timed out."""
    lost: int
    """Sent, but no decision anywhere."""
    duplicates: int
    """Extra Decision replies for a request that already had one."""
    conflicting: int
    """... of which named another worker than the first (a double assignment)."""
    latency_p50_ms: float
    latency_p99_ms: float
    latency_max_ms: float
    per_worker: dict[str, int]
    per_policy: dict[str, int]
    fallbacks: dict[str, int]
    jobs_accepted: int
    jobs_refused: int
    errors: int
    error_samples: list[str]
    blocks_published: int
    block_batches: int
    signature_sources: dict[str, int]
    """PrefillDone events sent, by where they leave the router to find the counts
    (`PrefillDone.signature_source`): "event" (the whole signature), "computed" (no
    prefix hit), "service" (the signature service sums the cached blocks), ..."""
    elapsed_s: float
    offered_rate_per_s: float | None
    achieved_rate_per_s: float
    max_lag_s: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Prepared:
    """A trace cut into blocks, encoded once for every replay of it."""

    label: str
    blocks: list[PendingBlock]
    partial_counts: np.ndarray | None
    n_prompt_tokens: int
    decode_ids: NdArray
    decode_tokens: int


@dataclass
class _RunState:
    records: list[RequestRecord] = field(default_factory=list)


class TrafficDriver:
    """Replays a TraceSet through the pipeline (see the module docstring).

    Use as `async with TrafficDriver(bus, traces, config) as driver: await
    driver.run(100)`; several runs may follow one another (not overlap).
    """

    def __init__(self, bus: Bus, traces: TraceSet, config: TrafficConfig | None = None) -> None:
        if len(traces) == 0:
            raise ValueError("no traces to replay")
        self.bus = bus
        self.traces = traces
        self.config = config or TrafficConfig()
        self.inbox = bus.new_inbox()
        self.done_inbox = bus.new_inbox()
        """Where simulated decode workers say a job's decode ended (`DecodeJobDone`)."""
        self._decoding: dict[str, tuple[FinishTracker, str, float]] = {}
        """request id -> (its finish events, worker, monotonic time its job was sent),
        until it is done."""
        self._in_decode = InFlight()
        """How many of `_decoding` there are (`wait_decoded` waits for none)."""
        self.finished_published = 0
        self.records: list[RequestRecord] = []
        """The last run's per-request records."""
        self._prepared: dict[int, _Prepared] = {}
        self._published: dict[int, asyncio.Future[None] | None] = {}
        """Block hash -> None once published, or the future of its publication in flight:
        the simulated prefix cache."""
        c, geometry = self.config, traces.geometry
        keep_local = c.send_computed and c.local_signatures and c.local_summary_blocks != 0
        self.producer = PrefillProducer(
            c.prefill_worker,
            c.model,
            c.block_size,
            geometry.num_moe_layers,
            geometry.num_experts,
            LocalSummaries(max_blocks=c.local_summary_blocks) if keep_local else None,
        )
        """The simulated prefill worker's producer role: batch numbers, and its own summary
        of every block it published (of the last `local_summary_blocks`)."""
        self._waiters = DecisionWaiters(clock=time.monotonic)
        self._decided: dict[str, str] = {}
        """request id -> worker of its first Decision on the inbox (duplicate detection);
        this run's ids, and the previous run's in `_decided_before` (memory stays bounded
        when a service replays forever)."""
        self._decided_before: dict[str, str] = {}
        self._duplicates = 0
        self._conflicting = 0
        self._block_batches = 0
        self._subscription: Subscription | None = None
        self._done_subscription: Subscription | None = None
        self._state = _RunState()
        self._stop = asyncio.Event()
        self._run_token = uuid.uuid4().hex[:8]
        self._next_request = 0
        self._rng = np.random.default_rng(self.config.seed)

    # --- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        """Listen on the reply inbox (done by `run` if needed)."""
        if self._subscription is None:
            self._subscription = await self.bus.subscribe(self.inbox, Decision, self._on_decision)
        if self._done_subscription is None:
            self._done_subscription = await self.bus.subscribe(
                self.done_inbox, DecodeJobDone, self._on_job_done
            )

    async def wait_decoded(self, timeout_s: float) -> int:
        """Wait (up to `timeout_s`) until every job sent has said its decode ended, so its
        finish event is published before the driver closes; returns how many did not."""
        await self._in_decode.wait_idle(timeout_s)
        return len(self._decoding)

    def _forget(self, request_id: str) -> tuple[FinishTracker, str, float] | None:
        sent = self._decoding.pop(request_id, None)
        if sent is not None:
            self._in_decode.leave()
        return sent

    async def close(self) -> None:
        for sub in (self._subscription, self._done_subscription):
            if sub is not None:
                await sub.stop()
        self._subscription = self._done_subscription = None

    async def __aenter__(self) -> TrafficDriver:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def request_stop(self) -> None:
        """Make `run` stop starting requests (those in flight complete); later runs start
        none until `resume()`."""
        self._stop.set()

    def resume(self) -> None:
        self._stop.clear()

    @property
    def duplicate_replies(self) -> int:
        """Extra Decision replies seen on the inbox since the driver was made."""
        return self._duplicates

    @property
    def conflicting_replies(self) -> int:
        """... of which named another worker than the first reply (a double assignment)."""
        return self._conflicting

    @property
    def started_requests(self) -> int:
        """Requests the current (or last) run has started so far (for progress bars)."""
        return len(self._state.records)

    @property
    def published_blocks(self) -> int:
        """Distinct blocks published so far (the simulated prefix cache's size)."""
        return len(self._published)

    # --- preparation ------------------------------------------------------------------

    def prepare(self, index: int) -> _Prepared:
        """Block summaries and wire arrays of trace `index` (computed once)."""
        prepared = self._prepared.get(index)
        if prepared is not None:
            return prepared
        trace = self.traces.traces[index]
        geometry = self.traces.geometry
        full, partial = summarize_blocks(
            trace_token_ids(trace),
            trace.prefill,
            self.config.block_size,
            geometry.num_experts,
            key=self.config.block_hash_key,
        )
        blocks = [
            PendingBlock(int(b.block_hash), b.parent_hash, b.n_tokens, b.counts)
            for b in full
            if b.block_hash is not None  # full blocks always have a hash
        ]
        prepared = _Prepared(
            label=trace.label,
            blocks=blocks,
            partial_counts=partial.counts if partial is not None else None,
            n_prompt_tokens=trace.prompt_tokens,
            decode_ids=NdArray.from_numpy(np.ascontiguousarray(trace.decode, EXPERT_ID_DTYPE)),
            decode_tokens=trace.decode_tokens,
        )
        self._prepared[index] = prepared
        return prepared

    def plan(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        """The next `count` requests: (trace indices, start offsets in seconds).

        Drawn from the driver's seeded generator, so two drivers with the same seed
        plan the same requests (how a demo compares policies on identical traffic)."""
        indices = self._rng.integers(0, len(self.traces), size=count)
        rate = self.config.rate_per_s
        if rate is None:
            offsets = np.zeros(count)
        else:
            offsets = np.cumsum(self._rng.exponential(1.0 / rate, size=count))
            offsets -= offsets[0] if count else 0.0
        return indices, offsets

    # --- running ----------------------------------------------------------------------

    async def run(
        self, count: int, planned: tuple[np.ndarray, np.ndarray] | None = None
    ) -> TrafficSummary:
        """Replay `count` requests and summarise them (records in `self.records`).

        planned: their (trace indices, start offsets in seconds), drawn by the caller (the
        demo keeps copies of a request apart, `eldr.core.workload.arrivals`); None: `plan`."""
        if count < 0:
            raise ValueError(f"count must be non-negative, got {count}")
        if planned is not None and not len(planned[0]) == len(planned[1]) == count:
            raise ValueError(f"planned arrivals must number {count}")
        await self.start()
        indices, offsets = self.plan(count) if planned is None else planned
        for index in set(indices.tolist()):
            self.prepare(int(index))  # before the clock starts
        state = _RunState()
        self._state = state
        self._decided_before, self._decided = self._decided, {}
        duplicates_before, conflicting_before = self._duplicates, self._conflicting
        batches_before = self._block_batches
        slots = asyncio.Semaphore(self.config.max_in_flight)
        tasks: list[asyncio.Task[None]] = []
        started = time.monotonic()
        for n in range(count):
            if self._stop.is_set():
                break
            delay = started + float(offsets[n]) - time.monotonic()
            if delay > _STOP_CHECK_S:
                await wait_event(self._stop, delay)
                if self._stop.is_set():
                    break
            elif delay > 0:
                # A plain sleep: waiting on the stop event costs a task per request, too
                # much at thousands of requests per second.
                await asyncio.sleep(delay)
            await slots.acquire()
            record = RequestRecord(
                request_id=self._request_id(),
                trace_index=int(indices[n]),
                label=self.traces.traces[int(indices[n])].label,
                scheduled_s=float(offsets[n]),
                lag_s=max(0.0, time.monotonic() - started - float(offsets[n])),
            )
            state.records.append(record)
            task = asyncio.create_task(self._one(record))
            task.add_done_callback(lambda _: slots.release())
            tasks.append(task)
        if tasks:
            await asyncio.gather(*tasks)
        elapsed = time.monotonic() - started
        self.records = state.records
        return self._summarise(
            state.records,
            elapsed_s=elapsed,
            duplicates=self._duplicates - duplicates_before,
            conflicting=self._conflicting - conflicting_before,
            block_batches=self._block_batches - batches_before,
        )

    def _request_id(self) -> str:
        prefix = self.config.request_id_prefix or f"{self.config.prefill_worker}-{self._run_token}"
        self._next_request += 1
        return f"{prefix}-{self._next_request:06d}"

    async def _one(self, record: RequestRecord) -> None:
        finish = FinishTracker(record.request_id, self.config.prefill_worker, time.time)
        try:
            prepared = self.prepare(record.trace_index)
            record.blocks_published = await self._publish_blocks(prepared)
            decision = await self._prefill_done(record, prepared)
            if decision is None:
                await self._finished(finish, None, "error")
                return
            record.worker_id = decision.worker_id
            record.policy = decision.policy
            record.router_decide_s = decision.decide_s
            record.fallback = decision.fallback
            if self.config.send_jobs:
                record.job_accepted = await self._send_job(record, prepared, decision, finish)
                if not record.job_accepted:
                    await self._finished(finish, decision.worker_id, "error")
        except (BusError, WireError) as exc:
            record.error = f"{type(exc).__name__}: {exc}"
            log.warning("replay %s: %s", record.request_id, record.error)
            self._forget(record.request_id)
            await self._finished(finish, record.worker_id, "error")

    async def _on_job_done(self, done: DecodeJobDone, _: Delivery) -> None:
        sent = self._forget(done.request_id)
        if sent is None:
            return  # not ours, or reported twice
        finish, worker, sent_s = sent
        await self._finished(
            finish,
            worker,
            done.reason,
            output_tokens=done.output_tokens,
            decode_s=time.monotonic() - sent_s,
        )

    async def _finished(
        self,
        finish: FinishTracker,
        worker: str | None,
        reason: FinishReason,
        *,
        output_tokens: int | None = None,
        decode_s: float | None = None,
    ) -> None:
        """Publish the request's RequestFinished, as the gateway would (once; never
        raises)."""
        if not self.config.publish_finished:
            return
        event = finish.finished(worker, reason, output_tokens=output_tokens, decode_s=decode_s)
        if event is None:
            return
        try:
            await self.bus.publish(self.bus.subjects.finished(self.config.prefill_worker), event)
            self.finished_published += 1
        except BusError as exc:
            log.warning("replay %s: finish event not published: %s", finish.request_id, exc)

    async def _publish_blocks(self, prepared: _Prepared) -> int:
        """Publish the blocks not published before; wait for those another request is
        publishing right now (a prefix-cache hit needs the block computed first)."""
        mine: list[PendingBlock] = []
        theirs: list[asyncio.Future[None]] = []
        loop = asyncio.get_running_loop()
        for block in prepared.blocks:
            if block.block_hash in self._published:
                pending = self._published[block.block_hash]
                if pending is not None:
                    theirs.append(pending)
                continue
            self._published[block.block_hash] = loop.create_future()
            mine.append(block)
        try:
            first_seq = self.producer.reserve(len(mine))
            subject = self.bus.subjects.blocks(self.config.prefill_worker)
            for batch in self.producer.batches(first_seq, time.time(), mine):
                await self.bus.js_publish(subject, batch)
                self._block_batches += 1
        except BaseException:
            for block in mine:  # not published: a later request may try again
                future = self._published.pop(block.block_hash, None)
                if future is not None and not future.done():
                    future.set_result(None)
            raise
        for block in mine:
            future = self._published.get(block.block_hash)
            self._published[block.block_hash] = None
            if future is not None and not future.done():
                future.set_result(None)
        if theirs:
            await asyncio.gather(*theirs)
        return len(mine)

    async def _prefill_done(self, record: RequestRecord, prepared: _Prepared) -> Decision | None:
        """Publish the request's PrefillDone (the producer role's: the whole signature when
        its store holds every cached block) and wait for its decision (the requester
        role's: the inbox, then the DECISIONS stream)."""
        geometry = self.traces.geometry
        cached = len(prepared.blocks) - record.blocks_published
        computed: np.ndarray | None = None
        if self.config.send_computed:
            computed = np.zeros((geometry.num_moe_layers, geometry.num_experts), dtype=np.uint32)
            for block in prepared.blocks[cached:]:
                computed += block.counts
            if prepared.partial_counts is not None:
                computed += prepared.partial_counts
        event = self.producer.done(
            self.producer.pending_done(
                request_id=record.request_id,
                wall_s=time.time(),
                block_hashes=[b.block_hash for b in prepared.blocks],
                n_prompt_tokens=prepared.n_prompt_tokens,
                cached_blocks=cached,
                computed=computed,
                partial=prepared.partial_counts,
                reply_to=self.inbox,
                max_tokens=prepared.decode_tokens,
                attrs={"label": prepared.label[:1024]},
                # It stops waiting after decision_timeout_s (and one read of the stream).
                decision_budget_s=self.config.decision_timeout_s,
            )
        )
        record.signature_source = event.signature_source
        with self._waiters.expecting(record.request_id) as waiter:
            published_at = time.monotonic()
            await self.bus.js_publish(
                self.bus.subjects.prefill_done(self.config.prefill_worker),
                event,
                msg_id=record.request_id,
            )
            record.sent = True
            decided = await self._waiters.wait(
                record.request_id,
                waiter,
                timeout_s=self.config.decision_timeout_s,
                read_late=self._read_decision,
            )
        if decided is None:
            record.error = f"no decision within {self.config.decision_timeout_s:g} s"
            return None
        if decided.source == "inbox":
            assert decided.arrived_s is not None  # the waiters have a clock
            record.decision_latency_s = decided.arrived_s - published_at
        else:
            record.recovered = True
        return _assigned(record, decided.decision)

    async def _read_decision(self, request_id: str) -> Decision | None:
        """The decision recorded on the DECISIONS stream (the inbox reply was late)."""
        return await self.bus.get_last(
            make_stream_name(self.bus.settings.namespace, DECISIONS),
            self.bus.subjects.decision(request_id),
            Decision,
        )

    async def _on_decision(self, decision: Decision, _: Delivery) -> None:
        first = self._decided.get(decision.request_id) or self._decided_before.get(
            decision.request_id
        )
        if first is not None:
            self._duplicates += 1
            if first != decision.worker_id:
                self._conflicting += 1
                log.error(
                    "request %s decided twice: %s, then %s",
                    decision.request_id,
                    first,
                    decision.worker_id,
                )
            return
        self._decided[decision.request_id] = decision.worker_id
        self._waiters.deliver(decision)

    async def _send_job(
        self,
        record: RequestRecord,
        prepared: _Prepared,
        decision: Decision,
        finish: FinishTracker,
    ) -> bool:
        job = DecodeJob(
            request_id=record.request_id,
            worker_id=decision.worker_id,
            model=self.config.model,
            prompt_tokens=prepared.n_prompt_tokens,
            decode_ids=prepared.decode_ids,
            label=prepared.label[:256],
            done_to=self.done_inbox if self.config.publish_finished else None,
        )
        if self.config.publish_finished and record.request_id not in self._decoding:
            self._decoding[record.request_id] = (finish, decision.worker_id, time.monotonic())
            self._in_decode.enter()
            while len(self._decoding) > MAX_DECODING_TRACKED:
                self._forget(next(iter(self._decoding)))
        subject = self.bus.subjects.sim_decode(decision.worker_id)
        for attempt in (1, 2):
            try:
                ack = await self.bus.request(
                    subject, job, DecodeJobAck, timeout_s=self.config.job_timeout_s
                )
            except (NoRespondersError, BusTimeoutError) as exc:
                if attempt == 2:
                    raise
                log.info("replay %s: job not delivered (%s), retrying", record.request_id, exc)
                continue
            if not ack.accepted:
                record.error = f"job refused by {decision.worker_id}: {ack.reason}"
                self._forget(record.request_id)
            return ack.accepted
        return False  # not reached: the second failure raises

    # --- summary ----------------------------------------------------------------------

    def _summarise(
        self,
        records: list[RequestRecord],
        *,
        elapsed_s: float,
        duplicates: int,
        conflicting: int,
        block_batches: int,
    ) -> TrafficSummary:
        latencies_ms = [
            r.decision_latency_s * 1e3 for r in records if r.decision_latency_s is not None
        ]
        decided = [r for r in records if r.worker_id is not None]
        per_worker: dict[str, int] = {}
        per_policy: dict[str, int] = {}
        fallbacks: dict[str, int] = {}
        for r in decided:
            assert r.worker_id is not None
            per_worker[r.worker_id] = per_worker.get(r.worker_id, 0) + 1
            if r.policy is not None:
                per_policy[r.policy] = per_policy.get(r.policy, 0) + 1
            if r.fallback:
                fallbacks[r.fallback] = fallbacks.get(r.fallback, 0) + 1
        errors = [r.error for r in records if r.error is not None]
        sources: dict[str, int] = {}
        for r in records:
            if r.sent and r.signature_source is not None:
                sources[r.signature_source] = sources.get(r.signature_source, 0) + 1
        samples: list[str] = []
        for e in errors:
            if e not in samples and len(samples) < MAX_ERRORS_KEPT:
                samples.append(e)

        def pct(q: float) -> float:
            return float(np.percentile(latencies_ms, q)) if latencies_ms else math.nan

        return TrafficSummary(
            sent=sum(1 for r in records if r.sent),
            decided=len(decided),
            recovered=sum(1 for r in records if r.recovered),
            lost=sum(1 for r in records if r.sent and r.worker_id is None),
            duplicates=duplicates,
            conflicting=conflicting,
            latency_p50_ms=pct(50.0),
            latency_p99_ms=pct(99.0),
            latency_max_ms=max(latencies_ms) if latencies_ms else math.nan,
            per_worker=dict(sorted(per_worker.items())),
            per_policy=dict(sorted(per_policy.items())),
            fallbacks=dict(sorted(fallbacks.items())),
            jobs_accepted=sum(1 for r in records if r.job_accepted is True),
            jobs_refused=sum(1 for r in records if r.job_accepted is False),
            errors=len(errors),
            error_samples=samples,
            blocks_published=sum(r.blocks_published for r in records),
            block_batches=block_batches,
            signature_sources=dict(sorted(sources.items())),
            elapsed_s=elapsed_s,
            offered_rate_per_s=self.config.rate_per_s,
            achieved_rate_per_s=len(records) / elapsed_s if elapsed_s > 0 else math.nan,
            max_lag_s=max((r.lag_s for r in records), default=0.0),
        )


def _assigned(record: RequestRecord, decision: Decision) -> Decision | None:
    """The decision, or None (saying why) for an expired record: the router took the event
    after its deadline and assigned no worker."""
    if decision.assigned:
        return decision
    record.error = "decision expired (the router took the event after its deadline)"
    return None
