"""Routing policies: pick a decode worker for a request after its prefill.

Every policy implements one interface, `Policy.choose(view, rng) -> Choice`, over a
`FleetView`: the candidate workers (live ones only), their loads, and, for locality-aware
policies, each worker's similarity to the request's signature. Policies are pure apart from
their own small state (the round-robin cursor); randomness comes in as a Generator, so a run
is deterministic for a seed.

Load measures: "requests" (in-flight requests: running + waiting + assigned but not yet
admitted) or "kv_tokens" (tokens held or about to be held in the worker's KV cache).

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
  experts its in-flight requests are likely to activate (`eldr.core.routing.activity`), what the
  request would add to the worker's per-step expert union (dU) and what its batch's union
  is now (U); a step costs a fixed part plus a term proportional to U, so sending the
  request there costs the fleet U + (n + 1) dU expert loads per step (its own steps, and
  n requests already there slowed by dU). It picks the cheapest worker. No partition
  needed; with `locality_weight` > 0 the partition's cosine score is a bonus.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import numpy as np

LoadMeasure = Literal["requests", "kv_tokens"]
LOAD_MEASURES: tuple[LoadMeasure, ...] = ("requests", "kv_tokens")


@dataclass(frozen=True)
class FleetView:
    """What a policy may look at for one decision.

    workers: candidate worker ids (live workers), index i describes workers[i].
    in_flight: requests per worker; kv_tokens: KV tokens per worker.
    scores: cosine similarity of the request's signature to each worker's partition
    centroid (-inf where a worker has none), or None when no signature or partition exists.
    has_centroid: bool per worker, whether the partition gives it a centroid (None: no
    partition, or every worker has one).
    expert_miss: float [workers, L * E], per worker the predicted probability that each
    (MoE layer, expert) is idle in its next decode step, given its in-flight requests
    (`eldr.core.routing.activity.ActivityTable`); None when not tracked.
    demand: float [L * E], the request's predicted per-step activation probability of each
    (MoE layer, expert) (`eldr.core.routing.activity.expert_demand`); None without a signature.
    """

    workers: tuple[str, ...]
    in_flight: np.ndarray
    kv_tokens: np.ndarray
    scores: np.ndarray | None = None
    has_centroid: np.ndarray | None = None
    expert_miss: np.ndarray | None = None
    demand: np.ndarray | None = None

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
        if self.demand is not None and self.demand.ndim != 1:
            raise ValueError(f"demand must be a vector, got shape {self.demand.shape}")
        if self.expert_miss is not None:
            dim = None if self.demand is None else self.demand.shape[0]
            if self.expert_miss.ndim != 2 or self.expert_miss.shape[0] != n:
                raise ValueError(
                    f"expert_miss has shape {self.expert_miss.shape}, expected ({n}, dim)"
                )
            if dim is not None and self.expert_miss.shape[1] != dim:
                raise ValueError(
                    f"expert_miss has {self.expert_miss.shape[1]} columns, demand {dim}"
                )

    def load(self, measure: LoadMeasure) -> np.ndarray:
        if measure == "requests":
            return self.in_flight
        if measure == "kv_tokens":
            return self.kv_tokens
        raise ValueError(f"unknown load measure {measure!r}")


@dataclass(frozen=True)
class Choice:
    """A policy's answer: the chosen index into FleetView.workers, and why."""

    index: int
    band: tuple[int, ...] = ()
    fallback: str | None = None


def argmin_random_tie(values: np.ndarray, candidates: np.ndarray, rng: np.random.Generator) -> int:
    """Index (into the full array) of the smallest value among candidates; random tie-break."""
    cand_values = values[candidates]
    best = cand_values.min()
    ties = candidates[cand_values == best]
    if ties.size == 1:
        return int(ties[0])
    return int(ties[rng.integers(ties.size)])


