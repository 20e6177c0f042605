"""Online refit: when to refit, and whether a refit is worth promoting.

The trainer refits on a rolling window of recent traffic (`eldr.core.training.trainwindow`). Three
pure pieces decide what happens around a fit:

- **Drift detection** (`DriftMonitor`): a fit records, on requests held out of it, the
  mean cosine similarity of a request to its nearest centroid and how unevenly requests
  spread over the nearest centroids (total-variation distance of the occupancy from
  uniform); a version without such a baseline takes it from the first requests it
  serves. Recent requests are compared with the baseline: similarity falling (requests
  land far from every centroid: a new topic) or occupancy skewing (traffic piling onto a
  few clusters) beyond a threshold means the partition no longer fits the traffic, and
  the trainer refits early.
- **Shadow evaluation** (`shadow_evaluate`): before promoting a candidate, replay
  held-out recent requests (with decode summaries, so what they really activated during
  decode is known) through both partitions and the cost model's notion of work: under
  each partition the requests are routed as the routers route them, with the routers'
  own profile through the routers' own decision (`shadow_assignment`,
  `eldr.core.routing.decide.route`); a worker's batch grows with its share of the
  traffic, and a step of a batch of B requests drawn from a worker's share costs the
  expected number of distinct experts it activates (`activity.expected_union`: sum over
  (layer, expert) of 1 - (1 - pbar)^B, pbar the share's mean per-token decode
  activation); the average request pays its worker's union. The candidate is promoted
  only if its modelled union is lower by more than `min_gain` (`promotion_verdict`);
  otherwise the active version stays and the verdict says why.
- **Triggers** (`refit_trigger`): churn (the live workers differ from the active
  partition's, once the set has been stable for a settle time), drift, or the schedule.

Everything here is numpy and stdlib; time comes in as arguments.
"""

from __future__ import annotations

import hashlib
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from eldr.core.partition.partition import (
    BASELINE_HELD_OUT_METRIC,
    BEST_SIMILARITY_METRIC,
    OCCUPANCY_SKEW_METRIC,
    Partition,
    nearest_workers,
    occupancy_skew,
)
from eldr.core.routing.activity import ActivityTable, expected_union, expert_demand
from eldr.core.routing.decide import (
    SEED_LIMIT,
    DecisionRng,
    RouteRequest,
    activity_for,
    request_demand,
    route,
)
from eldr.core.routing.pipeline import make_policy
from eldr.core.routing.profile import ProfileBase

__all__ = [
    "BASELINE_HELD_OUT_METRIC",
    "BEST_SIMILARITY_METRIC",
    "OCCUPANCY_SKEW_METRIC",
    "DriftBaseline",
    "DriftMonitor",
    "DriftStatus",
    "DriftThresholds",
    "ShadowResult",
    "Verdict",
    "holdout_mask",
    "modelled_union",
    "nearest_workers",
    "occupancy_skew",
    "partition_scores",
    "per_token_activation",
    "prefill_activation",
    "promotion_verdict",
    "refit_trigger",
    "shadow_assignment",
    "shadow_evaluate",
]

# --- drift ------------------------------------------------------------------------------


@dataclass(frozen=True)
class DriftBaseline:
    """How the partition's own training traffic sat against its centroids."""

    best_similarity: float
    occupancy_skew: float

    @classmethod
    def of(cls, partition: Partition, signatures: np.ndarray) -> DriftBaseline:
        sim, worker = nearest_workers(partition, signatures)
        ok = worker >= 0
        mean = float(sim[ok].mean()) if ok.any() else 0.0
        return cls(mean, occupancy_skew(worker, partition.k))

    @classmethod
    def from_metrics(cls, metrics: Mapping[str, float]) -> DriftBaseline | None:
        """The baseline a fit measured on held-out requests, from its metrics; None when
        there is none or it was measured on the training requests (biased: they sit closer
        to centroids fitted on them), so that the monitor measures one from live traffic."""
        if metrics.get(BASELINE_HELD_OUT_METRIC) != 1.0:
            return None
        sim = metrics.get(BEST_SIMILARITY_METRIC)
        skew = metrics.get(OCCUPANCY_SKEW_METRIC)
        if sim is None or skew is None or not (math.isfinite(sim) and math.isfinite(skew)):
            return None
        return cls(float(sim), float(skew))

    def metrics(self) -> dict[str, float]:
        return {
            BEST_SIMILARITY_METRIC: self.best_similarity,
            OCCUPANCY_SKEW_METRIC: self.occupancy_skew,
        }


