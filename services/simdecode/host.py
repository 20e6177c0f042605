"""The simulated decode workers of one process, in scaled real time.

Each worker is an `eldr.sim.worker.BatchingWorker` driven by an asyncio task: while it has
requests it plans a step, sleeps the step's cost-model duration times `time_scale`, and
finishes the step. Steps are chained on a deadline (the next step starts when the previous
one should have ended), so event-loop jitter does not accumulate into the simulated clock:
a step the loop starts late keeps its planned start (the following sleeps are shorter until
the worker has caught up; requests submitted meanwhile join the first boundary after their
submission), unless the worker is more than `max_lag_s` behind, when its schedule restarts
from now. Both are measured (`eldr_simdecode_late_seconds_total`, `..._lost_seconds_total`).

Bus surface per worker: `DecodeJob` requests on `{ns}.sim.decode.{worker}` (answered at
once), `LoadReport`s on `{ns}.load.{worker}` every report interval, a `DecodeJobDone` to
the job's `done_to` inbox when its decode ends (what the real gateway sees when the
response stream closes; the simulated gateway turns it into the same `RequestFinished`),
a `DecodeSummary` on `{ns}.profiles.{worker}` per finished request unless
`publish_summaries` is off (a real vLLM decode instance publishes one only with the capture
plugin on), and a `SimStats` answer to every `SimStatsRequest` on `{ns}.sim.stats`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np

from eldr.bus import Bus, BusError
from eldr.core.costmodel import Deployment
from eldr.sim.worker import BatchingWorker, FinishedRequest
from eldr.wire import (
    DecodeJob,
    DecodeJobAck,
    DecodeJobDone,
    DecodeSummary,
    LoadReport,
    NdArray,
    SimStats,
    SimStatsRequest,
    SparseCounts,
    WireError,
)
from eldr.wire.base import MAX_ADMITTED

from .metrics import SimDecodeMetrics

log = logging.getLogger(__name__)

SUMMARY_RETRY_S = 30.0
"""How long a decode summary's publish is retried through a NATS cluster's expected faults
(a PROFILES leader election takes 4-9 s) before it is dropped and counted."""


@dataclass(frozen=True)
class HostConfig:
    """What the host needs from the settings (kept separate so tests build it directly)."""

    worker_ids: tuple[str, ...]
    cost: Deployment
    num_experts: int
    time_scale: float = 1.0
    max_batch: int = 64
    kv_capacity_tokens: int = 1_000_000
    report_interval_s: float = 0.1
    drain_grace_s: float = 5.0
    summary_queue: int = 10_000
    publish_summaries: bool = True
    """Publish a DecodeSummary per finished request (off: like a decode instance without
    the capture plugin; the finish events alone close the loop)."""
    max_lag_s: float = 0.25
    """A busy worker whose event loop is late keeps its steps on the cost model's schedule
    (shorter sleeps until it has caught up) while it is late by at most this (real
    seconds); beyond, its schedule restarts from now and the lag is counted as lost."""


@dataclass
class _Live:
    """One worker's state plus what the bus side needs around it."""

    state: BatchingWorker
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    admitted_now: list[str] = field(default_factory=list)
    admitted_before: list[str] = field(default_factory=list)
    seq: int = 0
    deadline_s: float = 0.0
    """Monotonic time at which the current step should end."""
    task: asyncio.Task[None] | None = None