def locality_band(scores: np.ndarray, tau: float, widen_to: int = 2) -> np.ndarray:
    """Indices of workers whose score is within tau of the best (the ELDR band).

    Workers with score -inf (no centroid) are never in the band. When tau > 0 and only one
    worker qualifies, the band widens to the `widen_to` best-scoring workers, so a single
    dominant centroid cannot pin all of its traffic on one worker.
    """
    if tau < 0:
        raise ValueError(f"tau must be non-negative, got {tau}")
    finite = np.isfinite(scores)
    if not finite.any():
        return np.empty(0, dtype=np.int64)
    best = scores[finite].max()
    band = np.flatnonzero(finite & (scores >= best - tau))
    if tau > 0 and band.size == 1 and widen_to > 1:
        order = np.argsort(-np.where(finite, scores, -np.inf), kind="stable")
        band = np.sort(order[: min(widen_to, int(finite.sum()))])
    return band


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
    """A routing policy. Subclasses set `name` and implement `choose`."""

    name: ClassVar[str]
    uses_signature: ClassVar[bool] = False
    """Needs partition scores; routes load-only (and says why) without them."""
    uses_activity: ClassVar[bool] = False
    """Reads `FleetView.demand` and `expert_miss` (the caller tracks worker activity)."""

    @property
    def wants_scores(self) -> bool:
        """Whether the caller should compute partition scores for this policy."""
        return self.uses_signature

    @property
    def needs_signature(self) -> bool:
        """Whether routing reads the request's prefill counts (fetch them for it)."""
        return self.uses_signature or self.uses_activity or self.wants_scores

    @abstractmethod
    def choose(self, view: FleetView, rng: np.random.Generator) -> Choice: ...

    def params(self) -> dict[str, float | int | str]:
        """Parameters recorded with each decision (for replay and explain)."""
        return {}


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._cursor = 0
        self._last_workers: tuple[str, ...] = ()
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
    name = "random"

    def choose(self, view: FleetView, rng: np.random.Generator) -> Choice:
        return Choice(index=int(rng.integers(len(view.workers))))


@dataclass
class JoinShortestQueue(Policy):
    """Fewest in-flight (or KV tokens); ties broken at random."""

    load_measure: LoadMeasure = "requests"
    name: ClassVar[str] = "jsq"

    def choose(self, view: FleetView, rng: np.random.Generator) -> Choice:
        loads = view.load(self.load_measure)
        return Choice(index=argmin_random_tie(loads, np.arange(len(view.workers)), rng))

    def params(self) -> dict[str, float | int | str]:
        return {"load_measure": self.load_measure}


@dataclass
class PowerOfTwoChoices(Policy):
    """Sample two distinct workers uniformly, take the less loaded."""

    load_measure: LoadMeasure = "requests"
    name: ClassVar[str] = "p2c"

    def choose(self, view: FleetView, rng: np.random.Generator) -> Choice:
        n = len(view.workers)
        if n == 1:
            return Choice(index=0)
        pair = rng.choice(n, size=2, replace=False)
        loads = view.load(self.load_measure)
        return Choice(index=argmin_random_tie(loads, np.sort(pair), rng))

    def params(self) -> dict[str, float | int | str]:
        return {"load_measure": self.load_measure}


@dataclass
class LocalityBand(Policy):
    """ELDR: least-loaded worker among those whose centroid best matches the signature.

    Without scores (no signature or no partition) it falls back to JSQ on the same load
    measure and says so in `Choice.fallback`.
    """

    tau: float = 0.1
    load_measure: LoadMeasure = "requests"
    widen_to: int = 2
    name: ClassVar[str] = "eldr"
    uses_signature: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.tau < 0:
            raise ValueError(f"tau must be non-negative, got {self.tau}")
        if self.load_measure not in LOAD_MEASURES:
            raise ValueError(f"unknown load measure {self.load_measure!r}")

    def choose(self, view: FleetView, rng: np.random.Generator) -> Choice:
        loads = view.load(self.load_measure)
        all_idx = np.arange(len(view.workers))
        if view.scores is None:
            return Choice(index=argmin_random_tie(loads, all_idx, rng), fallback="no_signature")
        band = locality_band(view.scores, self.tau, self.widen_to)
        if band.size == 0:
            return Choice(index=argmin_random_tie(loads, all_idx, rng), fallback="no_centroid")
        band = with_newcomers(band, view, loads)
        idx = argmin_random_tie(loads, band, rng)
        return Choice(index=idx, band=tuple(int(i) for i in band))

    def params(self) -> dict[str, float | int | str]:
        return {"tau": self.tau, "load_measure": self.load_measure, "widen_to": self.widen_to}


