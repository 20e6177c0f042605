"""Routing policies: pick a decode worker for a request after its prefill.

Every policy implements one interface, `Policy.choose(view, rng) -> Choice`, over a
`FleetView`: the candidate workers (live ones only), their loads, and, for locality-aware
policies, each worker's similarity to the request's signature. A policy is built from its
profile (`eldr.core.routing.profile`: the parameters, typed, each default written there) by
`make_policy`, through `POLICIES`, which maps each profile type to its policy class.
Policies are pure apart from their own small state (the round-robin cursor); randomness
comes in as a Generator, so a run is deterministic for a seed. A `Choice` says what the
policy computed (its band and how the band rule built it, the workers tied for the least
load, the cost-aware policy's costs), so that explain reports it instead of re-deriving it.

The ELDR rule (paper section "locality-band routing", artifact `locality_band`, policy
"eldr"): scores = cosine(signature, centroid of each worker); band = {i : scores[i] >= max -
tau}; when tau > 0 and the band has a single member, widen it to the two best scores; pick
the least-loaded band member (ties broken at random). Live workers without a centroid
(joined since the partition was fitted) join the band while they are less loaded than
every band member, so a new worker gets traffic before the next refit.

Beyond the paper (docs/ONLINE.md):

- "eldr_bounded": the band rule over the workers whose load is at most (1 + slack) x the
  fleet's mean (+1), so locality can never pile load on one worker beyond that bound.
- "eldr_cost" (the default): cost-model-aware. For each worker it predicts, from the
  experts its in-flight requests are likely to activate (`eldr.core.routing.activity`), what
  the request would add to the worker's per-step expert union (dU) and what its batch's
  union is now (U); a step costs a fixed part plus a term proportional to U, so sending the
  request there costs the fleet U + (n + 1) dU expert loads per step (its own steps, and
  n requests already there slowed by dU). It picks the cheapest worker. No partition
  needed; with `locality_weight` > 0 the partition's cosine score is a bonus.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from eldr.core.routing.activity import ActivityView, ExpertDemand
from eldr.core.routing.profile import (
    EldrBoundedProfile,
    EldrCostProfile,
    EldrProfile,
    JsqProfile,
    LoadMeasure,
    OracleProfile,
    P2cProfile,
    ProfileBase,
    RandomProfile,
    RoundRobinProfile,
    validated,
)


@dataclass(frozen=True)
class FleetView:
    """What a policy may look at for one decision.

    workers: candidate worker ids (live workers), index i describes workers[i].
    in_flight: requests per worker; kv_tokens: KV tokens per worker.
    scores: cosine similarity of the request's signature to each worker's partition
    centroid (-inf where a worker has none), or None when no signature or partition exists.
    has_centroid: bool per worker, whether the partition gives it a centroid (None: no
    partition, or every worker has one).
    expert_miss: per worker the predicted probability that each (MoE layer, expert) is idle
    in its next decode step, given its in-flight requests (`ActivityTable.view`, read at
    the request's non-zero cells only); None when not tracked.
    demand: the request's predicted per-step activation of each (MoE layer, expert)
    (`eldr.core.routing.activity.expert_demand`, sparse); None without a signature.
    """

    workers: tuple[str, ...]
    in_flight: np.ndarray
    kv_tokens: np.ndarray
    scores: np.ndarray | None = None
    has_centroid: np.ndarray | None = None
    expert_miss: ActivityView | None = None
    demand: ExpertDemand | None = None

    def __post_init__(self) -> None:
        n = len(self.workers)
        if n == 0:
            raise ValueError("a fleet view needs at least one worker")
        for name in ("in_flight", "kv_tokens"):
            arr = getattr(self, name)
            if arr.shape != (n,):
                raise ValueError(f"{name} has shape {arr.shape}, expected ({n},)")
        if self.scores is not None and self.scores.shape != (n,):
            raise ValueError(f"scores has shape {self.scores.shape}, expected ({n},)")
        if self.has_centroid is not None and self.has_centroid.shape != (n,):
            raise ValueError(f"has_centroid has shape {self.has_centroid.shape}, expected ({n},)")
        if self.expert_miss is not None:
            if len(self.expert_miss) != n:
                raise ValueError(f"expert_miss has {len(self.expert_miss)} rows, expected {n}")
            demand = self.demand
            if demand is not None and self.expert_miss.shape != (
                demand.num_moe_layers,
                demand.num_experts,
            ):
                raise ValueError(
                    f"expert_miss is {self.expert_miss.shape}, the demand "
                    f"{demand.num_moe_layers} x {demand.num_experts}"
                )

    def load(self, measure: LoadMeasure) -> np.ndarray:
        if measure == "requests":
            return self.in_flight
        if measure == "kv_tokens":
            return self.kv_tokens
        raise ValueError(f"unknown load measure {measure!r}")


@dataclass(frozen=True)
class BandTrace:
    """How the band rule built a decision's band (indices into `FleetView.workers`)."""

    best: int
    """The best-scoring eligible worker."""
    best_score: float
    tau: float
    within: tuple[int, ...]
    """The scored workers within tau of the best (the band before widening)."""
    widened_to: int
    """Members the band was widened to (0: it was not widened)."""
    newcomers: tuple[int, ...] = ()
    """Members without a centroid, in the band for being less loaded than all of it."""
    bound: float | None = None
    """eldr_bounded: the load at most a worker may carry to be eligible."""
    over_bound: tuple[int, ...] = ()
    """eldr_bounded: the scored workers above the bound (not eligible)."""


@dataclass(frozen=True)
class Choice:
    """A policy's answer: the chosen index into FleetView.workers, and why."""

    index: int
    band: tuple[int, ...] = ()
    fallback: str | None = None
    tied: tuple[int, ...] = ()
    """The candidates tied for the least load (the cost-aware policy: the least cost);
    several: the decision's draw picked `index`. Empty for round-robin and random."""
    rule: BandTrace | None = None
    costs: np.ndarray | None = None
    """The cost-aware policy's predicted fleet cost per worker (expert loads per step)."""


def least_loaded(
    values: np.ndarray, candidates: np.ndarray, rng: np.random.Generator
) -> tuple[int, np.ndarray]:
    """(index into the full array of the smallest value among candidates, random tie-break;
    the tied candidates)."""
    cand_values = values[candidates]
    best = cand_values.min()
    ties = candidates[cand_values == best]
    if ties.size == 1:
        return int(ties[0]), ties
    return int(ties[rng.integers(ties.size)]), ties


def _pick(
    values: np.ndarray,
    candidates: np.ndarray,
    rng: np.random.Generator,
    *,
    band: np.ndarray | None = None,
    fallback: str | None = None,
    rule: BandTrace | None = None,
) -> Choice:
    idx, ties = least_loaded(values, candidates, rng)
    return Choice(
        index=idx,
        band=() if band is None else tuple(band.tolist()),
        fallback=fallback,
        tied=tuple(ties.tolist()),
        rule=rule,
    )


def _band(scores: np.ndarray, tau: float, widen_to: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(band, the members within tau before widening, best index); empty without a finite
    score (best -1)."""
    if tau < 0:
        raise ValueError(f"tau must be non-negative, got {tau}")
    finite = np.isfinite(scores)
    if not finite.any():
        empty = np.empty(0, dtype=np.int64)
        return empty, empty, -1
    best = scores[finite].max()
    within = np.flatnonzero(finite & (scores >= best - tau))
    band = within
    if tau > 0 and band.size == 1 and widen_to > 1:
        order = np.argsort(-np.where(finite, scores, -np.inf), kind="stable")
        band = np.sort(order[: min(widen_to, int(finite.sum()))])
    return band, within, int(within[np.argmax(scores[within])])


def locality_band(scores: np.ndarray, tau: float, widen_to: int = 2) -> np.ndarray:
    """Indices of workers whose score is within tau of the best (the ELDR band).

    Workers with score -inf (no centroid) are never in the band. When tau > 0 and only one
    worker qualifies, the band widens to the `widen_to` best-scoring workers, so a single
    dominant centroid cannot pin all of its traffic on one worker.
    """
    return _band(scores, tau, widen_to)[0]


def with_newcomers(band: np.ndarray, view: FleetView, loads: np.ndarray) -> np.ndarray:
    """The band plus the workers without a centroid that are less loaded than all of it.

    A worker that joined after the partition was fitted has no centroid, so no request
    would ever score it into a band; letting it in while it is the least loaded choice
    fills it up to the band's load level until a refit gives it a centroid.
    """
    if view.has_centroid is None or view.has_centroid.all() or band.size == 0:
        return band
    newcomers = np.flatnonzero(~view.has_centroid & (loads < loads[band].min()))
    if newcomers.size == 0:
        return band
    return np.union1d(band, newcomers)


class Policy(ABC):
    """A routing policy, built from its profile (`make_policy`). Subclasses set
    `profile_type` and implement `choose`; what a policy reads (partition scores, worker
    activity) is its profile's to say."""

    profile_type: ClassVar[type[ProfileBase]]
    profile: ProfileBase

    def __init__(self, profile: ProfileBase | None = None) -> None:
        """`profile` unchecked (`make_policy` validates it); None: the type's defaults."""
        if profile is None:
            profile = self.profile_type()
        if type(profile) is not self.profile_type:
            raise TypeError(
                f"{type(self).__name__} takes a {self.profile_type.__name__}, "
                f"not a {type(profile).__name__}"
            )
        self.profile = profile

    @property
    def name(self) -> str:
        return self.profile.name

    @property
    def uses_signature(self) -> bool:
        return self.profile.uses_signature

    @property
    def uses_activity(self) -> bool:
        return self.profile.uses_activity

    @property
    def wants_scores(self) -> bool:
        return self.profile.wants_scores

    @property
    def needs_signature(self) -> bool:
        return self.profile.needs_signature

    @abstractmethod
    def choose(self, view: FleetView, rng: np.random.Generator) -> Choice: ...

    def resume_after(self, worker_id: str, workers: tuple[str, ...]) -> None:
        """Continue as if `worker_id` had just been chosen among `workers` (a replay that
        starts in the middle of a router's decisions); only stateful policies
        (`ProfileBase.stateful`) have anything to resume."""
        return None


class RoundRobin(Policy):
    profile_type = RoundRobinProfile

    def __init__(self, profile: ProfileBase | None = None) -> None:
        super().__init__(profile)
        self._cursor = 0
        self._next_id: str | None = None

    def choose(self, view: FleetView, rng: np.random.Generator) -> Choice:
        # Keep cycling by worker id so that workers joining or leaving do not reset the cycle.
        n = len(view.workers)
        if self._next_id is not None and self._next_id in view.workers:
            idx = view.workers.index(self._next_id)
        else:
            idx = self._cursor % n
        self._cursor = idx + 1
        self._next_id = view.workers[(idx + 1) % n]
        return Choice(index=idx)

    def resume_after(self, worker_id: str, workers: tuple[str, ...]) -> None:
        """Continue the cycle as if `worker_id` had just been chosen among `workers` (a
        replay that starts in the middle of a router's decisions)."""
        idx = workers.index(worker_id)
        self._cursor = idx + 1
        self._next_id = workers[(idx + 1) % len(workers)]


class RandomChoice(Policy):
    profile_type = RandomProfile

    def choose(self, view: FleetView, rng: np.random.Generator) -> Choice:
        return Choice(index=int(rng.integers(len(view.workers))))


class JoinShortestQueue(Policy):
    """Fewest in-flight (or KV tokens); ties broken at random."""

    profile_type = JsqProfile
    profile: JsqProfile

    def choose(self, view: FleetView, rng: np.random.Generator) -> Choice:
        loads = view.load(self.profile.load_measure)
        return _pick(loads, np.arange(len(view.workers)), rng)


class PowerOfTwoChoices(Policy):
    """Sample two distinct workers uniformly, take the less loaded."""

    profile_type = P2cProfile
    profile: P2cProfile

    def choose(self, view: FleetView, rng: np.random.Generator) -> Choice:
        n = len(view.workers)
        if n == 1:
            return Choice(index=0)
        pair = rng.choice(n, size=2, replace=False)
        loads = view.load(self.profile.load_measure)
        return _pick(loads, np.sort(pair), rng)


class LocalityBand(Policy):
    """ELDR: least-loaded worker among those whose centroid best matches the signature.

    Without scores (no signature or no partition) it falls back to JSQ on the same load
    measure and says so in `Choice.fallback`.
    """

    profile_type: ClassVar[type[ProfileBase]] = EldrProfile
    profile: EldrProfile

    def choose(self, view: FleetView, rng: np.random.Generator) -> Choice:
        p = self.profile
        loads = view.load(p.load_measure)
        all_idx = np.arange(len(view.workers))
        if view.scores is None:
            return _pick(loads, all_idx, rng, fallback="no_signature")
        band, within, best = _band(view.scores, p.tau, p.widen_to)
        if band.size == 0:
            return _pick(loads, all_idx, rng, fallback="no_centroid")
        return self._from_band(view, loads, band, within, best, rng)

    def _from_band(
        self,
        view: FleetView,
        loads: np.ndarray,
        band: np.ndarray,
        within: np.ndarray,
        best: int,
        rng: np.random.Generator,
        bound: float | None = None,
        over_bound: np.ndarray | None = None,
    ) -> Choice:
        assert view.scores is not None
        scored = band
        band = with_newcomers(band, view, loads)
        rule = BandTrace(
            best=best,
            best_score=float(view.scores[best]),
            tau=self.profile.tau,
            within=tuple(within.tolist()),
            widened_to=int(scored.size) if scored.size != within.size else 0,
            newcomers=tuple(np.setdiff1d(band, scored).tolist()) if band.size > scored.size else (),
            bound=bound,
            over_bound=() if over_bound is None else tuple(over_bound.tolist()),
        )
        return _pick(loads, band, rng, band=band, rule=rule)


class BoundedBand(LocalityBand):
    """The ELDR band over the workers whose load is within a bound of the fleet mean.

    Eligible workers: load <= (1 + slack) x mean load + 1 (the +1 lets an idle fleet
    take a first request anywhere). The band is taken over the eligible workers' scores,
    so a popular cluster spills to its next-best eligible neighbour instead of queueing.
    """

    profile_type = EldrBoundedProfile
    profile: EldrBoundedProfile

    def choose(self, view: FleetView, rng: np.random.Generator) -> Choice:
        if view.scores is None:
            return super().choose(view, rng)
        p = self.profile
        loads = view.load(p.load_measure)
        bound = (1.0 + p.slack) * float(loads.mean()) + 1.0
        eligible = loads <= bound
        scores = np.where(eligible, view.scores, -np.inf)
        if not np.isfinite(scores).any():
            # Every scored worker is over the bound: newcomers or the least loaded.
            return super().choose(view, rng)
        band, within, best = _band(scores, p.tau, p.widen_to)
        over = np.flatnonzero(~eligible & np.isfinite(view.scores))
        return self._from_band(view, loads, band, within, best, rng, bound, over)


class MarginalUnion(Policy):
    """Cost-model-aware locality: the worker where the request adds least step time.

    For worker i with n_i requests in flight, U_i = its predicted expert union per step
    (summed over MoE layers) and dU_i = what the request would add to it; a decode step
    costs a fixed part plus a part proportional to its union (docs/COST_MODEL.md), so
    adding the request costs the fleet U_i + dU_i (its own step) + n_i dU_i (the slowdown
    of the others), in expert loads per step. The fixed part is the same everywhere and
    drops out. Ties (e.g. several idle workers) are broken at random.

    With `locality_weight` > 0 and partition scores, cost_i -= locality_weight x score_i
    (workers without a centroid score 0). Without a signature (no demand) it routes by
    JSQ on `load_measure` and says so.
    """

    profile_type = EldrCostProfile
    profile: EldrCostProfile

    def costs(self, view: FleetView) -> np.ndarray:
        """Predicted fleet cost of sending the request to each worker (expert loads/step)."""
        if view.demand is None:
            raise ValueError("marginal-union costs need the request's demand")
        demand = view.demand
        if view.expert_miss is None:
            added = np.full(len(view.workers), demand.total)
            union = np.zeros(len(view.workers))
        else:
            union, added = view.expert_miss.marginal(demand)
        # union + (n + 1) dU, in place (float addition commutes exactly).
        added *= view.in_flight + 1.0
        cost = np.add(added, union, out=added)
        weight = self.profile.locality_weight
        if weight > 0 and view.scores is not None:
            bonus = np.where(np.isfinite(view.scores), view.scores, 0.0)
            cost = cost - weight * bonus
        return np.asarray(cost, dtype=np.float64)

    def choose(self, view: FleetView, rng: np.random.Generator) -> Choice:
        if view.demand is None:
            loads = view.load(self.profile.load_measure)
            return _pick(loads, np.arange(len(view.workers)), rng, fallback="no_signature")
        cost = self.costs(view)
        # Costs are sums of floats: treat near-equal ones as ties.
        best = float(cost.min())
        ties = np.flatnonzero(cost <= best + 1e-9 * max(1.0, abs(best)))
        idx = int(ties[0]) if ties.size == 1 else int(ties[rng.integers(ties.size)])
        return Choice(index=idx, tied=tuple(ties.tolist()), costs=cost)


class Oracle(LocalityBand):
    """The ELDR rule fed with the request's true decode signature (benchmark only).

    The policy itself is the locality band; what makes it an oracle is that the caller
    scores it with the decode-phase expert profile (`OracleProfile.scores_decode`), which
    no real router can know at routing time, against centroids fitted on decode profiles.
    """

    profile_type = OracleProfile


POLICIES: dict[type[ProfileBase], type[Policy]] = {
    cls.profile_type: cls
    for cls in (
        RoundRobin,
        RandomChoice,
        JoinShortestQueue,
        PowerOfTwoChoices,
        LocalityBand,
        BoundedBand,
        MarginalUnion,
        Oracle,
    )
}
"""The policy class of each profile type."""


def make_policy(profile: ProfileBase) -> Policy:
    """A fresh policy for `profile`, its constraints checked (ValueError says which)."""
    cls = POLICIES.get(type(profile))
    if cls is None:
        raise ValueError(f"no policy for profile {type(profile).__name__}")
    return cls(validated(profile))
