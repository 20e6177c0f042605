"""A decision's recorded inputs, as the replay reads them back: the fleet the router saw,
the inputs a v4 record carries, the request, the profile, the partition of its version, when
the request stopped loading its worker, and the activity table rebuilt from the window's
decisions (for cost-aware policies, which read what a decision before v4 did not record).
Reproduction (`eldr.replay.reproduction`) and the what-if (`eldr.replay.whatif`) both read
decisions through these."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from eldr.core.partition.partition import Partition
from eldr.core.routing.activity import DEFAULT_TTL_S, ActivityTable, ActivityView, RecordedActivity
from eldr.core.routing.decide import SIGNATURE_FALLBACKS, RouteRequest, request_demand
from eldr.core.routing.profile import ProfileBase
from eldr.partitions.codec import partition_from_blob
from eldr.replay.eventlog import EventLog
from eldr.wire import Decision, DecodeSummary

ACTIVITY_TTL_S = DEFAULT_TTL_S
"""How long a request without a recorded finish stays in a rebuilt activity table (the
router's `activity_ttl_s` default)."""


def recorded_fleet(d: Decision) -> tuple[tuple[str, ...], np.ndarray, np.ndarray]:
    """(live workers, in-flight requests, KV tokens) as the router saw them.

    Records without `fleet` hold only the policy's measure (`loads`); it then stands in
    for both (the policy read nothing else). A fleet-scale decision (v4) holds only its
    candidates (`considered`): they stand in for the fleet.
    """
    if d.fleet:
        workers = tuple(w for w, _, _ in d.fleet)
        in_flight = np.array([n for _, n, _ in d.fleet], dtype=np.int64)
        kv = np.array([k for _, _, k in d.fleet], dtype=np.int64)
        return workers, in_flight, kv
    if d.considered and not d.loads:
        # A fleet-scale decision read only its candidates (v4): they are what it saw.
        workers = tuple(row[0] for row in d.considered)
        in_flight = np.array([row[1] for row in d.considered], dtype=np.int64)
        kv = np.array([row[2] for row in d.considered], dtype=np.int64)
        return workers, in_flight, kv
    workers = tuple(w for w, _ in d.loads)
    load = np.array([round(x) for _, x in d.loads], dtype=np.int64)
    return workers, load, load.copy()


@dataclass(frozen=True)
class RecordedInputs:
    """What a v4 record says its stages read (`Decision.considered`): the workers of the
    replayed view (the fleet, or only the candidates where the decision read no other
    worker), their loads, the candidates' scores (None where the fleet's scores are
    recomputed from the partition), their activity terms and the fleet's mean loads."""

    workers: tuple[str, ...]
    in_flight: np.ndarray
    kv_tokens: np.ndarray
    scores: np.ndarray | None
    activity: RecordedActivity | None
    mean_loads: tuple[float, float] | None


def recorded_inputs(d: Decision) -> RecordedInputs | None:
    """The stage inputs a record holds (None for records without `considered`)."""
    if not d.considered:
        return None
    rows = d.considered
    by_worker = {row[0]: row for row in rows}
    if d.fleet:
        workers, in_flight, kv = recorded_fleet(d)
        scores = None
        mean_loads = None
    else:
        workers = tuple(row[0] for row in rows)
        in_flight = np.array([row[1] for row in rows], dtype=np.int64)
        kv = np.array([row[2] for row in rows], dtype=np.int64)
        scores = np.array([-np.inf if row[3] is None else row[3] for row in rows], dtype=np.float32)
        live = max(d.live_workers or len(rows), 1)
        totals = d.fleet_totals or (int(in_flight.sum()), int(kv.sum()))
        mean_loads = (totals[0] / live, totals[1] / live)
    activity = None
    if any(row[4] is not None for row in rows) and d.signature is not None:
        union = np.full(len(workers), np.nan)
        added = np.full(len(workers), np.nan)
        for i, w in enumerate(workers):
            row = by_worker.get(w)
            if row is not None and row[4] is not None and row[5] is not None:
                union[i], added[i] = row[4], row[5]
        activity = RecordedActivity(tuple(d.signature.shape), union, added)  # type: ignore[arg-type]
    return RecordedInputs(workers, in_flight, kv, scores, activity, mean_loads)


def request_of(d: Decision) -> RouteRequest:
    """The `RouteRequest` the router routed (its signature error comes from the fallback)."""
    counts = None if d.signature is None else d.signature.to_dense(np.uint32)
    error = None
    if counts is None:
        error = d.fallback if d.fallback in SIGNATURE_FALLBACKS else "no_signature"
    return RouteRequest(
        request_id=d.request_id,
        model=d.model,
        prompt_tokens=d.prompt_tokens or 0,
        counts=counts,
        missing_blocks=d.missing_blocks,
        signature_error=error,
    )


def recorded_profile(d: Decision) -> ProfileBase | None:
    """The routing profile a decision records (`Decision.routing_profile`); None for a
    policy or parameter this code does not know."""
    try:
        return d.routing_profile
    except ValueError:
        return None


def describe_recorded(d: Decision) -> str:
    """The recorded profile in one line (`ProfileBase.describe`)."""
    profile = recorded_profile(d)
    return f"{d.policy} (unknown)" if profile is None else profile.describe()


def least_loaded_candidates(d: Decision) -> tuple[str, ...]:
    """The workers the recorded decision's final pick was made among: the least loaded of
    the band (locality), or of every live worker (load-only, fallback)."""
    workers, in_flight, kv = recorded_fleet(d)
    profile = recorded_profile(d)
    load = kv if profile is not None and profile.measure == "kv_tokens" else in_flight
    band = set(d.band)
    idx = [i for i, w in enumerate(workers) if w in band] or list(range(len(workers)))
    best = min(load[i] for i in idx)
    return tuple(workers[i] for i in idx if load[i] == best)


def needed_draw(d: Decision) -> bool:
    """Whether the recorded choice depended on the decision's random draw (as far as the
    record tells: a cost-aware policy's ties are not visible in it)."""
    profile = recorded_profile(d)
    if profile is not None and profile.draws:
        return len(recorded_fleet(d)[0]) > 1
    if profile is not None and (profile.stateful or profile.uses_activity):
        return False
    return len(least_loaded_candidates(d)) > 1


class PartitionCache:
    """Router-side `Partition`s of a log's blobs, built once per version."""

    def __init__(self, event_log: EventLog, index_method: str = "auto") -> None:
        self._log = event_log
        self._index_method = index_method
        self._cache: dict[int, Partition | None] = {}
        self.errors: dict[int, str] = {}

    def get(self, version: int | None) -> Partition | None:
        if version is None:
            return None
        if version not in self._cache:
            blob = self._log.partition_blob(version)
            partition = None
            if blob is None:
                self.errors[version] = f"partition version {version} is not in the log"
            else:
                try:
                    partition = partition_from_blob(blob, self._index_method)
                except ValueError as exc:
                    self.errors[version] = f"partition version {version} is unusable: {exc}"
            self._cache[version] = partition
        return self._cache[version]


def _summary_end(d: Decision, summary: DecodeSummary | None) -> float | None:
    if summary is None or summary.ts_s <= d.ts_s:
        return None
    return summary.ts_s


def request_end(d: Decision, log: EventLog) -> float | None:
    """When the request stopped loading its worker: the earlier of its decode summary and
    its final finish event (whichever was recorded, after its decision), else None."""
    ends = [
        t
        for t in (
            _summary_end(d, log.summaries.get(d.request_id)),
            getattr(log.finishes.get(d.request_id), "ts_s", None),
        )
        if t is not None and t > d.ts_s
    ]
    return min(ends) if ends else None


def request_ends(
    decisions: Sequence[Decision], log: EventLog, default_s: float | None
) -> list[float | None]:
    """When each request stopped loading its worker (`request_end`: its decode summary or
    finish event), else `default_s` after its decision (None: unknown)."""
    out: list[float | None] = []
    for d in decisions:
        end = request_end(d, log)
        if end is None and default_s is not None:
            end = d.ts_s + default_s
        out.append(end)
    return out


class ActivityTrack:
    """An activity table rebuilt from decisions: a request enters at its decision and
    leaves at its end (decode summary), or after ACTIVITY_TTL_S like in the router."""

    def __init__(self, ends: Sequence[float | None]) -> None:
        self.table = ActivityTable(ttl_s=ACTIVITY_TTL_S)
        self._ends = ends
        self._due: list[tuple[float, str]] = []

    def advance(self, t: float) -> None:
        while self._due and self._due[0][0] <= t:
            _, rid = heapq.heappop(self._due)
            self.table.finish(rid)
        self.table.expire(t)

    def add(self, i: int, worker: str, d: Decision, profile: ProfileBase | None) -> None:
        if profile is None or d.signature is None:
            return
        demand = request_demand(profile, request_of(d))
        if demand is not None and self.table.add(worker, d.request_id, demand, d.ts_s):
            end = self._ends[i]
            if end is not None:
                heapq.heappush(self._due, (end, d.request_id))

    def view(self, workers: tuple[str, ...]) -> ActivityView | None:
        """The table as it is now, for one decision (valid until the next `view`, also
        across an `add`)."""
        return self.table.view(workers)
