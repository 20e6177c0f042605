"""The modelled decode effect of a set of assignments: expected expert union per step and
modelled TPOT, before and after a what-if.

Where decode summaries were recorded, each worker's batch is sampled every `sample_s`
seconds: the profiled requests in flight on it. A request's decode summary gives p[l, e] =
counts[l, e] / tokens, the chance that one of its tokens routes to expert e at MoE layer l;
the expected number of distinct experts a step streams is sum over (l, e) of 1 - prod over
the batch of (1 - p[l, e]) (tokens drawn independently from their requests' summaries:
`eldr.core.routing.activity.expected_union`, the one model of a batch's union that the
router and the trainer's shadow gate use too). The cost model (`eldr.core.costmodel`) turns
that union and the batch's KV tokens into a step time; a request's modelled TPOT is the mean
step time of its worker over its lifetime. Requests without a summary are not in the
modelled batches.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from eldr.core.costmodel import Deployment
from eldr.core.routing.activity import expected_union
from eldr.wire import Decision, DecodeSummary

MAX_SAMPLES = 4000
"""Upper bound on batch samples of the decode model (its cost is samples x workers)."""


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
    """TPOT P50 the decode workers themselves measured (summaries' `tpot_s`), if any."""
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


def model_decode_effect(
    decisions: Sequence[Decision],
    summaries: dict[str, DecodeSummary],
    before: Sequence[str],
    after: Sequence[str],
    cost: Deployment | None,
    sample_s: float | None = None,
) -> ModelledEffect:
    """Expected expert union per step and modelled TPOT, before and after (module doc)."""
    notes: list[str] = []
    items = [
        (i, d, summaries[d.request_id])
        for i, d in enumerate(decisions)
        if d.request_id in summaries
        and summaries[d.request_id].tokens > 0
        and summaries[d.request_id].ts_s > d.ts_s
    ]
    shapes = Counter(tuple(p.counts.shape) for _, _, p in items)
    if len(shapes) > 1:
        shape, _ = shapes.most_common(1)[0]
        notes.append(f"summaries of {len(shapes)} geometries: only {shape[0]}x{shape[1]} modelled")
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
            f"deployment {cost.name} is for {cost.model.num_moe_layers}x"
            f"{cost.model.num_experts} experts, the summaries have {n_layers}x{n_experts}: "
            "unions are counted in the summaries' geometry, bytes per expert are the deployment's"
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
    cost: Deployment | None,
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