@dataclass(frozen=True)
class DriftThresholds:
    max_similarity_drop: float = 0.05
    """Drift when the recent mean best similarity is this much below the baseline's."""
    max_skew_rise: float = 0.2
    """Drift when the recent occupancy skew is this much above the baseline's."""
    min_samples: int = 128
    """Recent requests needed before any verdict."""

    def __post_init__(self) -> None:
        if self.max_similarity_drop <= 0 or self.max_skew_rise <= 0:
            raise ValueError("drift thresholds must be positive")
        if self.min_samples < 1:
            raise ValueError(f"min_samples must be >= 1, got {self.min_samples}")


@dataclass(frozen=True)
class DriftStatus:
    samples: int
    best_similarity: float
    """Mean best-centroid similarity of the recent requests (nan without samples)."""
    similarity_drop: float
    """Baseline minus recent (positive: requests sit further from the centroids)."""
    occupancy_skew: float
    skew_rise: float
    """Recent minus baseline (positive: traffic concentrates on fewer workers)."""
    drifted: bool
    reason: str


class DriftMonitor:
    """Recent requests' fit to one partition, against that partition's baseline.

    `observe` takes each new request's prefill counts; the last `window` are kept. Without
    a baseline (a version fitted before baselines were recorded, or fitted elsewhere) the
    first `thresholds.min_samples` requests observed establish it: drift is then measured
    against the traffic the version first served.
    """

    def __init__(
        self,
        partition: Partition,
        baseline: DriftBaseline | None,
        *,
        window: int = 512,
        thresholds: DriftThresholds | None = None,
    ) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.partition = partition
        self.baseline = baseline
        self.thresholds = thresholds or DriftThresholds()
        if window < self.thresholds.min_samples:
            raise ValueError(f"window {window} is smaller than min_samples")
        self._sims: deque[float] = deque(maxlen=window)
        self._workers: deque[int] = deque(maxlen=window)

    def _maybe_set_baseline(self) -> None:
        if self.baseline is None and len(self._sims) >= self.thresholds.min_samples:
            workers = np.fromiter(self._workers, dtype=np.int64)
            self.baseline = DriftBaseline(
                float(np.mean(self._sims)), occupancy_skew(workers, self.partition.k)
            )
            # Start monitoring afresh: the samples that set the baseline cannot drift from it.
            self._sims.clear()
            self._workers.clear()

    @property
    def version(self) -> int:
        return self.partition.version

    @property
    def model(self) -> str:
        return self.partition.model

    def __len__(self) -> int:
        return len(self._sims)

    def observe(self, counts: np.ndarray) -> None:
        """One request's prefill counts ([L, E] or flat) of the partition's geometry."""
        flat = np.asarray(counts, dtype=np.float32).reshape(1, -1)
        if flat.shape[1] != self.partition.calibration.num_moe_layers * (
            self.partition.calibration.num_experts
        ):
            return  # another model's geometry: not this partition's traffic
        sig = self.partition.calibration.apply(flat)
        sim, worker = nearest_workers(self.partition, sig)
        if worker[0] < 0:
            return
        self._sims.append(float(sim[0]))
        self._workers.append(int(worker[0]))
        self._maybe_set_baseline()

    def observe_many(self, counts: np.ndarray) -> None:
        """Rows of flat prefill counts [N, L * E], in arrival order."""
        rows = np.asarray(counts, dtype=np.float32)
        if rows.size == 0:
            return
        sig = self.partition.calibration.apply(rows)
        sim, worker = nearest_workers(self.partition, sig)
        for s, w in zip(sim, worker, strict=True):
            if w >= 0:
                self._sims.append(float(s))
                self._workers.append(int(w))
                self._maybe_set_baseline()

    def status(self) -> DriftStatus:
        n = len(self._sims)
        t = self.thresholds
        if self.baseline is None:
            return DriftStatus(
                n, float("nan"), 0.0, 0.0, 0.0, False, f"establishing a baseline ({n} requests)"
            )
        if n == 0:
            return DriftStatus(0, float("nan"), 0.0, 0.0, 0.0, False, "no recent requests")
        mean = float(np.mean(self._sims))
        skew = occupancy_skew(np.fromiter(self._workers, dtype=np.int64), self.partition.k)
        drop = self.baseline.best_similarity - mean
        rise = skew - self.baseline.occupancy_skew
        reasons = []
        if drop > t.max_similarity_drop:
            reasons.append(
                f"best-centroid similarity {mean:.3f} is {drop:.3f} below the fit's "
                f"{self.baseline.best_similarity:.3f}"
            )
        if rise > t.max_skew_rise:
            reasons.append(
                f"occupancy skew {skew:.3f} is {rise:.3f} above the fit's "
                f"{self.baseline.occupancy_skew:.3f}"
            )
        if n < t.min_samples:
            return DriftStatus(
                n, mean, drop, skew, rise, False, f"{n} recent requests, need {t.min_samples}"
            )
        drifted = bool(reasons)
        reason = "; ".join(reasons) if drifted else "within thresholds"
        return DriftStatus(n, mean, drop, skew, rise, drifted, reason)


