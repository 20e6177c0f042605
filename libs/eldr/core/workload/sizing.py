"""Sizing a benchmark's workload: the calibration split and the arrival rate for a batch.

Pure helpers shared by the routing benchmark, the online scenarios and the demo: which
requests calibrate (a stratified split by label) and at which arrival rate each decode
worker would hold about B requests (Little's law against the cost model).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from eldr.core.costmodel import Deployment, expected_uniform_union
from eldr.core.workload.trace import TraceSet


def stratified_split(
    labels: Sequence[str], fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Indices of a calibration set taking `fraction` of each label, and the rest."""
    if not 0 < fraction < 1:
        raise ValueError(f"calibration fraction must be in (0, 1), got {fraction}")
    by_label: dict[str, list[int]] = {}
    for i, lab in enumerate(labels):
        by_label.setdefault(lab, []).append(i)
    cal: list[int] = []
    for lab in sorted(by_label):
        idx = np.array(by_label[lab])
        rng.shuffle(idx)
        take = max(1, round(fraction * idx.size)) if idx.size > 1 else 0
        cal.extend(int(i) for i in idx[:take])
    cal_arr = np.array(sorted(cal), dtype=np.int64)
    ev_arr = np.setdiff1d(np.arange(len(labels)), cal_arr)
    if cal_arr.size == 0 or ev_arr.size == 0:
        raise ValueError("too few requests to split into calibration and evaluation sets")
    return cal_arr, ev_arr


def _step_s_at_batch(cost: Deployment, traces: TraceSet, batch: float) -> float:
    """Step time of a batch of `batch` uniformly routed tokens (an over-estimate of real,
    skewed unions) with the traces' mean KV length."""
    geometry = traces.geometry
    mean_decode = float(np.mean([t.decode_tokens for t in traces.traces]))
    mean_prompt = float(np.mean([t.prompt_tokens for t in traces.traces]))
    union = expected_uniform_union(geometry.num_experts, geometry.top_k, math.ceil(batch))
    kv = batch * (mean_prompt + mean_decode / 2.0)
    return cost.step_time_s(union * geometry.num_moe_layers, kv, batch)


def rates_for_batch_targets(
    cost: Deployment, traces: TraceSet, decoders: int, targets: Sequence[float]
) -> list[float]:
    """Arrival rates at which each worker would hold about B requests (Little's law).

    A request lasts mean_decode_tokens steps; a step with B requests costs what the cost
    model says for the union of B uniformly routed tokens (an over-estimate of real,
    skewed unions, so real batches come out slightly smaller). rate = B * W / duration.
    """
    mean_decode = float(np.mean([t.decode_tokens for t in traces.traces]))
    return [
        round(batch * decoders / (mean_decode * _step_s_at_batch(cost, traces, batch)), 1)
        for batch in targets
    ]


def expected_step_s(cost: Deployment, traces: TraceSet, decoders: int, rate: float) -> float:
    """The step time at the batch Little's law gives for `rate` (rates_for_batch_targets'
    estimate, inverted by fixed-point iteration)."""
    mean_decode = float(np.mean([t.decode_tokens for t in traces.traces]))
    batch = 1.0
    for _ in range(50):
        batch = max(1.0, rate * mean_decode * _step_s_at_batch(cost, traces, batch) / decoders)
    return _step_s_at_batch(cost, traces, batch)
