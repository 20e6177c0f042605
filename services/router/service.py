"""Routing service: assigns each prefilled request a decode worker, exactly once.

Inputs: PrefillDone events (JetStream, durable consumer shared by all replicas, at least
once), load reports (core), every replica's decisions (to keep the fleet-wide load table),
the gateways' finish events and decode profiles (a request leaves the load and activity
tables), partition announcements. For each PrefillDone: take its signature (carried in the
event when the prefill worker held every cached block, else request/reply to the signature
service for the cached blocks, bounded wait), decide (`eldr.core.routing.decide`), count the
decision in the load and activity tables at once, commit it with "expected last subject
sequence 0" on the request's decision subject (the first decision for a request id wins; a
redelivery reads the committed one instead of deciding again; a decision that does not
stand is taken back out of the tables), answer the requester, ack.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import zlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

import numpy as np

from eldr.bus import (
    ROUTER_CONSUMER,
    BusError,
    BusTimeoutError,
    Committed,
    Delivery,
    NoRespondersError,
    Retry,
    build_topology,
    hold_while,
    is_reply_inbox,
)
from eldr.bus.topology import DECISIONS, IDENTITY, PARTITIONS, PREFILL
from eldr.core.routing.decide import NoLiveWorkersError, RouterCore, RouteRequest
from eldr.core.routing.loadtable import LoadTable, Report
from eldr.core.routing.profile import as_routing_profile, profile_from_params
from eldr.partitions.codec import partition_from_blob
from eldr.runtime import ServiceContext, service_main
from eldr.wire import (
    AssembleReply,
    AssembleRequest,
    Decision,
    DecisionAssignment,
    DecodeProfile,
    LoadReport,
    PartitionAnnouncement,
    PartitionBlob,
    PrefillDone,
    RequestFinished,
    RouterControl,
    RouterControlReply,
    SparseCounts,
    WireError,
)
from eldr.wire.messages import NO_WORKER
from eldr.wire.records import decision_record

from .load_metrics import LoadTableCollector
from .metrics import RouterMetrics
from .rebuild import rebuild_at_start
from .settings import RouterSettings

log = logging.getLogger(__name__)

T = TypeVar("T")

REPLY_PREFIXES = ("_INBOX",)
"""Requesters wait on inboxes: a PrefillDone.reply_to outside them is never answered (under
the generated permissions the server narrows it to the requester roles' own prefixes)."""
PARTITION_RETRY_MIN_S = 0.5
PARTITION_RETRY_MAX_S = 10.0
"""A failed partition load is retried after 0.5 s, doubling up to 10 s (a missing blob
costs one object-store lookup per 10 s)."""


def expired(msg: PrefillDone, now_s: float) -> bool:
    """Whether the event's requester has stopped waiting (its deadline is past)."""
    return msg.deadline_s is not None and now_s > msg.deadline_s


def recorded_signature(msg: PrefillDone, counts: np.ndarray | None) -> SparseCounts | None:
    """The decision's record of `counts`: the event's own sparse counts when they are the
    whole of it (the signature in the event, or what the prefill computed with no prefix
    hit: re-encoding them costs ~15 us a decision), else `counts` encoded."""
    if counts is None:
        return None
    if msg.signature is not None:
        return msg.signature
    if msg.computed is not None and msg.cached_prefix_blocks == 0:
        return msg.computed
    return SparseCounts.from_dense(counts)


class RouterService:
    def __init__(self, ctx: ServiceContext[RouterSettings]) -> None:
        self.ctx = ctx
        s = ctx.settings
        self.settings = s
        self.bus = ctx.bus
        self.subjects = ctx.bus.subjects
        self.topology = build_topology(s.namespace, s)
        self.metrics = RouterMetrics(ctx.registry, s.routing_profile.name)
        self.table = LoadTable(
            stale_after_s=s.stale_after_s, pending_ttl_s=s.pending_ttl_s, max_workers=s.max_workers
        )
        self.core = RouterCore(
            s.routing_profile,
            self.table,
            np.random.default_rng([s.router_seed, zlib.crc32(s.instance_id.encode())]),
            max_scores=s.max_scores,
            activity_ttl_s=s.activity_ttl_s,
            activity_slack=s.activity_slack,
            activity_max_entries=s.activity_max_entries,
            limits=s.geometry_limits(),
        )
        ctx.registry.register(LoadTableCollector(self.table, self.core.activity))
        activity = self.core.activity
        self.metrics.activity_requests.set_function(lambda: len(activity))
        self.metrics.activity_bytes.set_function(lambda: activity.nbytes)
        self._evicted_capacity = 0
        self._refused_shape = 0
        self._fleet_full_logged_s = -1e9
        self._geometry_logged_s = -1e9
        self._latest_announcement: tuple[int, PartitionAnnouncement] | None = None
        self._loaded_seq = 0
        self.partition_error: str | None = None
        """Why the newest announced version is not in use, while it is not."""
        self._partition_wakeup = asyncio.Event()
        self._report_arrived = asyncio.Event()

    # --- inputs besides PrefillDone ------------------------------------------------------

    async def on_load_report(self, msg: LoadReport, _: Delivery) -> None:
        if not self.table.admits(msg.worker_id):
            self.table.refused_workers += 1
            self.metrics.load_reports.labels("fleet_full").inc()
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
        applied = self.table.on_report(
            Report(
                worker_id=msg.worker_id,
                incarnation=msg.incarnation,
                seq=msg.seq,
                running=msg.running,
                waiting=msg.waiting,
                kv_tokens=msg.kv_tokens,
                kv_capacity_tokens=msg.kv_capacity_tokens,
                admitted=tuple(msg.admitted),
                draining=msg.draining,
            ),
            time.monotonic(),
        )
        self.metrics.load_reports.labels("ok" if applied else "stale").inc()
        if applied:
            self._bound_activity(msg.worker_id)
        self._report_arrived.set()

    async def on_decision(self, msg: DecisionAssignment, _: Delivery) -> None:
        # Every replica's decisions (ours included: setdefault makes that a no-op), read
        # through the view that decodes only what the tables need.
        self._count_record(msg)

    def _count_record(self, msg: DecisionAssignment | Decision) -> None:
        """Count another replica's committed decision against its worker (an expired
        record counts nowhere)."""
        if not msg.assigned:
            return  # an expired record: nobody got the request, nothing to count
        now = time.monotonic()
        self.table.on_assignment(msg.worker_id, msg.request_id, msg.prompt_tokens or 0, now)
        if (
            msg.signature is not None
            and self.core.policy.uses_activity
            and msg.request_id not in self.core.activity  # ours, counted when decided
        ):
            layers, experts = msg.signature.shape
            if self.core.geometry_problem(msg.model, layers, experts) is not None:
                self.metrics.rejected_inputs.labels("decision_geometry").inc()
                return
            self.core.note_assignment(
                msg.worker_id,
                msg.request_id,
                msg.signature.to_dense(np.uint32),
                msg.prompt_tokens or 0,
                now,
            )

    async def on_profile(self, msg: DecodeProfile, _: Delivery) -> None:
        # A finished request: its experts no longer weigh on its worker's steps.
        tracked = self.core.note_finished(msg.request_id, time.monotonic())
        self.metrics.finished.labels("profile", "tracked" if tracked else "untracked").inc()

    async def on_finished(self, msg: RequestFinished, _: Delivery) -> None:
        """A gateway saw the request leave its decode worker (any reason), or move to
        another worker before it started there. (Its gateway id is the subject's token:
        the bus refuses any other, `IDENTITY`.)"""
        if msg.reason == "moved":
            assert msg.moved_to is not None  # the schema requires it
            tracked = self.core.note_moved(msg.request_id, msg.moved_to, time.monotonic())
        else:
            tracked = self.core.note_finished(msg.request_id, time.monotonic())
        self.metrics.finished.labels(msg.reason, "tracked" if tracked else "untracked").inc()

    def _log_geometry(self, msg: PrefillDone, problem: str) -> None:
        now = time.monotonic()
        if now - self._geometry_logged_s >= 10.0:
            self._geometry_logged_s = now
            log.warning(
                "request %s from %s: counts refused (%s); routed load-only",
                msg.request_id,
                msg.prefill_worker,
                problem,
            )

    def _bound_activity(self, worker_id: str) -> None:
        evicted = self.core.bound_activity(worker_id)
        if evicted:
            self.metrics.activity_evictions.labels("over_in_flight").inc(evicted)

    async def on_announcement(self, msg: PartitionAnnouncement, delivery: Delivery) -> None:
        seq = delivery.stream_seq or 0
        if self._latest_announcement is None or seq > self._latest_announcement[0]:
            self._latest_announcement = (seq, msg)
            self.metrics.partition_announced.set(msg.version)
            self.metrics.partition_behind.set(1)
            self._partition_wakeup.set()

    @property
    def partition_behind(self) -> bool:
        """Whether a newer announcement than the version in use is not loaded (yet)."""
        latest = self._latest_announcement
        return latest is not None and latest[0] > self._loaded_seq

    async def partition_loader(self) -> None:
        """Load the newest announced partition off the request path, then swap it in; a
        failed load (the blob not there yet, a transient error, a corrupt blob) is retried
        with backoff until it succeeds or a newer announcement replaces it. Meanwhile the
        replica routes with the version it has and says so (`eldr_router_partition_behind`,
        `RouterControlReply.announced_version` / `partition_error`)."""
        backoff_s = PARTITION_RETRY_MIN_S
        while not self.ctx.stopping.is_set():
            latest = self._latest_announcement
            if latest is None or latest[0] <= self._loaded_seq:
                await self._partition_wakeup.wait()
                self._partition_wakeup.clear()
                continue
            seq, ann = latest
            try:
                blob = await self.bus.object_get(
                    self.topology.partitions_bucket,
                    ann.object_name,
                    PartitionBlob,
                    expected_sha256=ann.sha256,
                )
                partition = await asyncio.to_thread(
                    partition_from_blob, blob, self.settings.index_method
                )
            except (BusError, ValueError) as exc:
                self.metrics.partition_loads.labels("error").inc()
                self.partition_error = f"version {ann.version}: {exc}"[:1000]
                in_use = self.core.partition
                log.error(
                    "could not load partition version %d (routing with %s; retrying in %.1f s): %s",
                    ann.version,
                    "none" if in_use is None else f"version {in_use.version}",
                    backoff_s,
                    exc,
                )
                self._partition_wakeup.clear()
                with contextlib.suppress(TimeoutError):
                    # A newer announcement tries at once; else the same one after the wait.
                    await asyncio.wait_for(self._partition_wakeup.wait(), timeout=backoff_s)
                backoff_s = min(backoff_s * 2, PARTITION_RETRY_MAX_S)
                continue
            backoff_s = PARTITION_RETRY_MIN_S
            self.core.set_partition(partition)
            self._loaded_seq = seq
            self.partition_error = None
            self.metrics.partition_loads.labels("ok").inc()
            self.metrics.partition_version.set(partition.version)
            self.metrics.partition_behind.set(1 if self.partition_behind else 0)
            log.info(
                "router %s now routes with partition version %d (%d workers)",
                self.settings.instance_id,
                partition.version,
                partition.k,
            )

    @property
    def expire_period_s(self) -> float:
        return min(0.25, self.settings.stale_after_s / 4)

    async def expire(self) -> None:
        """Drop stale workers and expired activity, count what was evicted (every
        `expire_period_s`)."""
        now = time.monotonic()
        removed = self.table.expire(now)
        activity = self.core.activity
        for wid in removed:
            log.warning("decode worker %s went stale and left the load table", wid)
            gone = activity.remove_worker(wid)
            self.metrics.activity_evictions.labels("worker_gone").inc(gone)
        expired = activity.expire(now)
        if expired:
            self.metrics.activity_evictions.labels("ttl").inc(expired)
        for wid in activity.per_worker():
            self._bound_activity(wid)
        if activity.refused_shape > self._refused_shape:
            self.metrics.rejected_inputs.labels("activity_shape").inc(
                activity.refused_shape - self._refused_shape
            )
            self._refused_shape = activity.refused_shape
        if activity.evicted_capacity > self._evicted_capacity:
            self.metrics.activity_evictions.labels("capacity").inc(
                activity.evicted_capacity - self._evicted_capacity
            )
            self._evicted_capacity = activity.evicted_capacity
        self.metrics.live_workers.set(len(self.table))

    async def on_control(self, msg: RouterControl) -> RouterControlReply:
        """Switch the routing profile: `profile` replaces it; the older fields switch policy
        and set parameters on it (what is left None keeps its value, parameters the new
        policy takes carry over); all None = query."""
        current = self.core.profile
        new = msg.profile
        if new is None:
            params = {"tau": msg.tau, "load_measure": msg.load_measure}
            given = {k: v for k, v in params.items() if v is not None}
            if msg.policy is None and not given:
                return self._control_reply()
            # ValueError (an unknown policy or parameter, a bad value) -> error reply
            new = profile_from_params(msg.policy or current.name, given, keep=current)
        self.core.set_profile(new)  # validated first: a bad profile keeps the old one
        log.info("router %s switched to %s", self.settings.instance_id, new.describe())
        return self._control_reply()

    def _control_reply(self) -> RouterControlReply:
        partition = self.core.partition
        latest = self._latest_announcement
        return RouterControlReply(
            router_id=self.settings.instance_id,
            policy=self.core.profile.name,
            params=self.core.profile.params(),
            profile=as_routing_profile(self.core.profile),
            partition_version=None if partition is None else partition.version,
            live_workers=len(self.table.live_workers(time.monotonic())),
            announced_version=None if latest is None else latest[1].version,
            partition_error=self.partition_error if self.partition_behind else None,
        )

    # --- the request path ------------------------------------------------------------------

    async def signature_of(self, msg: PrefillDone) -> tuple[np.ndarray | None, int, str | None]:
        """The request's prefill counts: the whole signature the event carries (its prefill
        worker held a summary of every cached block), or what the prefill computed plus,
        from the signature service, its prefix-cache hits. Returns (counts [L, E] or None,
        blocks missing, the reason when None); counts where they came from
        (`eldr_router_signature_source_total`)."""
        source = self.metrics.signature_source
        if msg.capture == "unavailable":
            # The prefill could not capture (the gateway said so): route load-only now.
            source["none"].inc()
            return None, 0, "no_capture"
        problem = self.core.geometry_problem(msg.model, msg.num_moe_layers, msg.num_experts)
        if problem is not None:
            # Geometry from the configuration, not from the message: nothing of this shape
            # is allocated (a 329-byte event declaring 256 x 65,536 took every router to
            # over 1 GiB); the request is decided load-only.
            self.metrics.rejected_inputs.labels("prefill_geometry").inc()
            self._log_geometry(msg, problem)
            source["none"].inc()
            return None, 0, "geometry_mismatch"
        if msg.signature is not None:
            # Local first: the prefill worker summed its own summaries of the cached
            # blocks (the wire checked the shape against the geometry checked above).
            source["event"].inc()
            return msg.signature.to_dense(np.uint32), 0, None
        if msg.computed is not None:
            computed = msg.computed.to_dense(np.uint32)
            cached = msg.block_hashes[: msg.cached_prefix_blocks]
            if not cached:
                source["computed"].inc()
                return computed, 0, None  # nothing came from a prefix cache
            if not (self.settings.fetch_signature or self.core.policy.needs_signature):
                source["none"].inc()
                return None, len(cached), "no_signature"
            source["service"].inc()
            counts, missing, reason = await self.fetch_signature(msg, cached, None)
            if counts is None:
                return None, missing, reason
            return counts + computed, missing, None
        if not msg.block_hashes:
            # A prompt shorter than one block: its partial block is the whole signature.
            if msg.partial is None:
                source["none"].inc()
                return None, 0, "empty_signature"
            source["partial_only"].inc()
            return msg.partial.to_dense(np.uint32), 0, None
        if not (self.settings.fetch_signature or self.core.policy.needs_signature):
            source["none"].inc()
            return None, len(msg.block_hashes), "no_signature"
        source["service"].inc()
        return await self.fetch_signature(msg, msg.block_hashes, msg.partial)

    async def fetch_signature(
        self, msg: PrefillDone, block_hashes: list[int], partial: SparseCounts | None
    ) -> tuple[np.ndarray | None, int, str | None]:
        """Sum of `block_hashes` (+ `partial`) from the signature service: (counts [L, E]
        or None, missing blocks, reason when None)."""
        started = time.perf_counter()
        counts: np.ndarray | None = None
        missing = len(block_hashes)
        reason: str | None = None
        try:
            reply = await self.bus.request(
                self.subjects.sig_assemble,
                AssembleRequest(
                    request_id=msg.request_id,
                    model=msg.model,
                    block_hashes=block_hashes,
                    partial=partial,
                    wait_ms=self.settings.assemble_wait_ms,
                    prefill_worker=msg.prefill_worker,
                ),
                AssembleReply,
                timeout_s=self.settings.signature_timeout_s,
                hedge_after_s=self.settings.signature_hedge_s,
            )
        except BusTimeoutError:
            reason = "signature_timeout"
        except NoRespondersError:
            reason = "signature_unavailable"
        except (BusError, WireError) as exc:  # RemoteError included; WireError: a reply
            # this router cannot read (a newer schema mid-upgrade, a broken replica) must
            # cost the request its signature, not its decision.
            log.warning("signature for %s failed: %s", msg.request_id, exc)
            reason = "signature_error"
        else:
            missing = reply.blocks_total - reply.blocks_found
            expected = [msg.num_moe_layers, msg.num_experts]
            if reply.counts is None:
                reason = "no_signature"
            elif reply.counts.shape != expected:
                log.warning(
                    "signature for %s has shape %s, the request %s",
                    msg.request_id,
                    reply.counts.shape,
                    expected,
                )
                reason = "signature_error"
            else:
                counts = reply.counts.to_numpy()
        self.metrics.signature_seconds.observe(time.perf_counter() - started)
        if reason is None:
            outcome = "complete" if missing == 0 else "partial"
        else:
            outcome = reason.removeprefix("signature_")
        self.metrics.signature_outcomes.labels(outcome).inc()
        return counts, missing, reason

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
                await self._answer(msg, existing, already=True)
                return
        if expired(msg, time.time()):
            await self._expire(msg, subject, taken, delivery)
            return
        counts, missing, sig_error = await self.signature_of(msg)
        request = RouteRequest(
            request_id=msg.request_id,
            model=msg.model,
            prompt_tokens=msg.n_prompt_tokens,
            counts=counts,
            missing_blocks=missing,
            signature_error=sig_error,
        )
        # Hold the request while no worker is live (every load report wakes us, its
        # delivery is kept: `hold_while`), then hand it back to JetStream for a later
        # redelivery; one whose requester stops waiting meanwhile is recorded as expired.
        try:
            outcome = await hold_while(
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
        if outcome is None or expired(msg, time.time()):
            await self._expire(msg, subject, taken, delivery)
            return
        decision = decision_record(
            outcome,
            request_id=msg.request_id,
            ts_s=time.time(),
            router_id=self.settings.instance_id,
            model=msg.model,
            signature=recorded_signature(msg, counts),
            missing_blocks=missing,
            decide_s=time.perf_counter() - taken,
            prompt_tokens=msg.n_prompt_tokens,
            client_request_id=msg.client_request_id,
        )
        # Counted now, before the commit's ack: decisions overlapping this one's commit see
        # it. Taken back if the commit does not stand.
        self.core.reserve(
            outcome.worker_id, msg.request_id, counts, msg.n_prompt_tokens, time.monotonic()
        )
        try:
            committed = await self._commit_patiently(subject, decision, delivery)
        except BaseException:
            self.core.release(outcome.worker_id, msg.request_id)
            raise
        if not committed.first:
            # Another replica (or an earlier delivery) committed first: its record stands.
            self.core.release(outcome.worker_id, msg.request_id)
            self._count_record(committed.record)
            await self._answer(msg, committed.record, already=True)
            return
        self.metrics.decisions.labels(outcome.policy, outcome.fallback or "none").inc()
        self.metrics.decision_seconds.observe(time.perf_counter() - taken)
        await self._answer(msg, decision, already=False)

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

    async def _commit_patiently(
        self, subject: str, record: Decision, delivery: Delivery
    ) -> Committed[Decision]:
        return await self._patiently(
            "commit",
            lambda: self.bus.commit_once(
                self.decisions_stream, subject, record, timeout_s=self.settings.commit_timeout_s
            ),
            delivery,
        )

    async def _commit(
        self, msg: PrefillDone, subject: str, decision: Decision, delivery: Delivery
    ) -> bool:
        """Commit `decision` as the request's record (first write wins); False if another
        was there first (it is answered instead)."""
        committed = await self._commit_patiently(subject, decision, delivery)
        if not committed.first:
            await self._answer(msg, committed.record, already=True)
        return committed.first

    async def _expire(
        self, msg: PrefillDone, subject: str, taken: float, delivery: Delivery
    ) -> None:
        """The requester stopped waiting (the event's deadline passed): commit an expired
        record instead of an assignment. It is the request's one record (exactly once, as
        any decision); no worker gets the request, no load is counted."""
        profile = self.core.profile
        record = Decision(
            request_id=msg.request_id,
            ts_s=time.time(),
            router_id=self.settings.instance_id,
            model=msg.model,
            worker_id=NO_WORKER,
            policy=profile.name,
            profile=as_routing_profile(profile),
            partition_version=None,
            fallback=None,
            scores=[],
            band=[],
            loads=[],
            signature=None,
            missing_blocks=0,
            decide_s=time.perf_counter() - taken,
            prompt_tokens=msg.n_prompt_tokens,
            outcome="expired",
            client_request_id=msg.client_request_id,
        )
        if not await self._commit(msg, subject, record, delivery):
            return
        self.metrics.expired.inc()
        late_s = record.ts_s - (msg.deadline_s or record.ts_s)
        log.info(
            "request %s from %s expired %.3f s before the router could assign it: recorded "
            "as expired",
            msg.request_id,
            msg.prefill_worker,
            late_s,
        )
        await self._answer(msg, record, already=False)

    async def _answer(self, msg: PrefillDone, decision: Decision, *, already: bool) -> None:
        if already:
            self.metrics.already_decided.inc()
            log.info(
                "request %s was already decided (worker %s); answering with that",
                msg.request_id,
                decision.worker_id,
            )
        if msg.reply_to and not is_reply_inbox(msg.reply_to, REPLY_PREFIXES):
            # The router publishes with its own rights, which include `decisions.*`: an
            # event naming another request's decision subject as its reply_to would have it
            # write a second, unchecked decision there (the stream records core publishes).
            log.warning(
                "request %s: reply_to %r is not an inbox (%s...): not answered",
                msg.request_id,
                msg.reply_to[:80],
                REPLY_PREFIXES[0],
            )
        elif msg.reply_to:
            try:
                await self.bus.publish(msg.reply_to, decision)
            except BusError as exc:  # the decision is committed; the requester can read it
                log.warning("could not answer %s for %s: %s", msg.reply_to, msg.request_id, exc)

    @property
    def decisions_stream(self) -> str:
        return self.topology.stream_name(DECISIONS)


async def setup(ctx: ServiceContext[RouterSettings]) -> None:
    svc = RouterService(ctx)
    bus, subjects, topo = ctx.bus, ctx.bus.subjects, svc.topology
    await bus.subscribe(
        subjects.load_all, LoadReport, svc.on_load_report, identity=IDENTITY[LoadReport]
    )
    await bus.subscribe(subjects.decisions_all, DecisionAssignment, svc.on_decision)
    await bus.subscribe(
        subjects.profiles_all, DecodeProfile, svc.on_profile, identity=IDENTITY[DecodeProfile]
    )
    await bus.subscribe(
        subjects.finished_all,
        RequestFinished,
        svc.on_finished,
        identity=IDENTITY[RequestFinished],
    )
    ctx.spawn("partition-loader", svc.partition_loader)
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
