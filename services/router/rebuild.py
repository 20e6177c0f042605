"""A starting router replica rebuilds what is in flight before it takes events.

The activity table (which experts each worker's in-flight requests will activate: what the
default policy, `eldr_cost`, reads) and the load table's memory of finished requests are
otherwise filled only by decisions made after the start: a restarted replica saw 3
entries against 199 requests in flight, and decided as if every worker were idle for up to
one decode lifetime (issue 23). So before `setup` starts consuming, `rebuild` reads back:

1. FINISHED over the activity lifetime (`activity_ttl_s`): the requests that left their
   worker (and where "moved" ones went), kept as a set of ids, at most `max_requests`;
2. DECISIONS over the same lifetime (the `DecisionAssignment` view): every assignment not
   finished is counted against its worker as the live replica counts one
   (`eldr.roles.router.RouterEvents.count_experts`), dated by its commit (the stream's
   timestamp) so it expires when it would have;
3. the finishes of the last `pending_ttl_s` into the load table
   (`RouterCore.note_finished`), so a late echo of their decisions is not counted.

The live subscriptions (decisions, finishes, profiles, load reports) run meanwhile and
are idempotent with the read-back. It is bounded: in time by `timeout_s` (the replica then
starts with what it read and says so), in memory by `max_requests` finished ids plus the
activity table's own bounds (`activity_max_entries`, per worker its in-flight count +
`activity_slack` once it reports). Pending assignments are not read back: a worker's next
reports count what it admitted, and one read back could not be told admitted from not.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Gauge

from eldr.bus import Bus, BusError, Delivery, ReadBack, Topology
from eldr.bus.topology import DECISIONS, FINISHED, IDENTITY
from eldr.core.routing.decide import RouterCore
from eldr.roles.router import RouterEvents
from eldr.runtime import ServiceContext
from eldr.wire import DecisionAssignment, RequestFinished

from .settings import RouterSettings

log = logging.getLogger(__name__)

REBUILD_IDS_PER_ENTRY = 4
"""Finished request ids a rebuild keeps at most, per activity entry the table may hold
(`activity_max_entries`, 65,536: 262,144 ids, about 30 MB while it runs)."""


@dataclass
class Rebuilt:
    """What a rebuild read and found."""

    seconds: float = 0.0
    finished: int = 0
    """Finish events read."""
    decisions: int = 0
    """Decisions read."""
    in_flight: int = 0
    """Requests counted in the activity table at the end."""
    complete: bool = False
    """Both streams were read to their end within the time limit (and the finished ids
    fitted `max_requests`)."""
    error: str | None = None


class RebuildMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.seconds = Gauge(
            "eldr_router_rebuild_seconds",
            "How long this replica's start-up rebuild of its in-flight bookkeeping took "
            "(replaying DECISIONS and FINISHED over the activity lifetime).",
            registry=registry,
        )
        self.messages = Gauge(
            "eldr_router_rebuild_messages",
            "Messages the start-up rebuild read, by stream (decisions, finished).",
            ["stream"],
            registry=registry,
        )
        self.in_flight = Gauge(
            "eldr_router_rebuild_in_flight_requests",
            "Requests the start-up rebuild found in flight (activity entries).",
            registry=registry,
        )
        self.complete = Gauge(
            "eldr_router_rebuild_complete",
            "1 if the start-up rebuild read both streams to their end within its time "
            "limit and memory bound, else 0 (it started with what it had read).",
            registry=registry,
        )

    def record(self, rebuilt: Rebuilt) -> None:
        self.seconds.set(rebuilt.seconds)
        self.messages.labels("decisions").set(rebuilt.decisions)
        self.messages.labels("finished").set(rebuilt.finished)
        self.in_flight.set(rebuilt.in_flight)
        self.complete.set(1 if rebuilt.complete else 0)


@dataclass
class _Finishes:
    """The finish events of the window, bounded."""

    max_requests: int
    recent_after_s: float
    """Wall clock: finishes after this are replayed into the load table too."""
    ids: set[str]
    moved: dict[str, str]
    recent: list[tuple[str, float]]
    overflow: int = 0

    def add(self, msg: RequestFinished, ts_s: float) -> None:
        if len(self.ids) + len(self.moved) >= self.max_requests:
            self.overflow += 1
            return
        if msg.reason == "moved" and msg.moved_to is not None:
            self.moved[msg.request_id] = msg.moved_to
            return
        self.ids.add(msg.request_id)
        if ts_s >= self.recent_after_s:
            self.recent.append((msg.request_id, ts_s))


async def _read_to_end(reader: ReadBack, deadline: float) -> bool:
    """Wait until `reader` has read what its stream held when it started; False (and the
    read-back stopped) at `deadline` (monotonic s)."""
    try:
        await reader.wait_caught_up(timeout_s=max(0.0, deadline - time.monotonic()))
    except TimeoutError:
        await reader.stop()
        return False
    await reader.finished.wait()
    return True


async def rebuild(
    bus: Bus,
    core: RouterCore,
    *,
    decisions_stream: str,
    finished_stream: str,
    lifetime_s: float,
    pending_ttl_s: float,
    timeout_s: float,
    max_requests: int,
) -> Rebuilt:
    """Rebuild `core`'s in-flight bookkeeping from the streams (module docstring)."""
    started = time.monotonic()
    wall_now = time.time()
    deadline = started + timeout_s
    since_s = wall_now - lifetime_s
    result = Rebuilt()
    events = RouterEvents(core)

    def monotonic_at(ts_s: float | None) -> float:
        """A stored message's wall-clock time on this process's monotonic clock."""
        return started - (wall_now - (ts_s if ts_s is not None else wall_now))

    finishes = _Finishes(
        max_requests=max_requests,
        recent_after_s=wall_now - pending_ttl_s,
        ids=set(),
        moved={},
        recent=[],
    )

    async def on_finished(msg: RequestFinished, delivery: Delivery) -> None:
        result.finished += 1
        finishes.add(msg, delivery.timestamp_s or wall_now)

    async def on_decision(msg: DecisionAssignment, delivery: Delivery) -> None:
        result.decisions += 1
        rid = msg.request_id
        if not msg.assigned or msg.signature is None or rid in finishes.ids:
            return
        worker_id = finishes.moved.get(rid, msg.worker_id)
        events.count_experts(msg, worker_id, monotonic_at(delivery.timestamp_s))

    complete = False
    try:
        reader = await bus.read_back(
            finished_stream,
            bus.subjects.finished_all,
            RequestFinished,
            on_finished,
            start_time_s=since_s,
            stop_at_end=True,
            on_undecodable=lambda _: None,  # the live subscription dead-letters them
            identity=IDENTITY[RequestFinished],
        )
        if await _read_to_end(reader, deadline):
            reader = await bus.read_back(
                decisions_stream,
                bus.subjects.decisions_all,
                DecisionAssignment,
                on_decision,
                start_time_s=since_s,
                stop_at_end=True,
                on_undecodable=lambda _: None,
            )
            complete = await _read_to_end(reader, deadline)
    except BusError as exc:
        result.error = str(exc)
    for rid, ts_s in finishes.recent:
        core.note_finished(rid, monotonic_at(ts_s))
    result.complete = complete and finishes.overflow == 0 and result.error is None
    result.in_flight = len(core.activity)
    result.seconds = time.monotonic() - started
    return result


