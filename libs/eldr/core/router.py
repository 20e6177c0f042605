"""The routing decision, as a pure function of the router's state.

`RouterCore` holds what a router replica knows: the live load table, the active partition
and the configured policy. `decide` turns one request (its prefill expert counts, or the
reason they are missing) into a `RouteOutcome`: the chosen worker and everything needed to
explain and replay the choice (candidate scores, the band, the loads seen, any fallback).

Fallback: a locality policy that cannot score the request (no partition yet, no signature,
a partition for another model, a signature of another geometry, no live worker in the
partition) routes with the best load-only policy, JSQ on the same load measure, and says
why in `fallback`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eldr.core.loadtable import LoadTable
from eldr.core.partition import Partition
from eldr.core.policies import (
    FleetView,
    JoinShortestQueue,
    LoadMeasure,
    Policy,
    PolicySpec,
    make_policy,
)

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
)
"""Every value `RouteOutcome.fallback` can take (a bounded metric label)."""


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


@dataclass(frozen=True)
class RouteOutcome:
    worker_id: str
    policy: str
    params: dict[str, float | int | str]
    partition_version: int | None
    fallback: str | None
    scores: tuple[tuple[str, float], ...]
    band: tuple[str, ...]
    loads: tuple[tuple[str, float], ...]


class RouterCore:
    def __init__(
        self,
        policy: PolicySpec,
        table: LoadTable,
        rng: np.random.Generator,
        max_scores: int = 8,
    ) -> None:
        self.table = table
        self.rng = rng
        self.max_scores = max_scores
        self.partition: Partition | None = None
        self.spec = policy
        self.policy: Policy = make_policy(policy)
        self._fallback: Policy = JoinShortestQueue(load_measure=policy.load_measure)

    def set_policy(self, spec: PolicySpec) -> None:
        """Switch policy (validated first: a bad spec leaves the old policy in place)."""
        policy = make_policy(spec)
        self.spec = spec
        self.policy = policy
        self._fallback = JoinShortestQueue(load_measure=spec.load_measure)

    def set_partition(self, partition: Partition | None) -> None:
        self.partition = partition

    @property
    def load_measure(self) -> LoadMeasure:
        return self.spec.load_measure

    def _scores(
        self, req: RouteRequest, live: tuple[str, ...]
    ) -> tuple[np.ndarray | None, str | None]:
        """Locality scores of the live workers, or the reason there are none."""
        p = self.partition
        if p is None:
            return None, "no_partition"
        if p.model != req.model:
            return None, "model_mismatch"
        if req.counts is None:
            return None, req.signature_error or "no_signature"
        cal = p.calibration
        if req.counts.size != cal.num_moe_layers * cal.num_experts:
            return None, "geometry_mismatch"
        if not np.any(req.counts):
            return None, "empty_signature"
        scores = p.scores_for(req.counts, live, tau=self.spec.tau)
        if not np.isfinite(scores).any():
            return None, "no_live_worker_in_partition"
        return scores, None

    def decide(self, req: RouteRequest, now_s: float) -> RouteOutcome:
        live = self.table.live_workers(now_s)
        if not live:
            raise NoLiveWorkersError("no live decode worker in the load table")
        in_flight, kv = self.table.loads(live)
        scores: np.ndarray | None = None
        fallback: str | None = None
        policy = self.policy
        if policy.uses_signature:
            scores, fallback = self._scores(req, live)
            if scores is None:
                policy = self._fallback
        view = FleetView(workers=live, in_flight=in_flight, kv_tokens=kv, scores=scores)
        choice = policy.choose(view, self.rng)
        if choice.fallback and fallback is None:
            fallback = choice.fallback
        load = view.load(self.load_measure)
        ranked: tuple[tuple[str, float], ...] = ()
        if scores is not None:
            finite = np.flatnonzero(np.isfinite(scores))
            order = finite[np.argsort(-scores[finite], kind="stable")][: self.max_scores]
            ranked = tuple((live[i], float(scores[i])) for i in order)
        return RouteOutcome(
            worker_id=live[choice.index],
            policy=self.policy.name,
            params=self.policy.params(),
            partition_version=(
                self.partition.version
                if self.partition is not None and self.policy.uses_signature
                else None
            ),
            fallback=fallback,
            scores=ranked,
            band=tuple(live[i] for i in choice.band),
            loads=tuple((w, float(x)) for w, x in zip(live, load, strict=True)),
        )
