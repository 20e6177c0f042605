"""The routing decision, as a pure function of the router's state.

`RouterCore` holds what a router replica knows: the live load table, the active partition
and the routing profile's policy (`eldr.core.routing.profile`). `decide` turns one request
(its prefill expert counts, or the reason they are missing) into a `RouteOutcome`: the
chosen worker and everything needed to explain and replay the choice (candidate scores, the
band, the loads seen, any fallback, what the policy computed).

One assembly: `decide_view` builds the `FleetView`, picks the policy or its load-only
fallback and calls `Policy.choose`; `route` adds what a router knows of the request (its
partition scores, its predicted demand) and is what `RouterCore.decide` runs. The simulator,
the trainer's shadow gate (`eldr.core.training.online.shadow_assignment`), replay and explain
decide through the same two functions. The profile says everything a decision depends on
(the load measure, the band width the centroid index keeps exact, the demand model); no
parameter travels beside it.

Fallback: a locality policy that cannot score the request (no partition yet, no signature,
a partition for another model, a signature of another geometry, no live worker in the
partition) routes with the best load-only policy, JSQ on the same load measure, and says
why in `fallback`.

Elastic pools: only live workers are candidates, so a departed worker's centroid is never
chosen (its cluster's requests go to the best-scoring live workers), and a live worker the
partition has no centroid for is marked in `FleetView.has_centroid`, so the band rule can
give it traffic until the trainer refits for the new worker set.

Cost-aware policies (`Policy.uses_activity`, e.g. "eldr_cost") also see, per worker, the
experts its in-flight requests are predicted to activate (`RouterCore.activity`, fed by
`note_assignment` for every replica's decisions and `note_finished` for the gateway's
finish events and decode summaries); `route` takes that view as `expert_miss`. The table
is bounded per worker by what the load table says is in flight there
(`bound_activity`), so a finish that is never seen cannot make an entry live forever.

Replay: `route` is the whole decision as a pure function of its inputs (live workers and
their loads, the partition, the request, the policy and a generator). `RouterCore.decide`
reads those inputs from the load table and draws a fresh 63-bit seed per decision for the
generator (`DecisionRng`); the seed goes into the decision record, so a replay that feeds
the recorded inputs to `route` re-creates every tie-break and random draw exactly, in
whatever order the decisions are replayed (`eldr.replay.reproduction`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from eldr.core.limits import GeometryLimits
from eldr.core.partition.partition import Partition, geometry_problem
from eldr.core.routing.activity import (
    DEFAULT_MAX_ENTRIES,
    DEFAULT_TTL_S,
    ActivityInput,
    ActivityTable,
    Cells,
    ExpertDemand,
    cells_of,
    demand_from_cells,
)
from eldr.core.routing.loadtable import LoadTable
from eldr.core.routing.pipeline import Choice, FleetView, PipelinePolicy, Policy, make_policy
from eldr.core.routing.profile import LoadMeasure, NearestCentroids, ProfileBase

FALLBACK_REASONS = (
    "no_partition",
    "model_mismatch",
    "geometry_mismatch",
    "no_signature",
    "signature_timeout",
    "signature_unavailable",
    "signature_error",
    "empty_signature",
    "no_live_worker_in_partition",
    "no_centroid",
    "no_capture",
)
"""Every value `RouteOutcome.fallback` can take (a bounded metric label)."""

SIGNATURE_FALLBACKS = (
    "no_capture",
    "no_signature",
    "signature_timeout",
    "signature_unavailable",
    "signature_error",
    "empty_signature",
)
"""Fallback reasons that come from fetching the signature (`RouteRequest.signature_error`)."""

SEED_LIMIT = 1 << 63
"""Per-decision seeds are drawn from [0, SEED_LIMIT) (fits a signed 64-bit column)."""

DEMAND_CACHE = 4096
"""Most demands kept between a decision and the note of its assignment."""


class NoLiveWorkersError(RuntimeError):
    """No decode worker is live: the request must wait (it is retried, never dropped)."""


@dataclass(frozen=True)
class RouteRequest:
    """One request to route.

    counts: the request's prefill expert counts [L, E] (None if the signature service did not
    provide them; `signature_error` then says why: one of the FALLBACK_REASONS).
    """

    request_id: str
    model: str
    prompt_tokens: int
    counts: np.ndarray | None = None
    missing_blocks: int = 0
    signature_error: str | None = None

    def cells(self) -> Cells | None:
        """The non-zero cells of `counts` (`cells_of`), extracted once per request (its
        demand and its signature read them); None without counts."""
        cached: Cells | None = self.__dict__.get("_cells")
        if cached is None and self.counts is not None:
            cached = cells_of(self.counts)
            object.__setattr__(self, "_cells", cached)
        return cached


class Considered(NamedTuple):
    """What a decision read of one candidate: its loads, its partition score (None: no
    centroid) and, for the candidates that reached the marginal-union scorer, its predicted
    expert union per step (U) and what the request adds to it (dU)."""

    worker: str
    in_flight: int
    kv_tokens: int
    score: float | None = None
    union: float | None = None
    added: float | None = None


@dataclass(frozen=True)
class RouteOutcome:
    worker_id: str
    profile: ProfileBase
    """The profile the decision routed with (its policy's, not the load-only fallback's)."""
    partition_version: int | None
    fallback: str | None
    scores: tuple[tuple[str, float], ...]
    band: tuple[str, ...]
    loads: tuple[tuple[str, float], ...]
    """The policy's load measure of every live worker."""
    fleet: tuple[tuple[str, int, int], ...] = ()
    """Every live worker as (id, in-flight requests, KV tokens): both load measures."""
    rng_seed: int | None = None
    """Seed of the decision's generator (`DecisionRng.seeded`); None when the caller
    passed its own generator."""
    choice: Choice | None = None
    """What the policy (or the load-only fallback) computed, indices into the live
    workers (`fleet` order): the band and how the band rule built it, the workers tied
    for the least load, the cost-aware policy's costs. `eldr explain` reports it."""
    considered: tuple[Considered, ...] = ()
    """What the decision read of each candidate, in live-worker order, where the fleet
    and the partition do not say it all: the candidates of a fleet-scale profile (whose
    decision reads no other worker, so `fleet` and `loads` are empty) and the activity
    terms of the marginal-union scorer. A replay re-runs the stages on exactly these."""
    live_workers: int = 0
    """Live workers when the decision was made (with `considered` and no `fleet`)."""
    fleet_totals: tuple[int, int] = (0, 0)
    """(in-flight requests, KV tokens) summed over the live fleet: its means are what a
    load ceiling compares a candidate with (with `considered` and no `fleet`)."""

    @property
    def policy(self) -> str:
        return self.profile.name