def report(rebuilt: Rebuilt, instance_id: str, lifetime_s: float) -> None:
    """One log line saying what a rebuild found (a warning when it was cut short)."""
    say = log.info if rebuilt.complete else log.warning
    say(
        "router %s rebuilt its in-flight bookkeeping in %.2f s%s: %d requests in flight "
        "(%d decisions, %d finish events read over the last %.0f s)%s",
        instance_id,
        rebuilt.seconds,
        "" if rebuilt.complete else " (INCOMPLETE: starting with what it read)",
        rebuilt.in_flight,
        rebuilt.decisions,
        rebuilt.finished,
        lifetime_s,
        f"; {rebuilt.error}" if rebuilt.error else "",
    )


async def rebuild_at_start(
    ctx: ServiceContext[RouterSettings], core: RouterCore, topology: Topology
) -> Rebuilt | None:
    """The router's start-up rebuild with its settings, metrics and log line; None when
    its policy reads no activity or `rebuild_timeout_s` is 0 (nothing to rebuild)."""
    s = ctx.settings
    metrics = RebuildMetrics(ctx.registry)
    if not core.policy.uses_activity or s.rebuild_timeout_s <= 0:
        return None
    rebuilt = await rebuild(
        ctx.bus,
        core,
        decisions_stream=topology.stream_name(DECISIONS),
        finished_stream=topology.stream_name(FINISHED),
        lifetime_s=s.activity_ttl_s,
        pending_ttl_s=s.pending_ttl_s,
        timeout_s=s.rebuild_timeout_s,
        max_requests=REBUILD_IDS_PER_ENTRY * s.activity_max_entries,
    )
    metrics.record(rebuilt)
    report(rebuilt, s.instance_id, s.activity_ttl_s)
    return rebuilt
