"""A router replica's event handling: what each input does to its tables, and its record.

A replica keeps a load table and an activity table (`RouterCore`) fed by load reports, every
replica's decisions, the gateways' finish events and a periodic expiry, and routes with the
profile an operator switches it to; each PrefillDone ends in one `Decision` record, an
assignment or an expired one. `RouterEvents` applies each input to a `RouterCore` and says
what happened (for the caller's metrics and logs); `decision_of` builds the record. The
router service (services/router: live and at its start-up rebuild) and the simulator's
replicas (`eldr.sim.information.RouterReplica`) call these at the times the events reach
them (monotonic seconds, passed in).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from eldr.core.routing.activity import ExpertDemand
from eldr.core.routing.decide import RouteOutcome, RouterCore, RouteRequest
from eldr.core.routing.loadtable import Report
from eldr.core.routing.profile import ProfileBase, profile_from_params
from eldr.roles.signature import Assembled, recorded_signature
from eldr.wire import Decision, DecisionAssignment, LoadReport, PrefillDone, RouterControl
from eldr.wire.messages import NO_WORKER
from eldr.wire.records import decision_record

ReportTaken = Literal["ok", "stale", "fleet_full"]
"""What became of a load report: applied, older than the one held, or refused (a new
worker while the table holds `max_workers`)."""
RecordTaken = Literal["none", "counted", "decision_geometry"]
"""What became of another replica's decision record: nothing to count (expired), counted,
or counted as load only (its counts' geometry is not this replica's)."""


def report_of(msg: LoadReport) -> Report:
    """The load table's report of a `LoadReport`."""
    return Report(
        worker_id=msg.worker_id,
        incarnation=msg.incarnation,
        seq=msg.seq,
        running=msg.running,
        waiting=msg.waiting,
        kv_tokens=msg.kv_tokens,
        kv_capacity_tokens=msg.kv_capacity_tokens,
        admitted=tuple(msg.admitted),
        draining=msg.draining,
    )


def expired(msg: PrefillDone, now_s: float) -> bool:
    """Whether the event's requester has stopped waiting (its deadline, Unix s, is past)."""
    return msg.deadline_s is not None and now_s > msg.deadline_s


def route_request(msg: PrefillDone, signature: Assembled) -> RouteRequest:
    """What the routing core decides on for the event, with its assembled counts."""
    return RouteRequest(
        request_id=msg.request_id,
        model=msg.model,
        prompt_tokens=msg.n_prompt_tokens,
        counts=signature.counts,
        missing_blocks=signature.missing_blocks,
        signature_error=signature.error,
    )


def decision_of(
    msg: PrefillDone,
    outcome: RouteOutcome,
    signature: Assembled | None,
    *,
    router_id: str,
    ts_s: float,
    decide_s: float,
) -> Decision:
    """The request's record: `outcome` with the counts it was decided on; an expired one
    (`eldr.wire.records.expired_outcome`) records none."""
    recorded, missing = None, 0
    if outcome.worker_id != NO_WORKER and signature is not None:
        recorded = recorded_signature(msg, signature.counts)
        missing = signature.missing_blocks
    return decision_record(
        outcome,
        request_id=msg.request_id,
        ts_s=ts_s,
        router_id=router_id,
        model=msg.model,
        signature=recorded,
        missing_blocks=missing,
        decide_s=decide_s,
        prompt_tokens=msg.n_prompt_tokens,
        client_request_id=msg.client_request_id,
    )


@dataclass(frozen=True)
class Expiry:
    """What one expiry pass removed."""

    stale_workers: list[str]
    """Workers that went stale and left the load table."""
    worker_gone: int
    """Their activity entries."""
    ttl: int
    """Activity entries past their lifetime."""
    over_in_flight: int
    """Entries beyond a worker's in-flight count plus slack (finishes never seen)."""
    capacity: int
    """Entries evicted for the table's size since the last pass."""
    refused_shape: int
    """Entries refused for their shape since the last pass."""

    def evictions(self) -> dict[str, int]:
        """Activity entries dropped without a finish, by why (those > 0)."""
        by_reason = {
            "worker_gone": self.worker_gone,
            "ttl": self.ttl,
            "over_in_flight": self.over_in_flight,
            "capacity": self.capacity,
        }
        return {reason: n for reason, n in by_reason.items() if n}