@dataclass(frozen=True)
class Decided:
    """One decision on a fleet view (`decide_view`): the view, the choice, why it fell
    back (None: it did not)."""

    view: FleetView
    choice: Choice
    fallback: str | None

    @property
    def index(self) -> int:
        return self.choice.index


class DecisionRng:
    """Hands out one generator per decision, seeded by the decision's recorded seed.

    Every decision draws (tie-breaks, random choices, P2C pairs) from a generator seeded
    by its own seed, so replaying decisions in any order re-creates their draws. The
    generator is one PCG64 re-seeded by setting its state (state = seed, a fixed odd
    increment): about 1 us, against about 9 us for building a seeded Generator, on the
    request path. Not thread-safe; the returned generator is valid until the next call.
    """

    INCREMENT = 0x5851F42D4C957F2D_14057B7EF767814F
    """Odd 128-bit PCG increment (a fixed constant: part of the replay contract)."""

    def __init__(self) -> None:
        self._bits = np.random.PCG64(0)
        self._generator = np.random.Generator(self._bits)

    def seeded(self, seed: int) -> np.random.Generator:
        if not 0 <= seed < SEED_LIMIT:
            raise ValueError(f"a decision seed must be in [0, 2**63), got {seed}")
        self._bits.state = {
            "bit_generator": "PCG64",
            "state": {"state": seed, "inc": self.INCREMENT},
            "has_uint32": 0,
            "uinteger": 0,
        }
        return self._generator


