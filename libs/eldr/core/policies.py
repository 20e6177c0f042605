"""Routing policies: pick a decode worker for a request after its prefill.

Every policy implements one interface, `Policy.choose(view, rng) -> Choice`, over a
`FleetView`: the candidate workers (live ones only), their loads, and, for locality-aware
policies, each worker's similarity to the request's signature. Policies are pure apart from
their own small state (the round-robin cursor); randomness comes in as a Generator, so a run
is deterministic for a seed.

Load measures: "requests" (in-flight requests: running + waiting + assigned but not yet
admitted) or "kv_tokens" (tokens held or about to be held in the worker's KV cache).

The ELDR rule (paper section "locality-band routing", artifact `locality_band`):
scores = cosine(signature, centroid of each worker); band = {i : scores[i] >= max - tau};
when tau > 0 and the band has a single member, widen it to the two best scores; pick the
least-loaded band member (ties broken at random).
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
    """

    workers: tuple[str, ...]
    in_flight: np.ndarray
    kv_tokens: np.ndarray
    scores: np.ndarray | None = None

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


class Policy(ABC):
    """A routing policy. Subclasses set `name` and implement `choose`."""

    name: ClassVar[str]
    uses_signature: ClassVar[bool] = False

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
        idx = argmin_random_tie(loads, band, rng)
        return Choice(index=idx, band=tuple(int(i) for i in band))

    def params(self) -> dict[str, float | int | str]:
        return {"tau": self.tau, "load_measure": self.load_measure, "widen_to": self.widen_to}


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


POLICY_NAMES = ("round_robin", "random", "jsq", "p2c", "eldr", "oracle")
LOAD_ONLY_POLICIES = ("round_robin", "random", "jsq", "p2c")


def make_policy(spec: PolicySpec) -> Policy:
    """Instantiate a policy from its name and parameters."""
    if spec.name == "round_robin":
        return RoundRobin()
    if spec.name == "random":
        return RandomChoice()
    if spec.name == "jsq":
        return JoinShortestQueue(load_measure=spec.load_measure)
    if spec.name == "p2c":
        return PowerOfTwoChoices(load_measure=spec.load_measure)
    if spec.name == "eldr":
        return LocalityBand(tau=spec.tau, load_measure=spec.load_measure)
    if spec.name == "oracle":
        return Oracle(tau=spec.tau, load_measure=spec.load_measure)
    raise ValueError(f"unknown policy {spec.name!r} (known: {', '.join(POLICY_NAMES)})")