@dataclass
class BoundedBand(LocalityBand):
    """The ELDR band over the workers whose load is within a bound of the fleet mean.

    Eligible workers: load <= (1 + slack) x mean load + 1 (the +1 lets an idle fleet
    take a first request anywhere). The band is taken over the eligible workers' scores,
    so a popular cluster spills to its next-best eligible neighbour instead of queueing.
    """

    slack: float = 0.1
    name: ClassVar[str] = "eldr_bounded"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.slack < 0:
            raise ValueError(f"slack must be non-negative, got {self.slack}")

    def choose(self, view: FleetView, rng: np.random.Generator) -> Choice:
        if view.scores is None:
            return super().choose(view, rng)
        loads = view.load(self.load_measure)
        eligible = loads <= (1.0 + self.slack) * float(loads.mean()) + 1.0
        scores = np.where(eligible, view.scores, -np.inf)
        if not np.isfinite(scores).any():
            # Every scored worker is over the bound: newcomers or the least loaded.
            return super().choose(view, rng)
        band = locality_band(scores, self.tau, self.widen_to)
        band = with_newcomers(band, view, loads)
        idx = argmin_random_tie(loads, band, rng)
        return Choice(index=idx, band=tuple(int(i) for i in band))

    def params(self) -> dict[str, float | int | str]:
        return {**super().params(), "slack": self.slack}


@dataclass
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

    load_measure: LoadMeasure = "requests"
    locality_weight: float = 0.0
    prior_tokens: float = 1.0
    top_k: int = 0
    """Experts per token per layer for the demand estimate; 0 = estimate per request."""
    name: ClassVar[str] = "eldr_cost"
    uses_activity: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.load_measure not in LOAD_MEASURES:
            raise ValueError(f"unknown load measure {self.load_measure!r}")
        if self.locality_weight < 0:
            raise ValueError(f"locality_weight must be non-negative, got {self.locality_weight}")
        if self.prior_tokens <= 0:
            raise ValueError(f"prior_tokens must be positive, got {self.prior_tokens}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be non-negative, got {self.top_k}")

    @property
    def wants_scores(self) -> bool:
        return self.locality_weight > 0

    def costs(self, view: FleetView) -> np.ndarray:
        """Predicted fleet cost of sending the request to each worker (expert loads/step)."""
        if view.demand is None:
            raise ValueError("marginal-union costs need the request's demand")
        demand = view.demand
        if view.expert_miss is None:
            added = np.full(len(view.workers), float(demand.sum()))
            union = np.zeros(len(view.workers))
        else:
            added = view.expert_miss @ demand
            union = view.expert_miss.shape[1] - view.expert_miss.sum(axis=1)
        cost = union + (view.in_flight.astype(np.float64) + 1.0) * added
        if self.locality_weight > 0 and view.scores is not None:
            bonus = np.where(np.isfinite(view.scores), view.scores, 0.0)
            cost = cost - self.locality_weight * bonus
        return np.asarray(cost, dtype=np.float64)

    def choose(self, view: FleetView, rng: np.random.Generator) -> Choice:
        if view.demand is None:
            loads = view.load(self.load_measure)
            idx = argmin_random_tie(loads, np.arange(len(view.workers)), rng)
            return Choice(index=idx, fallback="no_signature")
        cost = self.costs(view)
        # Costs are sums of floats: treat near-equal ones as ties.
        best = float(cost.min())
        ties = np.flatnonzero(cost <= best + 1e-9 * max(1.0, abs(best)))
        idx = int(ties[0]) if ties.size == 1 else int(ties[rng.integers(ties.size)])
        return Choice(index=idx)

    def params(self) -> dict[str, float | int | str]:
        return {
            "load_measure": self.load_measure,
            "locality_weight": self.locality_weight,
            "prior_tokens": self.prior_tokens,
            "top_k": self.top_k,
        }