# --- shadow evaluation ------------------------------------------------------------------


def shadow_assignment(
    partition: Partition,
    prefill_counts: np.ndarray,
    workers: Sequence[str],
    *,
    profile: ProfileBase,
    batch: float,
    num_moe_layers: int,
    prompt_tokens: np.ndarray | None = None,
    seed: int = 0,
) -> np.ndarray:
    """Worker index (into `workers`) per request, rows in arrival order, as routers
    running `profile` route them with `partition`: each request goes through
    `eldr.core.routing.decide.route`, the routers' own decision.

    What the routers would see is modelled: a request is in flight until
    round(batch x workers) later requests have been routed (Little's law at the modelled
    per-worker batch; with fewer requests, every one routed so far is in flight); a
    worker's load is its in-flight requests, its KV tokens their prompt tokens (one per
    request without `prompt_tokens`), its activity their predicted expert demand (for
    policies that use it). Each decision draws from its own seed, the same under every
    partition, so two partitions are compared on the same draws.
    """
    prefill = np.asarray(prefill_counts, dtype=np.float32)
    live = tuple(workers)
    col = {w: j for j, w in enumerate(live)}
    n = prefill.shape[0]
    tokens = np.ones(n, dtype=np.int64) if prompt_tokens is None else prompt_tokens
    policy = make_policy(profile)
    draws = np.random.default_rng(seed).integers(SEED_LIMIT, size=max(n, 1), dtype=np.int64)
    seeds = [int(x) for x in np.atleast_1d(draws)]
    rngs = DecisionRng()
    in_flight = np.zeros(len(live), dtype=np.int64)
    kv = np.zeros(len(live), dtype=np.int64)
    activity = ActivityTable(ttl_s=float("inf")) if profile.uses_activity else None
    window = max(1, round(batch * len(live)))
    out = np.empty(n, dtype=np.int64)
    for i in range(n):
        if i >= window:
            gone = i - window
            in_flight[out[gone]] -= 1
            kv[out[gone]] -= int(tokens[gone])
            if activity is not None:
                activity.finish(str(gone))
        req = RouteRequest(
            request_id=str(i),
            model=partition.model,
            prompt_tokens=int(tokens[i]) if prompt_tokens is not None else 0,
            counts=prefill[i].reshape(num_moe_layers, -1),
        )
        demand = request_demand(profile, req) if activity is not None else None
        outcome = route(
            req,
            policy=policy,
            partition=partition,
            workers=live,
            in_flight=in_flight.copy(),
            kv_tokens=kv.copy(),
            rng=rngs.seeded(seeds[i]),
            expert_miss=activity_for(policy, activity, live),
            demand=demand,
        )
        j = col[outcome.worker_id]
        out[i] = j
        in_flight[j] += 1
        kv[j] += int(tokens[i])
        if activity is not None and demand is not None:
            activity.add(outcome.worker_id, str(i), demand, float(i))
    return out