class SimDecodeHost:
    """The workers of one process; `start()` wires them to the bus, `drain()` stops them."""

    def __init__(
        self,
        bus: Bus,
        config: HostConfig,
        metrics: SimDecodeMetrics,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.bus = bus
        self.config = config
        self.metrics = metrics
        self.incarnation = uuid.uuid4().hex
        self.draining = False
        self._clock = clock
        self._wall = wall_clock
        self._workers: dict[str, _Live] = {
            wid: _Live(
                BatchingWorker(
                    wid,
                    config.cost,
                    num_experts=config.num_experts,
                    max_batch=config.max_batch,
                    kv_capacity_tokens=config.kv_capacity_tokens,
                )
            )
            for wid in config.worker_ids
        }
        self._summaries: asyncio.Queue[tuple[str, FinishedRequest]] = asyncio.Queue(
            maxsize=config.summary_queue
        )
        self._done_to: dict[str, str] = {}
        """request id -> the inbox its DecodeJobDone goes to, while it decodes."""
        self._report_task: asyncio.Task[None] | None = None
        self._summary_task: asyncio.Task[None] | None = None

    @property
    def worker_ids(self) -> tuple[str, ...]:
        return self.config.worker_ids

    def worker(self, worker_id: str) -> BatchingWorker:
        return self._workers[worker_id].state

    def _sim_now(self) -> float:
        return self._clock() / self.config.time_scale

    # --- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        subjects = self.bus.subjects
        for wid, live in self._workers.items():
            await self.bus.serve(subjects.sim_decode(wid), None, DecodeJob, self._job_handler(wid))
            await self.bus.serve(
                subjects.sim_stats, None, SimStatsRequest, self._stats_handler(wid)
            )
            live.task = asyncio.create_task(self._step_loop(wid, live), name=f"simdecode {wid}")
        self._report_task = asyncio.create_task(self._report_loop(), name="simdecode reports")
        self._summary_task = asyncio.create_task(self._summary_loop(), name="simdecode summaries")
        log.info(
            "simdecode hosting %d workers (%s), deployment %s, time scale %g, incarnation %s",
            len(self._workers),
            ", ".join(self._workers),
            self.config.cost.name,
            self.config.time_scale,
            self.incarnation,
        )

    async def drain(self) -> int:
        """Refuse new jobs, tell the routers (a draining report), let accepted requests
        decode for up to `drain_grace_s`, abandon the rest, publish the final reports and
        the pending summaries. Returns the number of requests abandoned."""
        self.draining = True
        await self._publish_reports()
        deadline = self._clock() + self.config.drain_grace_s
        while any(not live.state.idle for live in self._workers.values()):
            remaining = deadline - self._clock()
            if remaining <= 0:
                break
            await asyncio.sleep(min(remaining, 0.01))
        abandoned = 0
        for wid, live in self._workers.items():
            if live.task is not None:
                live.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await live.task
                live.task = None
            dropped = live.state.abandon()
            for rid in dropped:
                await self._say_done(rid, wid, "abort", 0)
            if dropped:
                abandoned += len(dropped)
                self.metrics.abandoned.labels(wid).inc(len(dropped))
                log.warning(
                    "simdecode %s: abandoned %d unfinished requests at shutdown (e.g. %s)",
                    wid,
                    len(dropped),
                    dropped[0],
                )
            self._update_gauges(wid, live.state)
        if self._report_task is not None:
            self._report_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._report_task
            self._report_task = None
        await self._publish_reports()
        if self._summary_task is not None:
            # Publish what finished during the grace period, then stop.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5.0):
                    await self._summaries.join()
            self._summary_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._summary_task
            self._summary_task = None
        log.info("simdecode drained (%d requests abandoned)", abandoned)
        return abandoned

    # --- handlers ---------------------------------------------------------------------

    def _job_handler(self, wid: str) -> Callable[[DecodeJob], Awaitable[DecodeJobAck]]:
        async def handle(job: DecodeJob) -> DecodeJobAck:
            return self.submit(wid, job)

        return handle

    def submit(self, wid: str, job: DecodeJob) -> DecodeJobAck:
        """Accept or refuse one job for worker `wid` (what the job handler answers)."""
        live = self._workers[wid]
        if self.draining:
            self.metrics.jobs.labels(wid, "draining").inc()
            return DecodeJobAck(request_id=job.request_id, accepted=False, reason="draining")
        if job.worker_id != wid:
            self.metrics.jobs.labels(wid, "wrong_worker").inc()
            return DecodeJobAck(
                request_id=job.request_id,
                accepted=False,
                reason=f"job addressed to {job.worker_id} arrived at {wid}",
            )
        reason = live.state.submit(
            job.request_id,
            job.decode_ids.to_numpy(),
            self._sim_now(),
            prompt_tokens=job.prompt_tokens,
            label=job.label,
        )
        if reason is not None:
            self.metrics.jobs.labels(wid, "invalid").inc()
            log.warning("simdecode %s refused %s: %s", wid, job.request_id, reason)
            return DecodeJobAck(request_id=job.request_id, accepted=False, reason=reason)
        self.metrics.jobs.labels(wid, "accepted").inc()
        if job.done_to is not None:
            self._done_to[job.request_id] = job.done_to
        live.admitted_now.append(job.request_id)
        self._update_gauges(wid, live.state)
        live.wake.set()
        return DecodeJobAck(request_id=job.request_id, accepted=True)

    def _stats_handler(self, wid: str) -> Callable[[SimStatsRequest], Awaitable[SimStats]]:
        async def handle(request: SimStatsRequest) -> SimStats:
            return self.stats(wid, reset=request.reset)

        return handle

    def stats(self, wid: str, *, reset: bool = False) -> SimStats:
        state = self._workers[wid].state
        s = state.stats
        reply = SimStats(
            worker_id=wid,
            steps=s.steps,
            union_per_layer_sum=s.union_per_layer_sum,
            batch_sum=s.batch_sum,
            finished=s.finished,
            tpot_s=NdArray.from_numpy(np.asarray(s.tpot_s, dtype=np.float32)),
            running=len(state.running),
            waiting=len(state.waiting),
        )
        if reset:
            state.reset_stats()
        return reply

    # --- loops ------------------------------------------------------------------------

    async def _step_loop(self, wid: str, live: _Live) -> None:
        state = live.state
        scale = self.config.time_scale
        m = self.metrics
        busy = False
        while True:
            now = self._clock()
            if live.deadline_s < now:
                late = now - live.deadline_s
                if busy:
                    # The event loop woke us late: the hardware modelled would have started
                    # this step on time, so the schedule stands and the next sleeps are
                    # shorter until it is caught up (requests submitted meanwhile join the
                    # first step boundary after their submission).
                    m.late_seconds.labels(wid).inc(late)
                    m.late_steps.labels(wid).inc()
                if not busy or late > self.config.max_lag_s:
                    if busy:
                        m.lost_seconds.labels(wid).inc(late)
                    live.deadline_s = now  # idle (or hopelessly late): restart from now
            plan = state.start_step(live.deadline_s / scale)
            if plan is None and state.waiting:
                # Only requests submitted after this (past) boundary are left: start afresh.
                busy = False
                live.deadline_s = max(live.deadline_s, self._clock())
                continue
            if plan is None:
                busy = False
                live.wake.clear()
                self._update_gauges(wid, state)
                await live.wake.wait()
                continue
            busy = True
            live.deadline_s += plan.duration_s * scale
            m.steps.labels(wid).inc()
            m.union.labels(wid).observe(plan.union_per_layer)
            m.batch.labels(wid).observe(plan.batch_size)
            m.step_seconds.labels(wid).observe(plan.duration_s)
            await asyncio.sleep(max(0.0, live.deadline_s - self._clock()))
            for done in state.finish_step(plan, live.deadline_s / scale):
                m.finished.labels(wid).inc()
                m.tpot_seconds.labels(wid).observe(done.tpot_s)
                # The end of the response goes out at once, as a real decode stream closes
                # with its last token; the summary is a separate, later publish.
                await self._say_done(done.request_id, wid, "length", done.decode_tokens)
                if not self.config.publish_summaries:
                    continue
                try:
                    self._summaries.put_nowait((wid, done))
                except asyncio.QueueFull:
                    m.profiles_dropped.labels("queue_full").inc()
            self._update_gauges(wid, state)

    def _update_gauges(self, wid: str, state: BatchingWorker) -> None:
        self.metrics.running.labels(wid).set(len(state.running))
        self.metrics.waiting.labels(wid).set(len(state.waiting))
        self.metrics.kv_tokens.labels(wid).set(state.kv_tokens)

    def load_report(self, wid: str) -> LoadReport:
        """The worker's next LoadReport; rotates its admitted-id window."""
        live = self._workers[wid]
        state = live.state
        # Ids of this interval and the previous one: one lost report loses no id.
        admitted = (live.admitted_before + live.admitted_now)[-MAX_ADMITTED:]
        live.admitted_before, live.admitted_now = live.admitted_now, []
        report = LoadReport(
            worker_id=wid,
            incarnation=self.incarnation,
            seq=live.seq,
            ts_s=self._wall(),
            running=len(state.running),
            waiting=len(state.waiting),
            kv_tokens=state.kv_tokens,
            kv_capacity_tokens=self.config.kv_capacity_tokens,
            admitted=admitted,
            draining=self.draining,
        )
        live.seq += 1
        return report

    async def _publish_reports(self) -> None:
        for wid in self._workers:
            report = self.load_report(wid)
            try:
                await self.bus.publish(self.bus.subjects.load(wid), report)
                self.metrics.reports.inc()
            except BusError as exc:
                what = f"simdecode {wid}: load report {report.seq} not sent: {exc}"
                if not self.bus.note_fault("publish", exc, what):
                    log.warning("%s", what)

    async def _report_loop(self) -> None:
        interval = self.config.report_interval_s
        next_s = self._clock()
        while True:
            await self._publish_reports()
            next_s = max(next_s + interval, self._clock())
            await asyncio.sleep(next_s - self._clock())

    async def _summary_loop(self) -> None:
        while True:
            wid, done = await self._summaries.get()
            try:
                await self._publish_summary(wid, done)
            finally:
                self._summaries.task_done()

    async def _say_done(self, request_id: str, wid: str, reason: str, tokens: int) -> None:
        """Tell the job's sender its decode ended (the simulated end of the response)."""
        inbox = self._done_to.pop(request_id, None)
        if inbox is None:
            return
        try:
            await self.bus.publish(
                inbox,
                DecodeJobDone(
                    request_id=request_id,
                    worker_id=wid,
                    reason=reason,  # type: ignore[arg-type]
                    output_tokens=tokens,
                ),
            )
        except BusError as exc:
            what = f"simdecode {wid}: end of {request_id} not reported: {exc}"
            if not self.bus.note_fault("publish", exc, what):
                log.warning("%s", what)

    async def _publish_summary(self, wid: str, done: FinishedRequest) -> None:
        try:
            summary = DecodeSummary(
                request_id=done.request_id,
                worker_id=wid,
                ts_s=self._wall(),
                tokens=done.decode_tokens,
                counts=SparseCounts.from_dense(done.decode_counts),
                tpot_s=done.tpot_s,
            )
            # Retried through a leader election (the message id de-duplicates a retry that
            # was stored after all); the queue holds the next ones meanwhile.
            await self.bus.retrying(
                "publish",
                lambda: self.bus.js_publish(
                    self.bus.subjects.profiles(wid), summary, msg_id=f"profile-{done.request_id}"
                ),
                give_up_s=SUMMARY_RETRY_S,
            )
        except (BusError, WireError) as exc:
            self.metrics.profiles_dropped.labels("publish_failed").inc()
            what = f"simdecode {wid}: summary of {done.request_id} not published: {exc}"
            if not self.bus.note_fault("publish", exc, what):
                log.warning("%s", what)