@dataclass
class Oracle(LocalityBand):
    """The ELDR rule fed with the request's true decode signature (benchmark only).

    The policy itself is the locality band; what makes it an oracle is that the caller
    scores it with the decode-phase expert profile, which no real router can know at
    routing time, against centroids fitted on decode profiles.
    """

    name: ClassVar[str] = "oracle"


@dataclass(frozen=True)
class PolicySpec:
    """A policy by name plus parameters, as configured in settings or on the command line."""

    name: str
    tau: float = 0.1
    load_measure: LoadMeasure = "requests"
    extra: dict[str, float] = field(default_factory=dict)


POLICY_NAMES = (
    "round_robin",
    "random",
    "jsq",
    "p2c",
    "eldr",
    "eldr_bounded",
    "eldr_cost",
    "oracle",
)
LOAD_ONLY_POLICIES = ("round_robin", "random", "jsq", "p2c")
DEFAULT_POLICY = "eldr_cost"
"""The policy routers and `eldr bench` use unless told otherwise (docs/ONLINE.md)."""
PAPER_POLICY = "eldr"
"""The ELDR paper's locality-band rule, always selectable and reported beside the default."""
POLICY_EXTRA_PARAMS: dict[str, tuple[str, ...]] = {
    "eldr": ("widen_to",),
    "oracle": ("widen_to",),
    "eldr_bounded": ("widen_to", "slack"),
    "eldr_cost": ("locality_weight", "prior_tokens", "top_k"),
}
"""Parameters each policy takes from `PolicySpec.extra`."""


def make_policy(spec: PolicySpec) -> Policy:
    """Instantiate a policy from its name and parameters (unknown extras are an error)."""
    known = POLICY_EXTRA_PARAMS.get(spec.name, ())
    unknown = sorted(set(spec.extra) - set(known))
    if unknown and spec.name in POLICY_NAMES:
        raise ValueError(
            f"policy {spec.name!r} takes no parameter {', '.join(unknown)} "
            f"(it takes: {', '.join(known) or 'none'})"
        )
    x = spec.extra
    if spec.name == "round_robin":
        return RoundRobin()
    if spec.name == "random":
        return RandomChoice()
    if spec.name == "jsq":
        return JoinShortestQueue(load_measure=spec.load_measure)
    if spec.name == "p2c":
        return PowerOfTwoChoices(load_measure=spec.load_measure)
    widen_to = int(x.get("widen_to", 2))
    if spec.name == "eldr":
        return LocalityBand(tau=spec.tau, load_measure=spec.load_measure, widen_to=widen_to)
    if spec.name == "eldr_bounded":
        return BoundedBand(
            tau=spec.tau,
            load_measure=spec.load_measure,
            widen_to=widen_to,
            slack=float(x.get("slack", 0.1)),
        )
    if spec.name == "eldr_cost":
        return MarginalUnion(
            load_measure=spec.load_measure,
            locality_weight=float(x.get("locality_weight", 0.0)),
            prior_tokens=float(x.get("prior_tokens", 1.0)),
            top_k=int(x.get("top_k", 0)),
        )
    if spec.name == "oracle":
        return Oracle(tau=spec.tau, load_measure=spec.load_measure, widen_to=widen_to)
    raise ValueError(f"unknown policy {spec.name!r} (known: {', '.join(POLICY_NAMES)})")