def modelled_union(
    groups: np.ndarray, activation: np.ndarray, num_groups: int, batch: float, num_layers: int
) -> float:
    """Distinct experts per MoE layer per step as the average request sees it.

    groups[i]: the worker of request i; activation [N, L * E]: per-token decode
    activation. A worker's batch is proportional to its share of the requests (`batch` at
    an even share), and a step runs that many requests drawn from the worker's members, so
    expert d is idle with probability (1 - mean activation at d)^batch. Each worker's union
    is weighted by its requests: piling traffic on one worker enlarges its batch and
    union, which its many requests all pay for.
    """
    n = groups.size
    if n == 0:
        return float("nan")
    total = 0.0
    for g in range(num_groups):
        members = groups == g
        m = int(members.sum())
        if m == 0:
            continue
        pbar = np.clip(activation[members].mean(axis=0), 0.0, 1.0)
        b = max(1.0, batch * m * num_groups / n)
        with np.errstate(divide="ignore"):  # pbar = 1: never idle, log 0 = -inf
            union = expected_union(b * np.log1p(-pbar))
        total += m * union / num_layers
    return total / n


@dataclass(frozen=True)
class ShadowResult:
    """Modelled expert union per MoE layer per step of held-out traffic, per partition."""

    n_eval: int
    batch: float
    active_union: float
    candidate_union: float
    source: str = "decode summaries"
    """What the held-out requests' decode activation came from."""

    @property
    def change(self) -> float:
        """Relative change of the candidate against the active version (negative: better)."""
        if not self.active_union > 0:
            return float("nan")
        return (self.candidate_union - self.active_union) / self.active_union

    def describe(self) -> str:
        return (
            f"shadow on {self.n_eval} held-out requests ({self.source}) at batch "
            f"{self.batch:g}: union/layer "
            f"{self.active_union:.3f} (active) -> {self.candidate_union:.3f} (candidate), "
            f"{100 * self.change:+.2f}%"
        )


def partition_scores(
    partition: Partition, prefill_counts: np.ndarray, workers: Sequence[str]
) -> np.ndarray:
    """Scores [N, len(workers)] of each request against each worker (-inf: no centroid)."""
    sig = partition.calibration.apply(np.asarray(prefill_counts, dtype=np.float32))
    sims = sig @ partition.centroids.T
    out = np.full((sims.shape[0], len(workers)), -np.inf, dtype=np.float32)
    col = {w: i for i, w in enumerate(workers)}
    for m, owner in enumerate(partition.owners):
        j = col.get(partition.workers[int(owner)])
        if j is not None:
            np.maximum(out[:, j], sims[:, m], out=out[:, j])
    return out


def shadow_evaluate(
    active: Partition,
    candidate: Partition,
    prefill_counts: np.ndarray,
    activation: np.ndarray,
    workers: Sequence[str],
    *,
    profile: ProfileBase,
    batch: float,
    num_moe_layers: int,
    prompt_tokens: np.ndarray | None = None,
    seed: int = 0,
    source: str = "decode summaries",
) -> ShadowResult:
    """Route held-out requests under both partitions and model their expert unions.

    prefill_counts: flat [N, L * E] rows in arrival order (what routing sees);
    activation: [N, L * E] the same requests' per-token decode activation
    (`per_token_activation` of their decode summaries, or `prefill_activation` as a proxy,
    named by `source`); workers: the live workers both are routed to; profile: the
    routers' routing profile (`shadow_assignment`, which also takes `prompt_tokens` and
    `seed`); batch: the fleet's mean batch per worker (`modelled_union`).
    """
    prefill = np.asarray(prefill_counts, dtype=np.float32)
    act = np.asarray(activation, dtype=np.float64)
    if prefill.shape != act.shape or prefill.ndim != 2:
        raise ValueError(f"prefill {prefill.shape} and activation {act.shape} must match")
    if not workers:
        raise ValueError("shadow evaluation needs at least one worker")
    if batch <= 0:
        raise ValueError(f"batch must be positive, got {batch}")
    n = prefill.shape[0]
    unions = []
    for partition in (active, candidate):
        groups = shadow_assignment(
            partition,
            prefill,
            workers,
            profile=profile,
            batch=batch,
            num_moe_layers=num_moe_layers,
            prompt_tokens=prompt_tokens,
            seed=seed,
        )
        unions.append(modelled_union(groups, act, len(workers), batch, num_moe_layers))
    return ShadowResult(n, batch, unions[0], unions[1], source)