def locality_scores(
    partition: Partition | None,
    req: RouteRequest,
    live: tuple[str, ...],
    tau: float | None,
    nearest: int | None = None,
) -> tuple[np.ndarray | None, str | None]:
    """Locality scores of the live workers, or the reason there are none (`tau`: the band
    an approximate centroid index must keep exact; None: no band). `nearest`: score only the
    owners of that many centroids nearest the request (the index's search; every other
    worker -inf), for profiles whose candidates are those (`NearestCentroids`)."""
    if partition is None:
        return None, "no_partition"
    if partition.model != req.model:
        return None, "model_mismatch"
    if req.counts is None:
        return None, req.signature_error or "no_signature"
    cal = partition.calibration
    if req.counts.size != cal.num_moe_layers * cal.num_experts:
        return None, "geometry_mismatch"
    cells = req.cells()
    if cells is None or not cells[0].size:
        return None, "empty_signature"
    if nearest is not None:
        scores = partition.nearest_for(req.counts, live, nearest, cells[:2])
    else:
        scores = partition.scores_for(req.counts, live, tau=tau)
    if not np.isfinite(scores).any():
        return None, "no_live_worker_in_partition"
    return scores, None


def request_demand(profile: ProfileBase, req: RouteRequest) -> ExpertDemand | None:
    """The request's predicted per-step expert activation under `profile`'s demand model
    (top-k, prior), or None without usable counts."""
    counts = req.counts
    if counts is None or counts.ndim != 2 or counts.size == 0:
        return None
    top_k, prior = profile.demand_model
    cells = req.cells()
    assert cells is not None
    return demand_from_cells(
        counts.shape, cells, req.prompt_tokens, top_k=top_k, prior_tokens=prior
    )


def has_centroid(partition: Partition | None, workers: tuple[str, ...]) -> np.ndarray | None:
    """Which of `workers` own a centroid in `partition` (None: no partition, or all do)."""
    if partition is None:
        return None
    mask = partition.slots_of(workers) >= 0
    return None if mask.all() else mask


def activity_for(
    policy: Policy, table: ActivityTable | None, workers: tuple[str, ...]
) -> ActivityInput | None:
    """What `policy` reads of `table` for a decision over `workers`: nothing for a policy
    that reads no activity, a reader of the few workers it scores for a fleet-scale one, a
    view of every worker otherwise."""
    if table is None or not policy.uses_activity:
        return None
    if isinstance(policy, PipelinePolicy) and policy.fleet_scale:
        return table.reader(workers)
    return table.view(workers)


def decide_view(
    policy: Policy,
    *,
    workers: tuple[str, ...],
    in_flight: np.ndarray,
    kv_tokens: np.ndarray,
    rng: np.random.Generator,
    scores: np.ndarray | None = None,
    has_centroid: np.ndarray | None = None,
    expert_miss: ActivityInput | None = None,
    demand: ExpertDemand | None = None,
    fallback: str | None = None,
    mean_loads: tuple[float, float] | None = None,
) -> Decided:
    """The one assembly of a decision around `Policy.choose`: build the fleet view, pick
    the policy or its load-only fallback, choose. The router (`route`), the simulator,
    the shadow gate, replay and explain all decide through it.

    scores: the live workers' partition scores (None: none; a locality policy then routes
    with JSQ on its load measure, and `fallback` says why, "no_signature" if not given);
    has_centroid: which of them own a centroid (None: all, or no scores); demand: the
    request's per-step expert activation (`request_demand`), expert_miss the workers'
    idle probabilities (`ActivityTable.view`), both for policies that use worker
    activity (a table of another geometry is ignored). fallback: a reason the
    caller already knows (the signature's, the partition's); else the policy's own.
    """
    if demand is None or (
        expert_miss is not None and expert_miss.shape != (demand.num_moe_layers, demand.num_experts)
    ):
        expert_miss = None  # nothing to weigh, or the table holds another model's geometry
    view = FleetView(
        workers=workers,
        in_flight=in_flight,
        kv_tokens=kv_tokens,
        scores=scores,
        has_centroid=None if scores is None else has_centroid,
        expert_miss=expert_miss,
        demand=demand,
        mean_loads=mean_loads,
    )
    choice = policy.choose(view, rng)
    return Decided(view, choice, fallback or choice.fallback)


