"""Routing service: assigns each prefilled request a decode worker, exactly once.

Inputs: PrefillDone events (JetStream, durable consumer shared by all replicas, at least
once), load reports (core), every replica's decisions (to keep the fleet-wide load table),
the gateways' finish events and decode summaries (a request leaves the load and activity
tables), partition announcements (`partitions.PartitionLoader`). For each PrefillDone: take
its signature (`eldr.roles.signature`: carried in the event when the prefill worker held
every cached block, else request/reply to the signature service for the cached blocks,
bounded wait), decide (`eldr.core.routing.decide`), count the decision in the load and
activity tables at once, commit it with "expected last subject sequence 0" on the
request's decision subject (the first decision for a request id wins; a redelivery reads
the committed one instead of deciding again; a decision that does not stand is taken back
out of the tables), answer the requester (`replies.Replies`), ack. What each input does to
the tables is the router role's (`eldr.roles.router`); this shell adds the transport, the
metrics and the logs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import numpy as np

from eldr.bus import (
    ROUTER_CONSUMER,
    Committed,
    Delivery,
    Retry,
    build_topology,
    hold_while,
)
from eldr.bus.topology import DECISIONS, IDENTITY, PARTITIONS, PREFILL
from eldr.core.routing.decide import NoLiveWorkersError, RouteOutcome
from eldr.core.routing.profile import as_routing_profile
from eldr.roles.router import RouterEvents, decision_of, expired, report_of, route_request
from eldr.roles.signature import Assembled
from eldr.runtime import ServiceContext, service_main
from eldr.wire import (
    Decision,
    DecisionAssignment,
    DecodeSummary,
    LoadReport,
    PartitionAnnouncement,
    PrefillDone,
    RequestFinished,
    RouterControl,
    RouterControlReply,
)
from eldr.wire.records import expired_outcome

from .metrics import RouterMetrics
from .partitions import PartitionLoader
from .rebuild import rebuild_at_start
from .replies import Replies
from .settings import RouterSettings
from .signatures import Signatures

log = logging.getLogger(__name__)

T = TypeVar("T")


class RouterService:
    def __init__(self, ctx: ServiceContext[RouterSettings]) -> None:
        self.ctx = ctx
        s = ctx.settings
        self.settings = s
        self.bus = ctx.bus
        self.subjects = ctx.bus.subjects
        self.topology = build_topology(s.namespace, s)
        self.decisions_stream = self.topology.stream_name(DECISIONS)
        self.metrics = RouterMetrics(ctx.registry, s.routing_profile.name)
        self.core = s.router_core()
        self.table = self.core.table
        self.events = RouterEvents(self.core)
        self.signatures = Signatures(ctx.bus, s, self.core, self.metrics)
        self.replies = Replies(ctx.bus, self.metrics)
        self.partitions = PartitionLoader(
            ctx.bus,
            self.topology.partitions_bucket,
            self.core,
            self.metrics,
            index_method=s.index_method,
            instance_id=s.instance_id,
        )
        self.metrics.watch(self.core)
        self._fleet_full_logged_s = -1e9
        self._report_arrived = asyncio.Event()

    # --- inputs besides PrefillDone ------------------------------------------------------

    async def on_load_report(self, msg: LoadReport, _: Delivery) -> None:
        taken, evicted = self.events.on_report(report_of(msg), time.monotonic())
        self.metrics.load_reports.labels(taken).inc()
        if taken == "fleet_full":
            now = time.monotonic()
            if now - self._fleet_full_logged_s >= 10.0:
                self._fleet_full_logged_s = now
                log.warning(
                    "load report of %s refused: the load table holds max_workers=%d workers "
                    "(%d reports of new workers refused so far)",
                    msg.worker_id,
                    self.table.max_workers,
                    self.table.refused_workers,
                )
            return
        if evicted:
            self.metrics.activity_evictions.labels("over_in_flight").inc(evicted)
        self._report_arrived.set()

    async def on_decision(self, msg: DecisionAssignment, _: Delivery) -> None:
        # Every replica's decisions (ours included: setdefault makes that a no-op), read
        # through the view that decodes only what the tables need.
        self._count_record(msg)

    def _count_record(self, msg: DecisionAssignment | Decision) -> None:
        if self.events.on_record(msg, time.monotonic()) == "decision_geometry":
            self.metrics.rejected_inputs.labels("decision_geometry").inc()

    async def on_summary(self, msg: DecodeSummary, _: Delivery) -> None:
        # A finished request: its experts no longer weigh on its worker's steps.
        tracked = self.events.on_finished(msg.request_id, time.monotonic())
        self.metrics.finished.labels("profile", "tracked" if tracked else "untracked").inc()

    async def on_finished(self, msg: RequestFinished, _: Delivery) -> None:
        """A gateway saw the request leave its decode worker (any reason), or move to
        another worker before it started there. (Its gateway id is the subject's token:
        the bus refuses any other, `IDENTITY`.)"""
        moved_to = msg.moved_to if msg.reason == "moved" else None
        tracked = self.events.on_finished(msg.request_id, time.monotonic(), moved_to)
        self.metrics.finished.labels(msg.reason, "tracked" if tracked else "untracked").inc()

    async def on_announcement(self, msg: PartitionAnnouncement, delivery: Delivery) -> None:
        await self.partitions.on_announcement(msg, delivery)

    @property
    def expire_period_s(self) -> float:
        return min(0.25, self.settings.stale_after_s / 4)

    async def expire(self) -> None:
        """Drop stale workers and expired activity, count what was evicted (every
        `expire_period_s`)."""
        gone = self.events.expire(time.monotonic())
        for wid in gone.stale_workers:
            log.warning("decode worker %s went stale and left the load table", wid)
        for reason, n in gone.evictions().items():
            self.metrics.activity_evictions.labels(reason).inc(n)
        if gone.refused_shape:
            self.metrics.rejected_inputs.labels("activity_shape").inc(gone.refused_shape)
        self.metrics.live_workers.set(len(self.table))

    async def on_control(self, msg: RouterControl) -> RouterControlReply:
        """Switch the routing profile (`RouterEvents.on_control`; a ValueError becomes an
        error reply), or answer a query (all fields None)."""
        new = self.events.on_control(msg)
        if new is not None:
            log.info("router %s switched to %s", self.settings.instance_id, new.describe())
        return self._control_reply()

    def _control_reply(self) -> RouterControlReply:
        partition = self.core.partition
        latest = self.partitions.latest
        return RouterControlReply(
            router_id=self.settings.instance_id,
            policy=self.core.profile.name,
            params=self.core.profile.params(),
            profile=as_routing_profile(self.core.profile),
            partition_version=None if partition is None else partition.version,
            live_workers=len(self.table.live_workers(time.monotonic())),
            announced_version=None if latest is None else latest[1].version,
            partition_error=self.partitions.error if self.partitions.behind else None,
        )

    # --- the request path ------------------------------------------------------------------

    async def on_prefill_done(self, msg: PrefillDone, delivery: Delivery) -> None:
        taken = time.perf_counter()
        subject = self.subjects.decision(msg.request_id)
        if delivery.num_delivered > 1:
            existing = await self._patiently(
                "read",
                lambda: self.bus.get_last(self.decisions_stream, subject, Decision),
                delivery,
            )
            if existing is not None:
                # Committed before (an ack that never came back, another replica): count
                # it, as any committed decision, and answer with it.
                self._count_record(existing)
                await self.replies.answer(msg, existing, already=True)
                return
        signature: Assembled | None = None
        outcome: RouteOutcome | None = None
        if not expired(msg, time.time()):
            signature = await self.signatures.of(msg)
            outcome = await self._decide(msg, signature, delivery)
        if outcome is None or expired(msg, time.time()):
            # The requester stopped waiting: the request's one record says so (exactly
            # once, as any decision); no worker gets it, no load is counted.
            outcome, signature = expired_outcome(self.core.profile), None
        record = decision_of(
            msg,
            outcome,
            signature,
            router_id=self.settings.instance_id,
            ts_s=time.time(),
            decide_s=time.perf_counter() - taken,
        )
        counts = None if signature is None else signature.counts
        if await self._commit(msg, subject, record, counts, delivery):
            self._done(msg, record, outcome, taken)
            await self.replies.answer(msg, record, already=False)

    async def _decide(
        self, msg: PrefillDone, signature: Assembled, delivery: Delivery
    ) -> RouteOutcome | None:
        """The routing core's decision; None if the requester stopped waiting while no
        worker was live. Holds the request while no worker is live (every load report wakes
        it, its delivery is kept: `hold_while`), then hands it back to JetStream for a
        later redelivery."""
        request = route_request(msg, signature)
        try:
            return await hold_while(
                lambda: self.core.decide(request, time.monotonic()),
                NoLiveWorkersError,
                delivery=delivery,
                wake=self._report_arrived,
                hold_s=self.settings.no_worker_wait_s,
                progress_every_s=self.settings.router_ack_wait_s / 3,
                stopping=self.ctx.stopping,
                deadline_s=msg.deadline_s,
            )
        except NoLiveWorkersError as exc:
            self.metrics.no_live_workers.inc()
            raise Retry(str(exc), delay_s=self.settings.no_worker_retry_s) from exc

    async def _commit(
        self,
        msg: PrefillDone,
        subject: str,
        record: Decision,
        counts: np.ndarray | None,
        delivery: Delivery,
    ) -> bool:
        """Commit `record` as the request's one record (the first write wins); False if
        another was there first (it stands: it is counted and answered instead). An
        assignment is counted in the tables before the commit's ack, so decisions
        overlapping the commit see it, and taken back if the commit does not stand."""
        if record.assigned:
            self.core.reserve(
                record.worker_id, msg.request_id, counts, msg.n_prompt_tokens, time.monotonic()
            )
        try:
            committed: Committed[Decision] = await self._patiently(
                "commit",
                lambda: self.bus.commit_once(
                    self.decisions_stream,
                    subject,
                    record,
                    timeout_s=self.settings.commit_timeout_s,
                ),
                delivery,
            )
        except BaseException:
            if record.assigned:
                self.core.release(record.worker_id, msg.request_id)
            raise
        if committed.first:
            return True
        if record.assigned:
            self.core.release(record.worker_id, msg.request_id)
        self._count_record(committed.record)
        await self.replies.answer(msg, committed.record, already=True)
        return False

    def _done(
        self, msg: PrefillDone, record: Decision, outcome: RouteOutcome, taken: float
    ) -> None:
        """Count (and for an expired one, log) a record this replica committed."""
        if record.assigned:
            self.metrics.decisions.labels(outcome.policy, outcome.fallback or "none").inc()
            self.metrics.decision_seconds.observe(time.perf_counter() - taken)
            return
        self.metrics.expired.inc()
        log.info(
            "request %s from %s expired %.3f s before the router could assign it: recorded "
            "as expired",
            msg.request_id,
            msg.prefill_worker,
            record.ts_s - (msg.deadline_s or record.ts_s),
        )

    async def _patiently(self, op: str, call: Callable[[], Awaitable[T]], delivery: Delivery) -> T:
        """`call()`, retried through a NATS cluster's expected faults (an election, a node
        restart) for up to `commit_retry_s` while the event is held (in progress), so they
        spend none of its deliveries (`Bus.retrying`)."""
        return await self.bus.retrying(
            op,
            call,
            give_up_s=self.settings.commit_retry_s,
            keepalive=delivery.in_progress,
            keepalive_every_s=self.settings.router_ack_wait_s / 3,
            stopping=self.ctx.stopping,
        )


async def setup(ctx: ServiceContext[RouterSettings]) -> None:
    svc = RouterService(ctx)
    bus, subjects, topo = ctx.bus, ctx.bus.subjects, svc.topology
    await bus.subscribe(
        subjects.load_all, LoadReport, svc.on_load_report, identity=IDENTITY[LoadReport]
    )
    await bus.subscribe(subjects.decisions_all, DecisionAssignment, svc.on_decision)
    await bus.subscribe(
        subjects.profiles_all, DecodeSummary, svc.on_summary, identity=IDENTITY[DecodeSummary]
    )
    await bus.subscribe(
        subjects.finished_all,
        RequestFinished,
        svc.on_finished,
        identity=IDENTITY[RequestFinished],
    )
    ctx.spawn("partition-loader", lambda: svc.partitions.run(ctx.stopping))
    ctx.every("expire", svc.expire_period_s, svc.expire, until="stop")
    reader = await bus.read_back(
        topo.stream_name(PARTITIONS),
        subjects.partition_active,
        PartitionAnnouncement,
        svc.on_announcement,
    )
    await reader.wait_caught_up(timeout_s=30)
    # What is in flight, before the first event: a restarted replica decides like the
    # others (issue 23).
    await rebuild_at_start(ctx, svc.core, topo)
    await bus.serve(subjects.control_router, None, RouterControl, svc.on_control)
    await bus.consume(
        topo.stream_name(PREFILL),
        ROUTER_CONSUMER,
        PrefillDone,
        svc.on_prefill_done,
        batch=ctx.settings.consumer_batch,
        max_concurrency=ctx.settings.max_concurrency,
        identity=IDENTITY[PrefillDone],
    )
    ctx.set_ready()
    log.info(
        "router %s ready: %s",
        ctx.settings.instance_id,
        ctx.settings.routing_profile.describe(),
    )


NO_ECHO = True
"""The router's own decisions come back on `decisions.*` only through other replicas: it
counts them against their workers when it makes them, so skipping the echo saves a
decode per request without losing anything."""


def main() -> int:
    return service_main("router", RouterSettings, setup, no_echo=NO_ECHO)