def per_token_activation(
    decode_counts: np.ndarray, num_moe_layers: int, top_k: int = 1
) -> np.ndarray:
    """Per request, P(a decode token activates each (layer, expert)) from its decode counts.

    decode_counts: flat [N, L * E]; a request's decode tokens = its largest layer total /
    top_k. Rows of zeros stay zero.
    """
    counts = np.asarray(decode_counts, dtype=np.float64)
    n = counts.shape[0]
    per_layer = counts.reshape(n, num_moe_layers, -1).sum(axis=2)
    tokens = per_layer.max(axis=1) / top_k
    return np.asarray(counts / np.maximum(tokens, 1e-12)[:, None], dtype=np.float64)


@dataclass(frozen=True)
class Verdict:
    promote: bool
    reason: str


def prefill_activation(
    prefill_counts: np.ndarray, num_moe_layers: int, top_k: int = 1, prior_tokens: float = 1.0
) -> np.ndarray:
    """A proxy for per-token decode activation from prefill counts [N, L * E] (requests
    without a decode summary): the prompt's smoothed routing frequencies, as the
    cost-aware router predicts them (`eldr.core.routing.activity.expert_demand`)."""
    rows = np.asarray(prefill_counts, dtype=np.float64)
    out = np.zeros_like(rows)
    for i, row in enumerate(rows):
        if np.any(row):
            out[i] = expert_demand(
                row.reshape(num_moe_layers, -1), top_k=top_k, prior_tokens=prior_tokens
            ).probability()
    return out


def promotion_verdict(
    result: ShadowResult | None,
    min_gain: float,
    *,
    forced: str = "",
    missing: str = "no shadow evaluation",
) -> Verdict:
    """Promote the candidate or keep the active version, and say why.

    `forced` (no active version; the live workers differ from the active version's)
    promotes without a gate. Without a shadow result the active version stays: `missing`
    says why there is none (e.g. too few held-out requests).
    """
    if forced:
        detail = "" if result is None else f" ({result.describe()})"
        return Verdict(True, f"promoted without a shadow gate: {forced}{detail}")
    if result is None:
        return Verdict(False, f"rejected: {missing}; the active version stays")
    change = result.change
    if not math.isfinite(change):
        return Verdict(True, f"promoted: shadow evaluation inconclusive ({result.describe()})")
    if change < -min_gain:
        return Verdict(True, f"promoted: {result.describe()}")
    need = "any reduction" if min_gain <= 0 else f"at least {100 * min_gain:.2f}% lower"
    return Verdict(False, f"rejected: {result.describe()}; promotion needs {need}")


# --- triggers ---------------------------------------------------------------------------


def refit_trigger(
    *,
    now_s: float,
    last_fit_s: float | None,
    interval_s: float,
    live: Sequence[str],
    active_workers: Sequence[str] | None,
    live_since_s: float,
    churn_settle_s: float,
    drift: DriftStatus | None,
    min_gap_s: float,
) -> str | None:
    """Why to refit now ("churn", "drift", "schedule"), or None.

    churn: the live workers differ from the active partition's and have not changed for
    `churn_settle_s` (several workers joining at once give one refit). drift: the monitor
    says so and the last fit is at least `min_gap_s` old. schedule: `interval_s` (> 0)
    since the last fit, or no fit yet.
    """
    since = math.inf if last_fit_s is None else now_s - last_fit_s
    if (
        active_workers is not None
        and live
        and set(live) != set(active_workers)
        and now_s - live_since_s >= churn_settle_s
    ):
        return "churn"
    if drift is not None and drift.drifted and since >= min_gap_s:
        return "drift"
    if interval_s > 0 and since >= interval_s:
        return "schedule"
    return None


def holdout_mask(request_ids: Sequence[str], fraction: float) -> np.ndarray:
    """bool per request: held out of the fit for the shadow gate and the drift baseline.

    Chosen by a hash of the request id (BLAKE2b), so the choice is the same in every
    process and at every refit: a request held out once is held out whenever it is in
    the window, and fits never see it.
    """
    if not 0 <= fraction < 1:
        raise ValueError(f"fraction must be in [0, 1), got {fraction}")
    threshold = round(fraction * (1 << 32))
    out = np.zeros(len(request_ids), dtype=bool)
    for i, rid in enumerate(request_ids):
        digest = hashlib.blake2b(rid.encode(), digest_size=4, person=b"eldr-holdout").digest()
        out[i] = int.from_bytes(digest, "big") < threshold
    return out