def route(
    req: RouteRequest,
    *,
    policy: Policy,
    partition: Partition | None,
    workers: tuple[str, ...],
    in_flight: np.ndarray,
    kv_tokens: np.ndarray,
    rng: np.random.Generator,
    rng_seed: int | None = None,
    max_scores: int = 8,
    expert_miss: ActivityInput | None = None,
    demand: ExpertDemand | None = None,
    scores: np.ndarray | None = None,
    mean_loads: tuple[float, float] | None = None,
) -> RouteOutcome:
    """The decision for `req` given the router's inputs (pure apart from `policy`'s own
    state, the round-robin cursor).

    workers: the live workers (non-empty); in_flight / kv_tokens: their loads, aligned.
    The policy's profile says everything else: whether to score the request against the
    partition (its band width goes to the centroid index, which may skip workers
    certainly outside the band; a fleet-scale profile scores only the owners of the
    centroids nearest the request), its load measure, its demand model. A locality policy
    that cannot score the request routes with JSQ on its load measure and says why in
    `fallback`. expert_miss: for policies that use worker activity,
    `ActivityTable.view(workers)` at decision time (None: not tracked); demand:
    `request_demand(policy.profile, req)` if the caller has it already. scores and
    mean_loads: what a replay of a recorded decision gives instead of the partition and
    the whole fleet (the record's candidates and the fleet's means).
    """
    profile = policy.profile
    fleet_scale = isinstance(policy, PipelinePolicy) and policy.fleet_scale
    fallback: str | None = None
    if scores is None and policy.wants_scores:
        k = None
        if isinstance(policy, PipelinePolicy) and isinstance(
            policy.spec.candidates, NearestCentroids
        ):
            k = policy.spec.candidates.k
        tau = policy.band_tau if isinstance(policy, PipelinePolicy) else profile.band_tau
        scores, reason = locality_scores(partition, req, workers, tau, k)
        if policy.uses_signature and scores is None:
            fallback = reason
    activation: ExpertDemand | None = None
    if policy.uses_activity:
        expert = demand if demand is not None else request_demand(profile, req)
        if expert is None:
            fallback = req.signature_error or (
                "no_signature" if req.counts is None else "empty_signature"
            )
        else:
            activation = expert
    decided = decide_view(
        policy,
        workers=workers,
        in_flight=in_flight,
        kv_tokens=kv_tokens,
        rng=rng,
        scores=scores,
        has_centroid=None if scores is None else has_centroid(partition, workers),
        expert_miss=expert_miss,
        demand=activation,
        fallback=fallback,
        mean_loads=mean_loads,
    )
    choice = decided.choice
    ranked: tuple[tuple[str, float], ...] = ()
    if scores is not None:
        finite = np.flatnonzero(np.isfinite(scores))
        order = finite[np.argsort(-scores[finite], kind="stable")][:max_scores]
        ranked = tuple((workers[i], float(scores[i])) for i in order)
    considered: tuple[Considered, ...] = ()
    whole_fleet = not (fleet_scale and choice.candidates)
    if choice.candidates and (fleet_scale or policy.uses_activity):
        considered = _considered(choice, workers, in_flight, kv_tokens, scores)
    if whole_fleet:
        load = decided.view.load(profile.measure)
        # tolist() and zip: Python numbers without a generator per worker (~10 us less).
        loads = tuple(zip(workers, map(float, load.tolist()), strict=True))
        fleet = tuple(zip(workers, in_flight.tolist(), kv_tokens.tolist(), strict=True))
        totals = (0, 0)
    else:
        loads, fleet = (), ()
        totals = (int(in_flight.sum()), int(kv_tokens.sum()))
    return RouteOutcome(
        worker_id=workers[choice.index],
        profile=profile,
        partition_version=(
            partition.version if partition is not None and policy.wants_scores else None
        ),
        fallback=decided.fallback,
        scores=ranked,
        band=tuple(workers[i] for i in choice.band),
        loads=loads,
        fleet=fleet,
        rng_seed=rng_seed,
        choice=choice,
        considered=considered,
        live_workers=len(workers) if considered and not whole_fleet else 0,
        fleet_totals=totals,
    )