class RouterEvents:
    """One replica's inputs applied to its `RouterCore` (module docstring)."""

    def __init__(self, core: RouterCore) -> None:
        self.core = core
        self._evicted_capacity = 0
        self._refused_shape = 0
        """The activity table's cumulative counts as of the last expiry pass."""

    def on_control(self, msg: RouterControl) -> ProfileBase | None:
        """Switch the routing profile: `profile` replaces it; the older fields switch policy
        and set parameters on it (what is left None keeps its value, parameters the new
        policy takes carry over). Returns the new profile; None (all fields None) is a
        query. A bad profile or parameter raises ValueError and keeps the old one."""
        current = self.core.profile
        new = msg.profile
        if new is None:
            params = {"tau": msg.tau, "load_measure": msg.load_measure}
            given = {k: v for k, v in params.items() if v is not None}
            if msg.policy is None and not given:
                return None
            new = profile_from_params(msg.policy or current.name, given, keep=current)
        self.core.set_profile(new)
        return new

    def on_report(self, report: Report, now_s: float) -> tuple[ReportTaken, int]:
        """Apply a load report: what became of it, and the worker's activity entries
        evicted beyond its new in-flight bound."""
        table = self.core.table
        if not table.admits(report.worker_id):
            table.refused_workers += 1
            return "fleet_full", 0
        if not table.on_report(report, now_s):
            return "stale", 0
        return "ok", self.core.bound_activity(report.worker_id)

    def on_assignment(
        self,
        worker_id: str,
        request_id: str,
        kv_tokens: int,
        demand: ExpertDemand | None,
        now_s: float,
    ) -> None:
        """A decision whose demand the caller has (the simulator precomputes them): pending
        on its worker, and its experts counted there."""
        core = self.core
        core.table.on_assignment(worker_id, request_id, kv_tokens, now_s)
        if (
            demand is not None
            and request_id not in core.activity
            and not core.table.was_finished(request_id)
        ):
            core.activity.add(worker_id, request_id, demand, now_s)
            core.bound_activity(worker_id)

    def on_record(self, record: DecisionAssignment | Decision, now_s: float) -> RecordTaken:
        """A committed decision (another replica's, or one found already committed):
        pending on its worker, and its experts counted there (one of this replica's own,
        counted when decided, is left as it is)."""
        if not record.assigned:
            return "none"  # an expired record: nobody got the request, nothing to count
        core = self.core
        core.table.on_assignment(
            record.worker_id, record.request_id, record.prompt_tokens or 0, now_s
        )
        if (
            record.signature is None
            or not core.policy.uses_activity
            or record.request_id in core.activity
        ):
            return "counted"
        return (
            "counted"
            if self.count_experts(record, record.worker_id, now_s)
            else "decision_geometry"
        )

    def count_experts(
        self, record: DecisionAssignment | Decision, worker_id: str, now_s: float
    ) -> bool:
        """Count the experts of `record` (which has counts) against `worker_id`; False
        where their geometry is not this replica's (not counted)."""
        assert record.signature is not None
        layers, experts = record.signature.shape
        if self.core.geometry_problem(record.model, layers, experts) is not None:
            return False
        self.core.note_assignment(
            worker_id,
            record.request_id,
            record.signature.to_dense(np.uint32),
            record.prompt_tokens or 0,
            now_s,
        )
        return True

    def on_finished(self, request_id: str, now_s: float, moved_to: str | None = None) -> bool:
        """The request left its worker (or went to `moved_to` instead before it started):
        True if this replica tracked it."""
        if moved_to is not None:
            return self.core.note_moved(request_id, moved_to, now_s)
        return self.core.note_finished(request_id, now_s)

    def expire(self, now_s: float) -> Expiry:
        """Drop stale workers and expired activity (a pass of the periodic expiry)."""
        core = self.core
        activity = core.activity
        removed = core.table.expire(now_s)
        gone = sum(activity.remove_worker(wid) for wid in removed)
        ttl = activity.expire(now_s)
        over = sum(core.bound_activity(wid) for wid in activity.per_worker())
        capacity = activity.evicted_capacity - self._evicted_capacity
        refused_shape = activity.refused_shape - self._refused_shape
        self._evicted_capacity = activity.evicted_capacity
        self._refused_shape = activity.refused_shape
        return Expiry(removed, gone, ttl, over, capacity, refused_shape)
