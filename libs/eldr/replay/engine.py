"""Deterministic replay of recorded routing decisions, and what-if replays of the same traffic.

**Reproduction.** For every recorded `Decision`, rebuild the router's inputs at that moment
from the record itself: the live workers with both load measures as the router saw them
(`fleet`), the partition version it used (its blob from the log), the request's signature
and prompt length, the policy and its parameters, and the seed of the decision's draws
(`rng_seed`). Then run `eldr.core.routing.decide.route`, the function the router itself runs, and
compare the worker, the band, the fallback and the top scores. Each decision is checked on
its own recorded inputs, so one difference cannot cascade. Round-robin keeps a cursor per
router replica: each of its decisions is replayed from the same replica's previous one (the
first per replica in the window only sets the cursor: "anchored"). Records written before
`rng_seed` existed cannot reproduce tie-breaks: a different worker that was tied for the
least load is then counted as `tie_unrecorded`, not as a mismatch. Cost-aware policies
(`Policy.uses_activity`, "eldr_cost") also read the router's activity table (the experts
each worker's in-flight requests are predicted to activate), which a decision does not
record: the replay rebuilds it from the window's decisions (a request enters at its
decision) and decode profiles (it leaves when its profile was recorded). The router saw
other replicas' decisions and the profiles a little later than that, and requests decided
before the window are missing, so such decisions are reproduced on approximate inputs and
counted apart (`approximate`, `approximate_mismatched`).

**Counterfactual.** The same decisions under another policy, other profile parameters
(tau, load measure, ...: on each decision whose policy takes them) or another partition.
Loads then change as decisions change; the load model is a correction of what the router
saw: a worker's load at a decision = the load recorded in that decision + the requests the
replay sent it that are still in flight - the requests the recording sent it that are
still in flight, counting only requests whose worker changed. A request is in flight from
its decision until its decode profile was recorded (the median profiled duration, or
`default_duration_s`, when it has none); its KV load is its prompt plus the tokens decoded
so far (linear over its lifetime). Everything that did not change keeps its recorded
effect, including requests decided before the window. Each decision keeps its recorded
seed, so ties are broken by the same draws. A cost-aware policy's activity table is
rebuilt from the replay's own assignments over the same lifetimes.

**Modelled decode effect.** Where decode profiles were recorded, each worker's batch is
sampled every `sample_s` seconds: the profiled requests in flight on it. A request's decode
profile gives p[l, e] = counts[l, e] / tokens, the chance that one of its tokens routes to
expert e at MoE layer l; the expected number of distinct experts a step streams is
sum over (l, e) of 1 - prod over the batch of (1 - p[l, e]) (tokens drawn independently from
their requests' profiles: `eldr.core.routing.activity.expected_union`, the one model of a
batch's union that the router and the trainer's shadow gate use too). The cost model
(`eldr.core.costmodel`) turns that union and the batch's KV tokens into a step time; a
request's modelled TPOT is the mean step time of its worker over its lifetime. Requests
without a profile are not in the modelled batches.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np

from eldr.core.costmodel import CostProfile
from eldr.core.partition.partition import Partition
from eldr.core.routing.activity import (
    DEFAULT_TTL_S,
    ActivityTable,
    ActivityView,
    RecordedActivity,
    expected_union,
)
from eldr.core.routing.decide import (
    SIGNATURE_FALLBACKS,
    DecisionRng,
    RouteOutcome,
    RouteRequest,
    activity_for,
    request_demand,
    route,
)
from eldr.core.routing.pipeline import Policy, make_policy
from eldr.core.routing.profile import (
    PROFILE_TYPES,
    ProfileBase,
    params_taken,
    profile_from_params,
)
from eldr.partitions.codec import partition_from_blob
from eldr.progress import NO_PROGRESS, Progress
from eldr.replay.eventlog import EventLog
from eldr.wire import Decision, DecodeProfile

DEFAULT_DURATION_S = 10.0
"""In-flight time of a request without a decode profile when no request has one."""
SCORE_TOLERANCE = 1e-5
MAX_SAMPLES = 4000
"""Upper bound on batch samples of the decode model (its cost is samples x workers)."""

ACTIVITY_TTL_S = DEFAULT_TTL_S
"""How long a request without a recorded finish stays in a rebuilt activity table (the
router's `activity_ttl_s` default)."""

Status = Literal[
    "reproduced", "mismatch", "anchored", "unreplayable", "tie_unrecorded", "approximate"
]


# --- a decision's recorded inputs -----------------------------------------------------------


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


def recorded_score_problem(
    d: Decision, inputs: RecordedInputs, partition: Partition | None
) -> str | None:
    """Why the candidates' recorded scores do not match the partition (None: they do, or
    there is nothing to check)."""
    if inputs.scores is None or partition is None or d.signature is None:
        return None
    exact = partition.exact_scores_for(d.signature.to_dense(np.uint32), inputs.workers)
    recorded = np.isfinite(inputs.scores)
    if not np.isfinite(exact[recorded]).all():
        return "a recorded candidate has no centroid in the partition"
    worst = float(np.max(np.abs(exact[recorded] - inputs.scores[recorded]), initial=0.0))
    if worst > SCORE_TOLERANCE:
        return f"recorded scores differ from the partition's by up to {worst:.2e}"
    return None


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


def difference(d: Decision, outcome: RouteOutcome) -> str | None:
    """What differs between a recorded decision and a replayed one (None: nothing)."""
    if outcome.worker_id != d.worker_id:
        return f"worker {d.worker_id} recorded, {outcome.worker_id} replayed"
    if tuple(d.band) != outcome.band:
        return f"band {list(d.band)} recorded, {list(outcome.band)} replayed"
    if d.fallback != outcome.fallback:
        return f"fallback {d.fallback} recorded, {outcome.fallback} replayed"
    if d.partition_version != outcome.partition_version:
        return (
            f"partition version {d.partition_version} recorded, "
            f"{outcome.partition_version} replayed"
        )
    recorded_scores = list(d.scores)
    replayed_scores = list(outcome.scores)[: len(recorded_scores)]
    if [w for w, _ in recorded_scores] != [w for w, _ in replayed_scores] or any(
        abs(a - b) > SCORE_TOLERANCE
        for (_, a), (_, b) in zip(recorded_scores, replayed_scores, strict=True)
    ):
        return f"scores {recorded_scores} recorded, {replayed_scores} replayed"
    return None


@dataclass(frozen=True)
class Reproduction:
    status: Status
    outcome: RouteOutcome | None = None
    detail: str = ""


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


def reproduce_decision(
    d: Decision,
    partition: Partition | None,
    rngs: DecisionRng,
    policy: Policy | None = None,
    max_scores: int | None = None,
    expert_miss: ActivityView | None = None,
) -> Reproduction:
    """Re-run one decision on its recorded inputs. `partition`: the blob of
    `d.partition_version` (None when the record names none or it is missing); `policy`:
    a policy instance carrying state (round-robin), else one is built from the record's
    profile; `expert_miss`: a rebuilt activity view, for cost-aware policies."""
    if d.partition_version is not None and partition is None:
        return Reproduction(
            "unreplayable", detail=f"partition version {d.partition_version} is not available"
        )
    try:
        chooser = policy or make_policy(d.routing_profile)
    except ValueError as exc:
        return Reproduction("unreplayable", detail=f"policy {d.policy!r}: {exc}")
    inputs = recorded_inputs(d)
    if inputs is not None:
        problem = recorded_score_problem(d, inputs, partition)
        if problem is not None:
            return Reproduction("mismatch", detail=problem)
        outcome = route(
            request_of(d),
            policy=chooser,
            partition=partition,
            workers=inputs.workers,
            in_flight=inputs.in_flight,
            kv_tokens=inputs.kv_tokens,
            rng=rngs.seeded(d.rng_seed or 0),
            rng_seed=d.rng_seed,
            max_scores=max_scores or max(len(d.scores), 1),
            expert_miss=inputs.activity,
            scores=inputs.scores,
            mean_loads=inputs.mean_loads,
        )
        diff = difference(d, outcome)
        if diff is None:
            return Reproduction("reproduced", outcome)
        return Reproduction("mismatch", outcome, detail=diff)
    workers, in_flight, kv = recorded_fleet(d)
    outcome = route(
        request_of(d),
        policy=chooser,
        partition=partition,
        workers=workers,
        in_flight=in_flight,
        kv_tokens=kv,
        rng=rngs.seeded(d.rng_seed or 0),
        rng_seed=d.rng_seed,
        max_scores=max_scores or max(len(d.scores), 1),
        expert_miss=expert_miss,
    )
    diff = difference(d, outcome)
    if diff is None:
        return Reproduction("reproduced", outcome)
    if chooser.uses_activity:
        return Reproduction("approximate", outcome, detail=f"{diff} (activity rebuilt)")
    if d.rng_seed is None and d.worker_id in least_loaded_candidates(d):
        return Reproduction(
            "tie_unrecorded", outcome, detail=f"{diff} (tie; the record has no rng_seed)"
        )
    return Reproduction("mismatch", outcome, detail=diff)


# --- reports --------------------------------------------------------------------------------


@dataclass
class ReproductionReport:
    decisions: int = 0
    reproduced: int = 0
    mismatched: int = 0
    anchored: int = 0
    """Round-robin decisions that set their replica's cursor (first in the window)."""
    unreplayable: int = 0
    tie_unrecorded: int = 0
    approximate: int = 0
    """Decisions of cost-aware policies, replayed on a rebuilt activity table."""
    approximate_mismatched: int = 0
    """Of those, the ones that came out differently (not counted as mismatches)."""
    needed_draw: int = 0
    """Decisions whose choice depended on their seeded draw (ties, random, P2C)."""
    reasons: dict[str, int] = field(default_factory=dict)
    mismatches: list[dict[str, str]] = field(default_factory=list)

    @property
    def checked(self) -> int:
        """Decisions replayed on exactly their recorded inputs."""
        return self.decisions - self.anchored - self.unreplayable - self.approximate

    @property
    def share(self) -> float:
        return self.reproduced / self.checked if self.checked else 1.0

    @property
    def complete(self) -> bool:
        """Every decision replayed on its recorded inputs reproduced."""
        return self.mismatched == 0


@dataclass
class SideSummary:
    """The recorded (before) or replayed (after) decisions of a window."""

    per_worker: dict[str, int]
    fallbacks: dict[str, int]
    similarity_mean: float | None
    """Mean cosine similarity of each request's signature to its chosen worker's nearest
    centroid, under the reference partition (see `CounterfactualReport`)."""
    chosen_load_mean: float | None
    """Mean load (the replay's measure) of the chosen worker when it was chosen."""


@dataclass
class BatchSummary:
    expert_union_per_layer: float
    """Mean expected distinct experts per MoE layer per step, over (sample, worker) pairs
    with a non-empty batch."""
    batch_mean: float
    tpot_mean_ms: float | None
    tpot_p50_ms: float | None
    tpot_p95_ms: float | None


@dataclass
class ModelledEffect:
    requests: int
    profiled: int
    sample_s: float
    samples: int
    num_moe_layers: int
    num_experts: int
    cost_profile: str | None
    before: BatchSummary
    after: BatchSummary
    measured_tpot_p50_ms: float | None
    """TPOT P50 the decode workers themselves measured (profiles' `tpot_s`), if any."""
    notes: list[str] = field(default_factory=list)
    tpot_before_ms: np.ndarray | None = field(default=None, repr=False)
    tpot_after_ms: np.ndarray | None = field(default=None, repr=False)

    def change_pct(self) -> dict[str, float | None]:
        def pct(a: float | None, b: float | None) -> float | None:
            if a is None or b is None or a == 0:
                return None
            return round(100.0 * (b / a - 1.0), 3)

        return {
            "expert_union_per_layer": pct(
                self.before.expert_union_per_layer, self.after.expert_union_per_layer
            ),
            "tpot_mean_ms": pct(self.before.tpot_mean_ms, self.after.tpot_mean_ms),
            "tpot_p50_ms": pct(self.before.tpot_p50_ms, self.after.tpot_p50_ms),
            "tpot_p95_ms": pct(self.before.tpot_p95_ms, self.after.tpot_p95_ms),
        }


@dataclass
class CounterfactualReport:
    changes: dict[str, str]
    """What the replay changed, e.g. {"tau": "0.1 -> 0"}."""
    policy: str
    """The replayed configuration of the most recent decision (one line)."""
    decisions: int
    changed: int
    kept: int
    """Decisions the replay could not re-decide (missing partition): kept as recorded."""
    similarity_decisions: int
    reference_partitions: list[int]
    before: SideSummary
    after: SideSummary
    moves: list[dict[str, str]]
    """The first changed decisions: request id, recorded worker, replayed worker."""
    modelled: ModelledEffect | None
    load_model: str
    activity_model: str | None = None
    """How the what-if got the activity a cost-aware policy reads (None: it read none)."""
    candidates_only: int = 0
    """Decisions recorded by a fleet-scale profile: the record lists only the candidates
    it read, so the what-if chooses among those."""
    changed_at_s: list[float] = field(default_factory=list, repr=False)
    decided_at_s: list[float] = field(default_factory=list, repr=False)

    @property
    def changed_share(self) -> float:
        return self.changed / self.decisions if self.decisions else 0.0


@dataclass
class ReplayReport:
    source: str
    namespace: str
    decisions: int
    first_ts_s: float | None
    last_ts_s: float | None
    recorded_policies: dict[str, int]
    reproduction: ReproductionReport
    counterfactual: CounterfactualReport | None
    notes: list[str]
    expired: int = 0
    """Expired records in the log (no worker assigned): not replayed."""

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (arrays dropped; plots read them from the objects)."""
        out = asdict(self)
        out["reproduction"]["checked"] = self.reproduction.checked
        out["reproduction"]["share"] = round(self.reproduction.share, 6)
        out["reproduction"]["complete"] = self.reproduction.complete
        cf = out.get("counterfactual")
        if cf is not None and self.counterfactual is not None:
            cf.pop("changed_at_s", None)
            cf.pop("decided_at_s", None)
            cf["changed_share"] = round(self.counterfactual.changed_share, 6)
            modelled = cf.get("modelled")
            if modelled is not None and self.counterfactual.modelled is not None:
                modelled.pop("tpot_before_ms", None)
                modelled.pop("tpot_after_ms", None)
                modelled["change_pct"] = self.counterfactual.modelled.change_pct()
        result: dict[str, Any] = _finite(out)
        return result


def _finite(value: Any) -> Any:
    """NaN and infinities as None (JSON has neither)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


# --- the replay -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplayConfig:
    """What a replay changes (None / unset: as recorded) and how it models the effect."""

    policy: str | None = None
    """Replay every decision with this policy (the parameters it takes carry over from
    each recorded profile)."""
    params: tuple[tuple[str, float | str], ...] = ()
    """Profile parameters to set (e.g. ("tau", 0.0), ("slack", 0.2)), on every decision
    whose (replayed) policy takes them; the others keep their recorded value."""
    partition: Partition | None = None
    """Route every decision with this partition instead of the recorded version."""
    index_method: str = "auto"
    cost: CostProfile | None = None
    sample_s: float | None = None
    """Batch sampling step of the decode model; None = automatic."""
    default_duration_s: float | None = None
    """In-flight time of requests without a decode profile; None = median of the profiled."""
    max_listed: int = 20

    def __post_init__(self) -> None:
        # Refuse now what no decision could be replayed with (ValueError says why).
        if self.policy is not None:
            profile_from_params(self.policy, dict(self.params))
            return
        for name, value in self.params:
            takers = [p for p, t in PROFILE_TYPES.items() if name in t.__struct_fields__]
            if not takers:
                raise ValueError(f"no policy takes a parameter {name!r}")
            profile_from_params(takers[0], {name: value})

    @property
    def counterfactual(self) -> bool:
        return bool(self.params) or self.policy is not None or self.partition is not None

    def applied_to(self, recorded: ProfileBase | None) -> ProfileBase | None:
        """The replayed profile of a decision recorded under `recorded` (None: a policy
        this code does not know); None when there is nothing to replay it with."""
        name = self.policy or (None if recorded is None else recorded.name)
        if name is None:
            return None
        return profile_from_params(name, params_taken(name, dict(self.params)), keep=recorded)


def _profile_end(d: Decision, profile: DecodeProfile | None) -> float | None:
    if profile is None or profile.ts_s <= d.ts_s:
        return None
    return profile.ts_s


def request_end(d: Decision, log: EventLog) -> float | None:
    """When the request stopped loading its worker: the earlier of its decode profile and
    its final finish event (whichever was recorded, after its decision), else None."""
    ends = [
        t
        for t in (
            _profile_end(d, log.profiles.get(d.request_id)),
            getattr(log.finishes.get(d.request_id), "ts_s", None),
        )
        if t is not None and t > d.ts_s
    ]
    return min(ends) if ends else None


class _ActivityTrack:
    """An activity table rebuilt from decisions: a request enters at its decision and
    leaves at its end (decode profile), or after ACTIVITY_TTL_S like in the router."""

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


class Replayer:
    def __init__(
        self,
        event_log: EventLog,
        config: ReplayConfig | None = None,
        progress: Progress = NO_PROGRESS,
    ) -> None:
        """progress: one unit per decision reproduced and per decision replayed what-if."""
        self.log = event_log
        self.config = config or ReplayConfig()
        self.progress = progress
        self.partitions = PartitionCache(event_log, self.config.index_method)
        self._rngs = DecisionRng()
        self._policies: dict[ProfileBase, Policy | None] = {}

    def reproduce(self) -> ReproductionReport:
        report = ReproductionReport()
        cursors: dict[str, Policy] = {}
        previous: dict[str, Decision] = {}
        reasons: Counter[str] = Counter()
        decisions = self.log.decisions
        profiles = [recorded_profile(d) for d in decisions]
        track = None
        if any(p is not None and p.uses_activity for p in profiles):
            track = _ActivityTrack(self._ends(decisions, default_s=None))
        self.progress.describe("reproducing")
        for i, d in enumerate(decisions):
            self.progress.advance()
            report.decisions += 1
            profile = profiles[i]
            expert_miss = None
            if track is not None:
                track.advance(d.ts_s)
                if not d.considered:
                    expert_miss = track.view(recorded_fleet(d)[0])
                track.add(i, d.worker_id, d, profile)
            policy: Policy | None = None
            if profile is not None and profile.stateful:
                prev = previous.get(d.router_id)
                previous[d.router_id] = d
                if prev is None or recorded_profile(prev) != profile:
                    report.anchored += 1
                    continue
                cursor = cursors.get(d.router_id)
                if cursor is None or cursor.profile != profile:
                    cursor = cursors[d.router_id] = make_policy(profile)
                cursor.resume_after(prev.worker_id, recorded_fleet(prev)[0])
                policy = cursor
            else:
                previous[d.router_id] = d
            result = reproduce_decision(
                d,
                self.partitions.get(d.partition_version),
                self._rngs,
                policy,
                expert_miss=expert_miss,
            )
            choice = None if result.outcome is None else result.outcome.choice
            if result.status == "reproduced" and choice is not None and d.considered:
                # The stages were re-run on exactly what they read: their ties are known.
                drew = len(choice.tied) > 1 or (profile is not None and profile.draws)
            else:
                drew = needed_draw(d)
            report.needed_draw += drew
            # Activity rebuilt from the window (records before v4): counted apart.
            uses_activity = (
                profile is not None and profile.uses_activity and recorded_inputs(d) is None
            )
            if uses_activity and result.status in ("reproduced", "approximate"):
                report.approximate += 1
                if result.status == "approximate":
                    report.approximate_mismatched += 1
            elif result.status == "reproduced":
                report.reproduced += 1
            elif result.status == "unreplayable":
                report.unreplayable += 1
                reasons[result.detail] += 1
            elif result.status == "tie_unrecorded":
                report.tie_unrecorded += 1
            else:
                report.mismatched += 1
                if len(report.mismatches) < self.config.max_listed:
                    report.mismatches.append(
                        {
                            "request_id": d.request_id,
                            "router_id": d.router_id,
                            "detail": result.detail,
                        }
                    )
        report.reasons = dict(reasons)
        return report

    def _policy(self, profile: ProfileBase | None) -> Policy | None:
        """A shared (stateless use only) instance per profile; None if unknown."""
        if profile is None:
            return None
        if profile not in self._policies:
            try:
                self._policies[profile] = make_policy(profile)
            except ValueError:
                self._policies[profile] = None
        return self._policies[profile]

    def _ends(self, decisions: Sequence[Decision], default_s: float | None) -> list[float | None]:
        """When each request stopped loading its worker (`request_end`: its decode profile or
        finish event), else `default_s` after its decision (None: unknown)."""
        out: list[float | None] = []
        for d in decisions:
            end = request_end(d, self.log)
            if end is None and default_s is not None:
                end = d.ts_s + default_s
            out.append(end)
        return out

    def _durations(self) -> float:
        if self.config.default_duration_s is not None:
            return self.config.default_duration_s
        spans = [
            end - d.ts_s
            for d in self.log.decisions
            if (end := request_end(d, self.log)) is not None
        ]
        return float(np.median(spans)) if spans else DEFAULT_DURATION_S

    def counterfactual(self) -> CounterfactualReport:
        cfg = self.config
        decisions = self.log.decisions
        profiles = self.log.profiles
        default_duration_s = self._durations()
        ends = [request_end(d, self.log) or d.ts_s + default_duration_s for d in decisions]
        active: list[int] = []  # decisions whose worker changed and that are in flight
        policies: dict[tuple[str, ProfileBase], Policy] = {}
        after: list[str] = []
        kept = 0
        chosen_before: list[float] = []
        chosen_after: list[float] = []
        sims_before: list[float] = []
        sims_after: list[float] = []
        ref_versions: set[int] = set()
        fallbacks_after: Counter[str] = Counter()
        moves: list[dict[str, str]] = []
        changed_at: list[float] = []
        last_config: ProfileBase | None = None
        track: _ActivityTrack | None = None
        candidates_only = 0
        self.progress.describe("what-if")
        for i, d in enumerate(decisions):
            self.progress.advance()
            t = d.ts_s
            active = [j for j in active if ends[j] > t]
            workers, in_flight, kv = recorded_fleet(d)
            config = cfg.applied_to(recorded_profile(d))
            if config is not None:
                last_config = config
            if active:
                in_flight, kv = self._corrected(workers, in_flight, kv, active, after, t, ends)
            shared = self._policy(config)
            partition = self._partition_for(d, shared)
            missing = (
                shared is not None
                and shared.wants_scores
                and partition is None
                and self._needs_blob(d)
            )
            if config is None or shared is None or missing:  # unknown, or a blob the log lacks
                after.append(d.worker_id)
                kept += 1
                continue
            key = (d.router_id, config)
            policy = policies.get(key)
            if policy is None:
                policy = policies[key] = make_policy(config)
            expert_miss = None
            if policy.uses_activity:
                if track is None:
                    track = _ActivityTrack(self._ends(decisions, default_s=None))
                track.advance(t)
                expert_miss = activity_for(policy, track.table, workers)
            mean_loads = None
            if not d.fleet and d.considered:
                candidates_only += 1
                live = max(d.live_workers or len(workers), 1)
                totals = d.fleet_totals or (int(in_flight.sum()), int(kv.sum()))
                mean_loads = (totals[0] / live, totals[1] / live)
            outcome = route(
                request_of(d),
                policy=policy,
                partition=partition,
                workers=workers,
                in_flight=in_flight,
                kv_tokens=kv,
                rng=self._rngs.seeded(d.rng_seed or 0),
                rng_seed=d.rng_seed,
                max_scores=max(len(d.scores), 1),
                expert_miss=expert_miss,
                mean_loads=mean_loads,
            )
            after.append(outcome.worker_id)
            if track is not None:
                track.add(i, outcome.worker_id, d, config)
            if outcome.fallback:
                fallbacks_after[outcome.fallback] += 1
            _, rec_in_flight, rec_kv = recorded_fleet(d)
            measure_before = rec_in_flight if config.measure == "requests" else rec_kv
            measure_after = in_flight if config.measure == "requests" else kv
            if d.worker_id in workers:  # always, unless the record is inconsistent
                chosen_before.append(float(measure_before[workers.index(d.worker_id)]))
            chosen_after.append(float(measure_after[workers.index(outcome.worker_id)]))
            reference = cfg.partition or self._reference_partition(d)
            if reference is not None:
                sims = _similarities(reference, d, (d.worker_id, outcome.worker_id))
                if sims is not None:
                    ref_versions.add(reference.version)
                    sims_before.append(sims[0])
                    sims_after.append(sims[1])
            if outcome.worker_id != d.worker_id:
                active.append(i)
                changed_at.append(t)
                if len(moves) < cfg.max_listed:
                    moves.append(
                        {"request_id": d.request_id, "from": d.worker_id, "to": outcome.worker_id}
                    )
        before_workers = [d.worker_id for d in decisions]
        modelled = None
        if any(d.request_id in profiles for d in decisions):
            modelled = model_decode_effect(
                decisions, profiles, before_workers, after, cfg.cost, cfg.sample_s
            )
        return CounterfactualReport(
            changes=self._changes(),
            policy=last_config.describe() if last_config else "-",
            decisions=len(decisions),
            changed=len(changed_at),
            kept=kept,
            similarity_decisions=len(sims_before),
            reference_partitions=sorted(ref_versions),
            before=SideSummary(
                per_worker=dict(sorted(Counter(before_workers).items())),
                fallbacks=dict(Counter(d.fallback for d in decisions if d.fallback)),
                similarity_mean=_mean(sims_before),
                chosen_load_mean=_mean(chosen_before),
            ),
            after=SideSummary(
                per_worker=dict(sorted(Counter(after).items())),
                fallbacks=dict(fallbacks_after),
                similarity_mean=_mean(sims_after),
                chosen_load_mean=_mean(chosen_after),
            ),
            moves=moves,
            modelled=modelled,
            activity_model=(
                None
                if track is None
                else "rebuilt from the replay's own assignments: a request counts on its "
                "replayed worker from its decision until its decode profile or finish event "
                f"(else {ACTIVITY_TTL_S:g} s); requests decided before the window are missing"
            ),
            candidates_only=candidates_only,
            load_model=(
                "recorded load of each decision, corrected by the in-flight requests whose "
                f"worker changed (in flight from decision to decode profile; "
                f"{default_duration_s:.3g} s without a profile)"
            ),
            changed_at_s=changed_at,
            decided_at_s=[d.ts_s for d in decisions],
        )

    def _corrected(
        self,
        workers: tuple[str, ...],
        in_flight: np.ndarray,
        kv: np.ndarray,
        active: Sequence[int],
        after: Sequence[str],
        t: float,
        ends: Sequence[float],
    ) -> tuple[np.ndarray, np.ndarray]:
        """Recorded loads minus the recording's, plus the replay's, changed requests."""
        slot = {w: i for i, w in enumerate(workers)}
        d_req = np.zeros(len(workers), dtype=np.int64)
        d_kv = np.zeros(len(workers), dtype=np.int64)
        decisions = self.log.decisions
        for j in active:
            rec = decisions[j]
            new = after[j]
            tokens = self._kv_tokens(rec, t, ends[j])
            for worker, sign in ((rec.worker_id, -1), (new, 1)):
                k = slot.get(worker)
                if k is not None:
                    d_req[k] += sign
                    d_kv[k] += sign * tokens
        return np.maximum(in_flight + d_req, 0), np.maximum(kv + d_kv, 0)

    def _kv_tokens(self, d: Decision, t: float, end: float) -> int:
        profile = self.log.profiles.get(d.request_id)
        decoded = 0.0
        if profile is not None and end > d.ts_s:
            decoded = profile.tokens * min(max((t - d.ts_s) / (end - d.ts_s), 0.0), 1.0)
        return int((d.prompt_tokens or 0) + decoded)

    def _needs_blob(self, d: Decision) -> bool:
        version = d.partition_version or self.log.version_in_force(d.ts_s)
        return version is not None

    def _partition_for(self, d: Decision, policy: Policy | None) -> Partition | None:
        if policy is None or not policy.wants_scores:
            return None
        if self.config.partition is not None:
            return self.config.partition
        return self._reference_partition(d)

    def _reference_partition(self, d: Decision) -> Partition | None:
        """The recorded partition version, else the one announced by then."""
        version = d.partition_version or self.log.version_in_force(d.ts_s)
        return self.partitions.get(version)

    def _changes(self) -> dict[str, str]:
        """What the replay changes, against the most common recorded profile."""
        cfg = self.config
        recorded = Counter(p for d in self.log.decisions if (p := recorded_profile(d)))
        usual = recorded.most_common(1)[0][0] if recorded else None
        taken = {} if usual is None else usual.params()
        out: dict[str, str] = {}
        if cfg.policy is not None:
            out["policy"] = f"{'?' if usual is None else usual.name} -> {cfg.policy}"
        for name, value in cfg.params:
            was = taken.get(name)
            out[name] = f"{'default' if was is None else _value(was)} -> {_value(value)}"
        if cfg.partition is not None:
            versions = sorted({d.partition_version or 0 for d in self.log.decisions} - {0})
            out["partition"] = f"{versions or 'none'} -> version {cfg.partition.version}"
        return out

    def run(self) -> ReplayReport:
        reproduction = self.reproduce()
        counterfactual = None
        if self.config.counterfactual:
            counterfactual = self.counterfactual()
        span = self.log.span_s()
        notes = list(self.log.notes) + sorted(set(self.partitions.errors.values()))
        return ReplayReport(
            source=self.log.source,
            namespace=self.log.namespace,
            decisions=len(self.log.decisions),
            first_ts_s=None if span is None else span[0],
            last_ts_s=None if span is None else span[1],
            recorded_policies=dict(Counter(describe_recorded(d) for d in self.log.decisions)),
            reproduction=reproduction,
            counterfactual=counterfactual,
            notes=notes,
            expired=len(self.log.expired),
        )


def replay(
    event_log: EventLog, config: ReplayConfig | None = None, progress: Progress = NO_PROGRESS
) -> ReplayReport:
    """Reproduce every decision of `event_log`, and replay it under `config` when that
    changes anything (`progress`: see `Replayer`)."""
    return Replayer(event_log, config, progress).run()


def replay_steps(event_log: EventLog, config: ReplayConfig) -> int:
    """Units of work `replay` reports to its progress."""
    return len(event_log.decisions) * (2 if config.counterfactual else 1)


def _value(value: float | int | str) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _mean(values: Sequence[float]) -> float | None:
    return float(np.mean(values)) if values else None


def _similarities(
    partition: Partition, d: Decision, workers: tuple[str, str]
) -> tuple[float, float] | None:
    """Cosine similarity of the request to each given worker's nearest centroid."""
    if d.signature is None or partition.model != d.model:
        return None
    cal = partition.calibration
    if d.signature.shape != [cal.num_moe_layers, cal.num_experts]:
        return None
    scores = partition.worker_scores(d.signature.to_dense(np.uint32))
    slot = {w: i for i, w in enumerate(partition.workers)}
    out = []
    for w in workers:
        i = slot.get(w)
        if i is None or not np.isfinite(scores[i]):
            return None
        out.append(float(scores[i]))
    return out[0], out[1]


# --- the decode model -------------------------------------------------------------------------


def model_decode_effect(
    decisions: Sequence[Decision],
    profiles: dict[str, DecodeProfile],
    before: Sequence[str],
    after: Sequence[str],
    cost: CostProfile | None,
    sample_s: float | None = None,
) -> ModelledEffect:
    """Expected expert union per step and modelled TPOT, before and after (module doc)."""
    notes: list[str] = []
    items = [
        (i, d, profiles[d.request_id])
        for i, d in enumerate(decisions)
        if d.request_id in profiles
        and profiles[d.request_id].tokens > 0
        and profiles[d.request_id].ts_s > d.ts_s
    ]
    shapes = Counter(tuple(p.counts.shape) for _, _, p in items)
    if len(shapes) > 1:
        shape, _ = shapes.most_common(1)[0]
        notes.append(f"profiles of {len(shapes)} geometries: only {shape[0]}x{shape[1]} modelled")
        items = [x for x in items if tuple(x[2].counts.shape) == shape]
    if not items:
        empty = BatchSummary(0.0, 0.0, None, None, None)
        return ModelledEffect(len(decisions), 0, 0.0, 0, 0, 0, None, empty, empty, None, notes)
    n_layers, n_experts = items[0][2].counts.shape
    starts = np.array([d.ts_s for _, d, _ in items])
    ends = np.array([p.ts_s for _, _, p in items])
    prompts = np.array([d.prompt_tokens or 0 for _, d, _ in items], dtype=np.float64)
    tokens = np.array([p.tokens for _, _, p in items], dtype=np.float64)
    cells: list[np.ndarray] = []
    logq: list[np.ndarray] = []
    for _, _, p in items:
        prob = np.minimum(p.counts.values().astype(np.float64) / p.tokens, 1.0)
        with np.errstate(divide="ignore"):
            logq.append(np.log1p(-prob))
        cells.append(p.counts.indices().astype(np.int64))
    span = float(ends.max() - starts.min())
    durations = ends - starts
    if sample_s is None:
        sample_s = max(min(span / 500.0, float(np.median(durations)) / 8.0), 1e-4)
    sample_s = max(sample_s, span / MAX_SAMPLES)
    grid = starts.min() + (np.arange(max(math.ceil(span / sample_s), 1)) + 0.5) * sample_s
    if cost is not None and (
        cost.model.num_moe_layers != n_layers or cost.model.num_experts != n_experts
    ):
        notes.append(
            f"cost profile {cost.name} is for {cost.model.num_moe_layers}x"
            f"{cost.model.num_experts} experts, the profiles have {n_layers}x{n_experts}: "
            "unions are counted in the profiles' geometry, bytes per expert are the profile's"
        )
    sides = []
    for assignment in (before, after):
        workers = [assignment[i] for i, _, _ in items]
        names = sorted(set(workers))
        worker_of = np.array([names.index(w) for w in workers], dtype=np.int64)
        sides.append(
            _model_side(
                worker_of,
                starts,
                ends,
                prompts,
                tokens,
                cells,
                logq,
                n_layers * n_experts,
                n_layers,
                grid,
                cost,
            )
        )
    measured = [p.tpot_s for _, _, p in items if p.tpot_s is not None]
    return ModelledEffect(
        requests=len(decisions),
        profiled=len(items),
        sample_s=sample_s,
        samples=len(grid),
        num_moe_layers=n_layers,
        num_experts=n_experts,
        cost_profile=None if cost is None else cost.name,
        before=sides[0][0],
        after=sides[1][0],
        measured_tpot_p50_ms=float(np.median(measured) * 1e3) if measured else None,
        notes=notes,
        tpot_before_ms=sides[0][1],
        tpot_after_ms=sides[1][1],
    )


def _batch_union(
    members: np.ndarray, cells: list[np.ndarray], logq: list[np.ndarray], n_cells: int
) -> float:
    """Expected distinct (layer, expert) pairs a step of this batch streams."""
    idx = np.concatenate([cells[m] for m in members])
    weights = np.concatenate([logq[m] for m in members])
    log_none = np.bincount(idx, weights=weights, minlength=n_cells)
    return expected_union(log_none)  # cells no member touches add 1 - e^0 = 0


def _model_side(
    worker_of: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    prompts: np.ndarray,
    tokens: np.ndarray,
    cells: list[np.ndarray],
    logq: list[np.ndarray],
    n_cells: int,
    n_layers: int,
    grid: np.ndarray,
    cost: CostProfile | None,
) -> tuple[BatchSummary, np.ndarray | None]:
    n = len(starts)
    step_sum = np.zeros(n)
    step_n = np.zeros(n, dtype=np.int64)
    unions: list[float] = []
    batches: list[int] = []

    def step(members: np.ndarray, t: float) -> float:
        union = _batch_union(members, cells, logq, n_cells)
        unions.append(union / n_layers)
        batches.append(len(members))
        if cost is None:
            return 0.0
        frac = np.clip((t - starts[members]) / (ends[members] - starts[members]), 0.0, 1.0)
        kv = float(np.sum(prompts[members] + tokens[members] * frac))
        return cost.step_time_s(union, kv, len(members))

    for t in grid:
        live = np.flatnonzero((starts <= t) & (t < ends))
        if live.size == 0:
            continue
        for w in np.unique(worker_of[live]):
            members = live[worker_of[live] == w]
            s = step(members, float(t))
            step_sum[members] += s
            step_n[members] += 1
    unsampled = np.flatnonzero(step_n == 0)
    for r in unsampled:  # shorter than a sampling step: sample its midpoint
        t = 0.5 * (starts[r] + ends[r])
        members = np.flatnonzero((starts <= t) & (t < ends) & (worker_of == worker_of[r]))
        step_sum[r] += step(members, float(t))
        step_n[r] += 1
    tpot_ms = None
    summary_tpot: tuple[float | None, float | None, float | None] = (None, None, None)
    if cost is not None:
        tpot_ms = step_sum / step_n * 1e3
        summary_tpot = (
            float(np.mean(tpot_ms)),
            float(np.percentile(tpot_ms, 50)),
            float(np.percentile(tpot_ms, 95)),
        )
    return (
        BatchSummary(
            expert_union_per_layer=float(np.mean(unions)) if unions else 0.0,
            batch_mean=float(np.mean(batches)) if batches else 0.0,
            tpot_mean_ms=summary_tpot[0],
            tpot_p50_ms=summary_tpot[1],
            tpot_p95_ms=summary_tpot[2],
        ),
        tpot_ms,
    )