def _considered(
    choice: Choice,
    workers: tuple[str, ...],
    in_flight: np.ndarray,
    kv_tokens: np.ndarray,
    scores: np.ndarray | None,
) -> tuple[Considered, ...]:
    """The candidates' rows of a decision, in live-worker order (both index lists are
    ascending, so the scored ones are found by a search, not a dict per decision)."""
    cand = np.asarray(choice.candidates, dtype=np.int64)
    n = cand.size
    none: list[float | None] = [None] * n
    score_of = none
    if scores is not None:
        at = scores[cand]
        score_of = [s if s != -np.inf else None for s in at.tolist()]
    union_of, added_of = none, none
    if choice.activity is not None and choice.scored:
        pos = np.searchsorted(cand, np.asarray(choice.scored, dtype=np.int64))
        union_of, added_of = list(none), list(none)
        for p, u, a in zip(
            pos.tolist(), choice.activity[0].tolist(), choice.activity[1].tolist(), strict=True
        ):
            union_of[p], added_of[p] = u, a
    names = [workers[i] for i in choice.candidates]
    # Plain tuples in `Considered`'s field order (a named tuple each costs a microsecond).
    rows: tuple[Considered, ...] = tuple(
        zip(  # type: ignore[arg-type]
            names,
            in_flight[cand].tolist(),
            kv_tokens[cand].tolist(),
            score_of,
            union_of,
            added_of,
            strict=True,
        )
    )
    return rows


