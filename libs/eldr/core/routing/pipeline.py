"""The routing pipeline: one runner for every profile's stages.

A decision picks a decode worker for a request after its prefill. Every routing profile
(`eldr.core.routing.profile`) is a pipeline of small pure stages (`eldr.core.routing.stages`),
and `PipelinePolicy` runs any of them on a `FleetView` (the live workers, their loads and,
where the profile reads them, the request's partition scores, its predicted expert demand
and the workers' activity):

1. **candidates**: every live worker; or the owners of the centroids nearest the request's
   signature plus the workers without a centroid (`nearest`: only these are read further);
   or a draw (random, P2C); or the next in the cycle (round-robin);
2. **filters**, in order: a load ceiling, the ELDR band;
3. **scorers**: each a cost per remaining candidate in its own units (load, the request's
   marginal expert union, minus the partition score), summed with the profile's weights;
4. **picker**: the cheapest, ties (exact, or within a relative tolerance for sums of
   floats) drawn from the decision's seeded generator.

The four baselines, the paper's band rule, the load-bounded band, the cost-aware rule and
the default are profiles of this one runner, so the router, the simulator, the trainer's
shadow gate, replay and explain all run the same code. Each decision's `Choice` says what
every stage did (candidates, band and how it was built, what reached the scorers, their
costs and the activity terms behind them, the ties), which is what a decision records and
what `eldr explain` shows; replay re-runs the stages on exactly those inputs.

Without what a stage requires (no partition scores for a band or centroid candidates, no
expert demand for the marginal union), the decision goes to the least loaded live worker
on the profile's load measure and says why (`Choice.fallback`).

Pure apart from the round-robin cursor; randomness comes in as a Generator, so a decision
is deterministic for its seed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from eldr.core.routing.activity import ActivityInput, ExpertDemand
from eldr.core.routing.profile import (
    AllLive,
    Band,
    CentroidCost,
    Cheapest,
    Cycle,
    Drawn,
    FixedAssignmentProfile,
    LoadCeiling,
    LoadCost,
    LoadMeasure,
    MarginalUnionCost,
    NearestCentroids,
    Pipeline,
    ProfileBase,
    validated,
)
from eldr.core.routing.stages import (
    BandTrace,
    band,
    ceiling_bound,
    cheapest,
    cycle_next,
    nearest,
    under_ceiling,
    with_newcomers,
)

__all__ = [
    "BandTrace",
    "Choice",
    "FixedAssignment",
    "FleetView",
    "PipelinePolicy",
    "Policy",
    "make_policy",
]


@dataclass(frozen=True)
class FleetView:
    """What a decision may look at.

    workers: the live workers (or, replaying a record, the decision's candidates), index i
    describes workers[i]. in_flight: requests per worker; kv_tokens: KV tokens per worker.
    scores: cosine similarity of the request's signature to each worker's partition
    centroid (-inf where a worker has none, or where the centroid index did not retrieve
    it), or None when no signature or partition exists. has_centroid: bool per worker,
    whether the partition gives it a centroid (None: no partition, or every worker has one).
    expert_miss: per worker the predicted probability that each (MoE layer, expert) is idle
    in its next decode step (`ActivityTable.view`), or the terms a decision recorded
    (`RecordedActivity`); None when not tracked. demand: the request's predicted per-step
    activation of each (MoE layer, expert) (`request_expert_demand`); None without a
    signature. mean_loads: the live fleet's mean (in-flight requests, KV tokens) when
    `workers` are not the whole fleet (a record's candidates); None: the arrays' means.
    """

    workers: tuple[str, ...]
    in_flight: np.ndarray
    kv_tokens: np.ndarray
    scores: np.ndarray | None = None
    has_centroid: np.ndarray | None = None
    expert_miss: ActivityInput | None = None
    demand: ExpertDemand | None = None
    mean_loads: tuple[float, float] | None = None

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

    def mean_load(self, measure: LoadMeasure) -> float:
        """The live fleet's mean load on `measure`."""
        if self.mean_loads is not None:
            return self.mean_loads[0 if measure == "requests" else 1]
        return float(self.load(measure).mean())


@dataclass(frozen=True)
class Choice:
    """A decision's answer: the chosen index into `FleetView.workers`, and what each stage
    did (indices into the same workers)."""

    index: int
    band: tuple[int, ...] = ()
    """The band filter's members (the picker chose among them)."""
    fallback: str | None = None
    tied: tuple[int, ...] = ()
    """The candidates tied for the least cost; several: the decision's draw picked
    `index`. Empty when the candidate stage itself decided (round-robin, random, a P2C
    draw on a fleet of one)."""
    rule: BandTrace | None = None
    costs: np.ndarray | None = None
    """The weighted cost of each of `scored` (None for the load-only rules, whose cost is
    the load)."""
    candidates: tuple[int, ...] = ()
    """What the candidate stage produced (empty when it decided by itself)."""
    scored: tuple[int, ...] = ()
    """The candidates that passed the filters and were scored."""
    activity: tuple[np.ndarray, np.ndarray] | None = None
    """(U, dU) of each of `scored`: its predicted expert union per step and what the
    request adds to it (the marginal-union scorer's inputs)."""


class Policy(ABC):
    """Something that picks a worker on a fleet view. Every routing profile runs through
    `PipelinePolicy`; `FixedAssignment` (an assignment replayed) is the only other kind."""

    profile: ProfileBase
    uses_signature: bool = False
    uses_activity: bool = False
    wants_scores: bool = False
    needs_signature: bool = False

    @property
    def name(self) -> str:
        return self.profile.name

    @abstractmethod
    def choose(self, view: FleetView, rng: np.random.Generator) -> Choice: ...

    def resume_after(self, worker_id: str, workers: tuple[str, ...]) -> None:
        """Continue as if `worker_id` had just been chosen among `workers` (a replay that
        starts in the middle of a router's decisions); only stateful profiles have
        anything to resume."""
        return None


class FixedAssignment(Policy):
    """Routes the i-th decision to the i-th of `worker_ids`: an assignment decided elsewhere
    (an offline search, a live router's recorded choices), replayed through the simulator."""

    def __init__(self, worker_ids: Sequence[str]) -> None:
        self.profile = FixedAssignmentProfile()
        self._worker_ids = tuple(worker_ids)
        self._next = 0

    def choose(self, view: FleetView, rng: np.random.Generator) -> Choice:
        worker = self._worker_ids[self._next]
        self._next += 1
        return Choice(index=view.workers.index(worker))


class PipelinePolicy(Policy):
    """Runs a profile's pipeline (`ProfileBase.pipeline`). Built by `make_policy`."""

    LOAD_ONLY: ClassVar[Pipeline] = Pipeline()
    """The fallback's pipeline: the least loaded live worker (JSQ)."""

    def __init__(self, profile: ProfileBase) -> None:
        self.profile = profile
        self.spec = profile.pipeline
        self.measure: LoadMeasure = profile.measure
        self.uses_signature = profile.uses_signature
        self.uses_activity = profile.uses_activity
        self.wants_scores = profile.wants_scores
        self.needs_signature = profile.needs_signature
        self.fleet_scale = profile.fleet_scale
        self.band_tau = profile.band_tau
        self._cursor = 0
        self._next_id: str | None = None

    def resume_after(self, worker_id: str, workers: tuple[str, ...]) -> None:
        if isinstance(self.spec.candidates, Cycle):
            idx = workers.index(worker_id)
            self._cursor = idx + 1
            self._next_id = workers[(idx + 1) % len(workers)]

    def load_only(
        self, view: FleetView, rng: np.random.Generator, fallback: str | None = None
    ) -> Choice:
        """The least loaded live worker on the profile's measure (ties drawn)."""
        loads = view.load(self.measure)
        idx, ties = cheapest(loads.astype(np.float64), np.arange(len(view.workers)), 0.0, rng)
        return Choice(index=idx, fallback=fallback, tied=tuple(ties.tolist()))

    def choose(self, view: FleetView, rng: np.random.Generator) -> Choice:
        spec = self.spec
        n = len(view.workers)
        scores = view.scores
        if self.uses_signature and scores is None:
            return self.load_only(view, rng, "no_signature")
        if self.uses_activity and view.demand is None:
            return self.load_only(view, rng, "no_signature")
        loads = view.load(self.measure)

        # 1. candidates
        stage = spec.candidates
        if isinstance(stage, AllLive):
            cand = np.arange(n)
        elif isinstance(stage, NearestCentroids):
            assert scores is not None
            cand, _ = nearest(scores, view.has_centroid, stage.k)
            if cand.size == 0:
                return self.load_only(view, rng, "no_centroid")
        elif isinstance(stage, Drawn):
            if stage.n == 1:
                return Choice(index=int(rng.integers(n)))
            if n == 1:
                return Choice(index=0)
            cand = np.sort(rng.choice(n, size=stage.n, replace=False))
        else:
            assert isinstance(stage, Cycle)
            idx, self._cursor, self._next_id = cycle_next(view.workers, self._next_id, self._cursor)
            return Choice(index=idx)
        candidates = tuple(cand.tolist())

        # 2. filters
        rule: BandTrace | None = None
        members: np.ndarray | None = None
        bound: float | None = None
        over: tuple[int, ...] = ()
        for f in spec.filters:
            if isinstance(f, LoadCeiling):
                limit = ceiling_bound(view.mean_load(self.measure), f.slack)
                kept = under_ceiling(cand, loads, limit, scores)
                if kept is not None:
                    cand, over_idx = kept
                    bound, over = limit, tuple(over_idx.tolist())
            else:
                assert isinstance(f, Band)
                assert scores is not None
                within_band, within, best = band(scores, cand, f.tau, f.widen_to)
                if within_band.size == 0:
                    return self.load_only(view, rng, "no_centroid")
                members = with_newcomers(within_band, cand, view.has_centroid, loads)
                rule = BandTrace(
                    best=best,
                    best_score=float(scores[best]),
                    tau=f.tau,
                    within=tuple(within.tolist()),
                    widened_to=(int(within_band.size) if within_band.size != within.size else 0),
                    newcomers=(
                        tuple(np.setdiff1d(members, within_band).tolist())
                        if members.size > within_band.size
                        else ()
                    ),
                    bound=bound,
                    over_bound=over,
                )
                cand = members

        # 3. scorers, 4. picker
        cost: np.ndarray | None = None
        activity: tuple[np.ndarray, np.ndarray] | None = None
        only_load = True
        for s in spec.scorers:
            if isinstance(s, LoadCost):
                term = loads[cand].astype(np.float64)
                cost = _add(cost, term, s.weight)
            elif isinstance(s, MarginalUnionCost):
                only_load = False
                demand = view.demand
                assert demand is not None
                if view.expert_miss is None:
                    union = np.zeros(cand.size)
                    added = np.full(cand.size, demand.total)
                else:
                    union, added = view.expert_miss.marginal(
                        demand, None if cand.size == n else cand
                    )
                activity = (union, added.copy())
                # union + (n + 1) dU, in place (float addition commutes exactly).
                added *= view.in_flight[cand] + 1.0
                term = np.add(added, union, out=added)
                cost = _add(cost, term, s.weight)
            else:
                assert isinstance(s, CentroidCost)
                only_load = False
                if scores is not None and s.weight > 0:
                    at = scores[cand]
                    bonus = np.where(np.isfinite(at), at, 0.0)
                    base = cost if cost is not None else np.zeros(cand.size)
                    cost = np.asarray(base - s.weight * bonus, dtype=np.float64)
        if cost is None:
            cost = np.zeros(cand.size)
        picker: Cheapest = spec.picker
        idx, ties = cheapest(cost, cand, picker.tolerance, rng)
        return Choice(
            index=idx,
            band=() if members is None else tuple(members.tolist()),
            tied=tuple(ties.tolist()),
            rule=rule,
            costs=None if only_load else np.asarray(cost, dtype=np.float64),
            candidates=candidates,
            scored=tuple(cand.tolist()),
            activity=activity,
        )


def _add(cost: np.ndarray | None, term: np.ndarray, weight: float) -> np.ndarray:
    """cost + weight x term (a weight of 1 adds the term as it is)."""
    weighted = term if weight == 1.0 else weight * term
    return weighted if cost is None else cost + weighted


def make_policy(profile: ProfileBase) -> PipelinePolicy:
    """A fresh pipeline for `profile`, its constraints checked (ValueError says which)."""
    return PipelinePolicy(validated(profile))