class RouterCore:
    """One router replica's state (load table, partition, policy) and its decisions.

    `rng` only draws each decision's seed; the decision itself draws from a generator
    seeded by that seed (`DecisionRng`), recorded as `RouteOutcome.rng_seed`.
    """

    def __init__(
        self,
        profile: ProfileBase,
        table: LoadTable,
        rng: np.random.Generator,
        max_scores: int = 8,
        activity_ttl_s: float = DEFAULT_TTL_S,
        activity_slack: int = 4,
        activity_max_entries: int = DEFAULT_MAX_ENTRIES,
        limits: GeometryLimits | None = None,
    ) -> None:
        if activity_slack < 0:
            raise ValueError(f"activity_slack must be >= 0, got {activity_slack}")
        self.limits = limits or GeometryLimits()
        """The geometries this router accepts counts of (beyond its partition's)."""
        self.table = table
        self.rng = rng
        self.max_scores = max_scores
        self.activity = ActivityTable(ttl_s=activity_ttl_s, max_entries=activity_max_entries)
        """Per worker, the experts its in-flight requests are predicted to activate."""
        self.activity_slack = activity_slack
        """Entries a worker may hold beyond its in-flight count (timing between a finish
        event, a load report and a decision echo)."""
        self._decided_demands: OrderedDict[str, ExpertDemand | None] = OrderedDict()
        """Demands `decide` computed, by request id, taken back when the assignment is
        noted (decisions are awaited concurrently: several can be between the two). The
        oldest are dropped beyond `DEMAND_CACHE` (a decision that was never published)."""
        self.partition: Partition | None = None
        self.policy: Policy = make_policy(profile)
        self._decision_rng = DecisionRng()

    @property
    def profile(self) -> ProfileBase:
        """The profile this replica routes with."""
        return self.policy.profile

    def set_profile(self, profile: ProfileBase) -> None:
        """Route with `profile` from now on (validated first: a bad one leaves the old
        policy in place)."""
        self.policy = make_policy(profile)

    def set_partition(self, partition: Partition | None) -> None:
        """Route with `partition` from now on; the activity table takes its geometry (a
        partition of another geometry starts it afresh)."""
        self.partition = partition
        if partition is not None:
            cal = partition.calibration
            self.activity.set_shape((cal.num_moe_layers, cal.num_experts))

    def geometry_problem(self, model: str, n_layers: int, n_experts: int) -> str | None:
        """Why counts of `model` shaped `n_layers` x `n_experts` are not this router's to
        use, or None (`geometry_problem`: the active partition's, else `limits`)."""
        return geometry_problem(self.partition, self.limits, model, n_layers, n_experts)

    @property
    def load_measure(self) -> LoadMeasure:
        return self.profile.measure

    def note_assignment(
        self,
        worker_id: str,
        request_id: str,
        counts: np.ndarray | None,
        prompt_tokens: int,
        now_s: float,
    ) -> None:
        """A decision (any replica's) sent a request to a worker: count its experts there.
        A request already counted (this replica's own decision, seen again on the
        decisions stream) is left as it is."""
        if request_id in self.activity or self.table.was_finished(request_id):
            self._decided_demands.pop(request_id, None)
            return
        if request_id in self._decided_demands:
            demand = self._decided_demands.pop(request_id)
        else:
            demand = request_demand(
                self.profile, RouteRequest(request_id, "", prompt_tokens, counts=counts)
            )
        if demand is not None:
            self.activity.add(worker_id, request_id, demand, now_s)
            self.bound_activity(worker_id)

    def reserve(
        self,
        worker_id: str,
        request_id: str,
        counts: np.ndarray | None,
        prompt_tokens: int,
        now_s: float,
    ) -> None:
        """Count this replica's decision against its worker at decision time, before its
        commit: the next decision, whether or not this one's commit has been acknowledged
        yet, sees the load and the experts it adds (deciding several requests while their
        commits are in flight would otherwise put them all on the same least-loaded
        worker). `release` takes it back if the commit does not stand."""
        self.table.on_assignment(worker_id, request_id, prompt_tokens, now_s)
        if self.policy.uses_activity:
            self.note_assignment(worker_id, request_id, counts, prompt_tokens, now_s)

    def release(self, worker_id: str, request_id: str) -> None:
        """A reserved decision was not committed (another record for the request won, or
        the commit failed): it leaves the load and activity tables again (it is not a
        finish: a later decision of the request counts as usual)."""
        self.table.cancel_assignment(worker_id, request_id)
        if self.activity.worker_of(request_id) == worker_id:
            self.activity.finish(request_id)
        self._decided_demands.pop(request_id, None)

    def note_finished(self, request_id: str, now_s: float) -> bool:
        """A request left its decode worker (finish event or decode summary): it no
        longer loads that worker's steps or queue. True if it was tracked anywhere."""
        pending = self.table.on_finished(request_id, now_s)
        active = self.activity.finish(request_id)
        self._decided_demands.pop(request_id, None)
        return pending or active

    def note_moved(self, request_id: str, worker_id: str, now_s: float) -> bool:
        """The request went to `worker_id` instead (the gateway retried before it
        started): it leaves its first worker's tables at once. True if it was tracked."""
        self.table.on_moved(request_id, worker_id, now_s)
        moved = self.activity.move(request_id, worker_id)
        if moved:
            self.bound_activity(worker_id)
        return moved

    def activity_limit(self, worker_id: str) -> int | None:
        """Most activity entries `worker_id` may hold: its in-flight requests (last report
        plus pending assignments) plus `activity_slack`. None for a worker not in the load
        table (not reported yet, e.g. just after this replica started: its entries are
        bounded by the TTL and the table's size, and leave with the worker)."""
        in_flight = self.table.in_flight(worker_id)
        return None if in_flight is None else in_flight + self.activity_slack

    def bound_activity(self, worker_id: str) -> int:
        """Evict `worker_id`'s oldest activity entries beyond `activity_limit`; returns
        how many (requests whose finish this replica never saw)."""
        limit = self.activity_limit(worker_id)
        return 0 if limit is None else self.activity.evict_over(worker_id, limit)

    def decide(self, req: RouteRequest, now_s: float) -> RouteOutcome:
        live = self.table.live_workers(now_s)
        if not live:
            raise NoLiveWorkersError("no live decode worker in the load table")
        in_flight, kv = self.table.loads(live)
        seed = int(self.rng.integers(SEED_LIMIT))
        demand: ExpertDemand | None = None
        miss: ActivityInput | None = None
        if self.policy.uses_activity:
            demand = request_demand(self.profile, req)
            self._decided_demands[req.request_id] = demand
            while len(self._decided_demands) > DEMAND_CACHE:
                self._decided_demands.popitem(last=False)
            miss = activity_for(self.policy, self.activity, live)
        return route(
            req,
            policy=self.policy,
            partition=self.partition,
            workers=live,
            in_flight=in_flight,
            kv_tokens=kv,
            rng=self._decision_rng.seeded(seed),
            rng_seed=seed,
            max_scores=self.max_scores,
            expert_miss=miss,
            demand=demand,
        )
