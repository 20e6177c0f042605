"""`eldr bench --scenario drift|churn`: online refit and elastic decode pools, simulated.

Both scenarios replay recorded expert traces through the decode-cluster simulator
(`eldr.sim.cluster`). `OnlineRefitter` runs the trainer's own refit inside simulated time:
the trainer's state and refit plan (`eldr.core.training.refit`: window, triggers, drift
cut, hold-out, fit, shadow gate, verdict) under the shipped trainer's configuration
(`TrainerConfig`) with this scenario's knobs. Each routed request is a decision into its
window (a request id per arrival, as routers give every request its own), each finished
one its decode summary; the live workers are the simulator's; a promoted version reaches
the simulated routers `fit_delay_s` later. It holds no refit logic of its own.

- **drift**: the workload mix changes mid-run: the first half of the arrivals are one
  subject's requests, the second half another's. The partition starts fitted on the first
  subject's calibration requests. Compared on the second half (the paper's rule): the
  static partition, the online refitter, and two references fitted for the new subject
  beforehand (on its calibration split, out of sample; on the very requests replayed, in
  sample, the upper reference). Gain = expert-union reduction against the best load-only
  baseline over the second half; the refitter's recovered share = (gain online - gain
  static) / (gain reference - gain static), reported against both references.
- **churn**: decode workers leave and join mid-run. Checked for every policy: no request
  is routed to a worker after it left, and every worker that joined gets its first request
  within one refit interval; also the longest time any live worker went without a request.

Simulated times are seconds of the simulated cluster; "refit interval" is simulated too.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from eldr.bench.routing_bench import (
    BASELINES,
    Prepared,
    prepare,
)
from eldr.core.costmodel import Deployment
from eldr.core.partition.partition import Partition, fit_partition
from eldr.core.routing.pipeline import make_policy
from eldr.core.routing.profile import (
    DEFAULT_PROFILE,
    LOAD_ONLY_PROFILES,
    EldrCostProfile,
    ProfileBase,
)
from eldr.core.signature.sparse import SparseRow
from eldr.core.training.config import TrainerConfig
from eldr.core.training.online import DriftThresholds, partition_scores
from eldr.core.training.refit import RefitSkipped, TrainerState, plan_refit
from eldr.core.workload.sizing import rates_for_batch_targets
from eldr.core.workload.trace import TraceSet, counts_matrix
from eldr.data.deployments import DEFAULT_DEPLOYMENT_FOR_TRACES, load_catalog
from eldr.sim.cluster import (
    FleetEvent,
    ScoreUpdate,
    SimConfig,
    SimObservation,
    SimResult,
    simulate,
    worker_name,
)

log = logging.getLogger(__name__)

MODEL = "bench"
STATIC = "static partition"
ONLINE = "online refit"
REF_CAL = "reference (new subject, calibration split)"
REF_POOL = "reference (new subject, replayed requests)"
"""Rows of the locality profile (`OnlineConfig.locality`, the routers' default): with the
first partition throughout, refitted online by the trainer's plan, and with partitions
fitted for the new subject beforehand."""
NO_PARTITION = EldrCostProfile()
"""The row of a locality rule that needs no partition (the default before issue 21), for
what the partition adds."""


@dataclass(frozen=True)
class OnlineConfig:
    decoders: int = 16
    locality: ProfileBase = DEFAULT_PROFILE
    """The profile of the static, online and reference runs (the routers' default); the
    online run's shadow gate routes with it too, as the trainer routes with the routers'."""
    batch_target: float = 32.0
    """Per-worker batch the arrival rate is derived for (Little's law, as `eldr bench`)."""
    arrivals: int = 6000
    max_batch: int = 256
    calibration_fraction: float = 0.4
    deployment: str = DEFAULT_DEPLOYMENT_FOR_TRACES
    seed: int = 0
    refit_interval_s: float = 2.0
    """Scheduled refit period, simulated seconds."""
    tick_s: float = 0.25
    """How often the refitter looks at the traffic (drift and churn checks)."""
    window_s: float = 4.0
    """Rolling window: requests routed within this many simulated seconds."""
    min_samples: int = 16
    """Requests a refit needs in its window (and at least one per worker)."""
    fit_delay_s: float = 0.5
    """Simulated time from a refit's start to the routers using its result."""
    min_gain: float = 0.0
    """A candidate must lower the modelled union by more than this fraction."""
    holdout_fraction: float = 0.25
    """Share of the window's requests held out of a gated fit (by a hash of the request
    id): the shadow gate and the drift baseline are measured on them."""
    min_holdout: int = 32
    """Held-out requests the shadow gate needs (with decode summaries, else with prefill
    counts as a proxy); with fewer the candidate is rejected."""
    churn_settle_s: float = 0.25
    drift_min_gap_s: float = 1.0
    drift_fit_s: float = 1.0
    """A drift-triggered refit fits on the last this many seconds only (older traffic is
    what drifted away)."""
    drift: DriftThresholds = field(default_factory=lambda: DriftThresholds(min_samples=64))
    drift_window: int = 256
    drift_from: str | None = None
    drift_to: str | None = None
    """Subjects (labels) before and after the shift; default: the two largest."""

    def trainer_config(self) -> TrainerConfig:
        """The shipped trainer's configuration with this scenario's knobs (in simulated
        seconds); every other setting at the trainer's default."""
        return TrainerConfig(
            window_max_age_s=self.window_s,
            min_samples=self.min_samples,
            refit_interval_s=self.refit_interval_s,
            seed=self.seed,
            shadow_min_gain=self.min_gain,
            shadow_holdout_fraction=self.holdout_fraction,
            shadow_min_requests=self.min_holdout,
            shadow_batch=self.batch_target,
            routing_profile=self.locality,
            drift_window=self.drift_window,
            drift_min_samples=self.drift.min_samples,
            drift_max_similarity_drop=self.drift.max_similarity_drop,
            drift_max_skew_rise=self.drift.max_skew_rise,
            drift_min_gap_s=self.drift_min_gap_s,
            drift_fit_max_age_s=self.drift_fit_s,
            churn_settle_s=self.churn_settle_s,
        )


@dataclass
class RefitEvent:
    at_s: float
    trigger: str
    promoted: bool
    version: int | None
    reason: str
    n_train: int = 0
    n_holdout: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "at_s": round(self.at_s, 3),
            "trigger": self.trigger,
            "promoted": self.promoted,
            "version": self.version,
            "n_train": self.n_train,
            "n_holdout": self.n_holdout,
            "reason": self.reason,
        }


class OnlineRefitter:
    """The trainer's refit inside simulated time (a `SimController`; module docstring)."""

    def __init__(
        self,
        prepared: Prepared,
        initial: Partition,
        config: OnlineConfig,
        num_slots: int,
    ) -> None:
        self.config = config
        self.trainer = config.trainer_config()
        self.num_slots = num_slots
        geometry = prepared.traces.geometry
        assert prepared.prefill_counts is not None
        self.prefill = prepared.prefill_counts
        shape = (geometry.num_moe_layers, geometry.num_experts)
        self.prefill_rows = [SparseRow.from_dense(r.reshape(shape)) for r in self.prefill]
        decode = counts_matrix(prepared.traces.traces, geometry, "decode")
        self.decode_rows = [SparseRow.from_dense(r.reshape(shape)) for r in decode]
        self.state = TrainerState(self.trainer, mono_s=0.0)
        self.state.set_active(initial)
        self.state.restart_schedule(0.0)
        self.events: list[RefitEvent] = []

    @property
    def period_s(self) -> float:
        return self.config.tick_s

    def on_tick(self, obs: SimObservation) -> ScoreUpdate | None:
        state = self.state
        for arrival, req, t, slot in obs.arrivals:
            state.add_decision(f"a{arrival}", MODEL, worker_name(slot), self.prefill_rows[req], t)
        for arrival, req, t, _ in obs.finished:
            state.add_summary(f"a{arrival}", self.decode_rows[req], t)
        live = tuple(sorted(worker_name(i) for i in obs.live))
        due = state.due(now_s=obs.now_s, mono_s=obs.now_s, live=live, drift=state.drift_status())
        if due is None:
            return None
        trigger, _ = due
        state.restart_schedule(obs.now_s)
        try:
            selection = state.select(now_s=obs.now_s, live=live, k=None, trigger=trigger)
        except RefitSkipped as exc:
            self.events.append(RefitEvent(obs.now_s, trigger, False, None, f"skipped: {exc}"))
            return None
        result = plan_refit(selection, state.active, config=self.trainer, in_flight={})
        state.apply(result)
        self.events.append(
            RefitEvent(
                obs.now_s,
                trigger,
                result.promote,
                result.partition.version if result.promote else None,
                result.verdict.reason,
                result.report.n_train,
                result.n_held_out if result.shadow is None else result.shadow.n_eval,
            )
        )
        if not result.promote:
            return None
        names = [worker_name(i) for i in range(self.num_slots)]
        return ScoreUpdate(
            scores=partition_scores(result.partition, self.prefill, names),
            version=result.partition.version,
            delay_s=self.config.fit_delay_s,
        )


# --- shared ---------------------------------------------------------------------------


@dataclass
class _Setup:
    traces: TraceSet
    prepared: Prepared
    cost: Deployment
    rate: float
    prefill: np.ndarray
    decode: np.ndarray


def _setup(traces: TraceSet, config: OnlineConfig) -> _Setup:
    from eldr.bench.routing_bench import BenchConfig

    bench = BenchConfig(
        decoders=config.decoders,
        calibration_fraction=config.calibration_fraction,
        seed=config.seed,
    )
    prepared = prepare(traces, bench)
    cost = load_catalog().get(config.deployment)
    rate = rates_for_batch_targets(cost, traces, config.decoders, (config.batch_target,))[0]
    assert prepared.prefill_counts is not None
    decode = counts_matrix(traces.traces, traces.geometry, "decode")
    return _Setup(traces, prepared, cost, rate, prepared.prefill_counts, decode)


def _fit(setup: _Setup, idx: np.ndarray, workers: Sequence[str], seed: int) -> Partition:
    partition, _ = fit_partition(
        setup.prefill[idx],
        setup.decode[idx],
        setup.traces.geometry,
        list(workers),
        version=1,
        model=MODEL,
        seed=seed,
    )
    return partition


def _run(
    setup: _Setup,
    config: OnlineConfig,
    profile: ProfileBase,
    arrivals: np.ndarray,
    num_slots: int,
    *,
    partition: Partition | None = None,
    controller: OnlineRefitter | None = None,
    timeline: Sequence[FleetEvent] = (),
    initial: tuple[int, ...] | None = None,
) -> SimResult:
    policy = make_policy(profile)
    scores = None
    if partition is not None and policy.wants_scores:
        scores = partition_scores(
            partition, setup.prefill, [worker_name(i) for i in range(num_slots)]
        )
    geometry = setup.traces.geometry
    return simulate(
        setup.prepared.requests,
        arrivals,
        policy,
        setup.cost,
        SimConfig(
            num_workers=num_slots,
            arrival_rate_per_s=setup.rate,
            num_arrivals=int(arrivals.size),
            max_batch=config.max_batch,
            seed=config.seed,
            initial_workers=initial,
        ),
        num_moe_layers=geometry.num_moe_layers,
        union_slots=geometry.signature_dim,
        scores=scores,
        scores_version=partition.version if partition is not None else -1,
        demands=setup.prepared.demands(profile) if policy.uses_activity else None,
        timeline=timeline,
        controller=controller,
    )


def _window_stats(res: SimResult, start_s: float, end_s: float) -> dict[str, float]:
    """Union and TPOT of the steps / requests of [start, end) (requests by arrival)."""
    measured_from = res.assigned_s.size - res.tpot_s.size
    assigned = res.assigned_s[measured_from:]
    mask = (assigned >= start_s) & (assigned < end_s)
    tpot = res.tpot_s[mask]
    return {
        "union": round(res.union_between(start_s, end_s), 4),
        "tpot_p50_ms": round(float(np.percentile(tpot, 50) * 1e3), 4) if tpot.size else math.nan,
        "tpot_p99_ms": round(float(np.percentile(tpot, 99) * 1e3), 4) if tpot.size else math.nan,
        "requests": int(tpot.size),
    }


def _gain(union: float, baseline_union: float) -> float:
    """Expert-union reduction against the baseline, percent (positive: fewer experts)."""
    return round(100.0 * (baseline_union - union) / baseline_union, 3)


# --- drift ----------------------------------------------------------------------------


def run_drift(traces: TraceSet, config: OnlineConfig) -> dict[str, Any]:
    started = time.perf_counter()
    setup = _setup(traces, config)
    prepared = setup.prepared
    labels = np.array([t.label for t in traces.traces])
    by_size = sorted(set(labels.tolist()), key=lambda lab: (-int((labels == lab).sum()), lab))
    if len(by_size) < 2:
        raise ValueError("the drift scenario needs traces of at least two labels")
    src = config.drift_from or by_size[0]
    dst = config.drift_to or next(lab for lab in by_size if lab != src)
    cal, ev = prepared.calibration_idx, prepared.evaluation_idx
    cal_src, cal_dst = cal[labels[cal] == src], cal[labels[cal] == dst]
    ev_src, ev_dst = ev[labels[ev] == src], ev[labels[ev] == dst]
    half = config.arrivals // 2
    rng = np.random.default_rng([config.seed, 5])
    arrivals = np.concatenate(
        [
            ev_src[rng.integers(ev_src.size, size=half)],
            ev_dst[rng.integers(ev_dst.size, size=config.arrivals - half)],
        ]
    )
    W = config.decoders
    workers = [worker_name(i) for i in range(W)]
    static = _fit(setup, cal_src, workers, config.seed)
    ref_cal = _fit(setup, cal_dst, workers, config.seed)
    ref_pool = _fit(setup, ev_dst, workers, config.seed)

    runs: dict[str, SimResult] = {}
    for baseline in LOAD_ONLY_PROFILES:
        runs[baseline.name] = _run(setup, config, baseline, arrivals, W)
    runs[NO_PARTITION.name] = _run(setup, config, NO_PARTITION, arrivals, W)
    runs[STATIC] = _run(setup, config, config.locality, arrivals, W, partition=static)
    refitter = OnlineRefitter(prepared, static, config, W)
    runs[ONLINE] = _run(
        setup, config, config.locality, arrivals, W, partition=static, controller=refitter
    )
    runs[REF_CAL] = _run(setup, config, config.locality, arrivals, W, partition=ref_cal)
    runs[REF_POOL] = _run(setup, config, config.locality, arrivals, W, partition=ref_pool)
    res0 = runs[BASELINES[0]]
    shift_s = float(res0.assigned_s[half])
    end_s = float(res0.assigned_s[-1])
    warm_s = float(res0.assigned_s[res0.assigned_s.size - res0.tpot_s.size])
    phases = {"before": (warm_s, shift_s), "after": (shift_s, end_s + 1e-9)}
    rows: list[dict[str, Any]] = []
    for label, res in runs.items():
        row: dict[str, Any] = {"policy": label}
        for phase, (a, b) in phases.items():
            row[phase] = _window_stats(res, a, b)
        rows.append(row)
    by = {r["policy"]: r for r in rows}
    best_after = min(
        (by[b] for b in BASELINES),
        key=lambda r: (r["after"]["tpot_p50_ms"], r["after"]["tpot_p99_ms"]),
    )
    best_before = min(
        (by[b] for b in BASELINES),
        key=lambda r: (r["before"]["tpot_p50_ms"], r["before"]["tpot_p99_ms"]),
    )
    for r in rows:
        r["gain_before_pct"] = _gain(r["before"]["union"], best_before["before"]["union"])
        r["gain_after_pct"] = _gain(r["after"]["union"], best_after["after"]["union"])
    g_static = by[STATIC]["gain_after_pct"]
    g_online = by[ONLINE]["gain_after_pct"]
    # What the static partition lost: its own gain before the shift (the reading),
    # or what a partition fitted for the new subject gets after it (the references).
    reference_gain = {
        "vs_static_before_shift": by[STATIC]["gain_before_pct"],
        "vs_calibration_reference": by[REF_CAL]["gain_after_pct"],
        "vs_replayed_reference": by[REF_POOL]["gain_after_pct"],
    }
    recovered: dict[str, float | None] = {}
    for key, reference in reference_gain.items():
        lost = reference - g_static
        recovered[key] = round((g_online - g_static) / lost, 3) if lost > 0 else None
    lost_nothing = reference_gain["vs_static_before_shift"] <= g_static
    target = recovered["vs_static_before_shift"]
    summary = {
        "shift_at_s": round(shift_s, 3),
        "from": src,
        "to": dst,
        "best_baseline_after": best_after["policy"],
        "gain_after_pct": {r["policy"]: r["gain_after_pct"] for r in rows},
        "static_gain_before_pct": reference_gain["vs_static_before_shift"],
        "recovered_share": recovered,
        # With nothing lost there is nothing to recover: the refitter must only not lose.
        "static_lost_nothing": lost_nothing,
        "meets_target": (g_online >= g_static) if lost_nothing else bool(target and target >= 0.5),
        "refits": len(refitter.events),
        "promoted": sum(e.promoted for e in refitter.events),
        "first_promotion_after_shift_s": next(
            (
                round(e.at_s + config.fit_delay_s - shift_s, 3)
                for e in refitter.events
                if e.promoted and e.at_s >= shift_s
            ),
            None,
        ),
    }
    return {
        "scenario": "drift",
        "input": _input_info(traces, setup, config, arrivals.size),
        "rows": rows,
        "refits": [e.as_dict() for e in refitter.events],
        "summary": summary,
        "wall_s": round(time.perf_counter() - started, 2),
    }


# --- churn ----------------------------------------------------------------------------


def churn_timeline(config: OnlineConfig, duration_s: float) -> tuple[list[FleetEvent], int]:
    """Two workers leave at 25% of the run, two new ones join at 50%, at 75% one more
    leaves and another new one joins. Returns the events and the number of slots."""
    W = config.decoders
    if W < 4:
        raise ValueError("the churn scenario needs at least 4 decoders")
    leave_a, leave_b, leave_c = W // 5, (3 * W) // 4, W // 3
    events = [
        FleetEvent(0.25 * duration_s, leave=(leave_a, leave_b)),
        FleetEvent(0.50 * duration_s, join=(W, W + 1)),
        FleetEvent(0.75 * duration_s, join=(W + 2,), leave=(leave_c,)),
    ]
    return events, W + 3


def churn_checks(res: SimResult, end_s: float, interval_s: float) -> dict[str, Any]:
    """No request after a worker left; joiners' first request within one interval; the
    longest any live worker went without a request (also within one interval)."""
    after_leave = 0
    for slot, left in res.left_s.items():
        after_leave += int(((res.worker_of == slot) & (res.assigned_s >= left)).sum())
    first_after_join: dict[str, float | None] = {}
    for slot, joined in res.joined_s.items():
        times = res.assigned_s[(res.worker_of == slot) & (res.assigned_s >= joined)]
        first_after_join[worker_name(slot)] = (
            round(float(times.min() - joined), 4) if times.size else None
        )
    max_gap = 0.0
    for slot in range(int(res.worker_of.max()) + 1):
        start = res.joined_s.get(slot, 0.0)
        stop = res.left_s.get(slot, end_s)
        times = np.sort(res.assigned_s[res.worker_of == slot])
        times = times[(times >= start) & (times <= stop)]
        if slot not in res.joined_s and start == 0.0 and not times.size:
            continue  # never live
        points = np.concatenate([[start], times, [stop]])
        max_gap = max(max_gap, float(np.diff(points).max()))
    joined_ok = all(v is not None and v <= interval_s for v in first_after_join.values())
    return {
        "routed_to_departed": after_leave,
        "first_request_after_join_s": first_after_join,
        "max_gap_without_request_s": round(max_gap, 4),
        "meets_target": after_leave == 0 and joined_ok and max_gap <= interval_s,
    }


def run_churn(traces: TraceSet, config: OnlineConfig) -> dict[str, Any]:
    started = time.perf_counter()
    setup = _setup(traces, config)
    prepared = setup.prepared
    W = config.decoders
    rng = np.random.default_rng([config.seed, 6])
    ev = prepared.evaluation_idx
    arrivals = ev[rng.integers(ev.size, size=config.arrivals)]
    duration_s = config.arrivals / setup.rate
    timeline, slots = churn_timeline(config, duration_s)
    initial = tuple(range(W))
    partition = _fit(
        setup, prepared.calibration_idx, [worker_name(i) for i in initial], config.seed
    )
    runs: dict[str, SimResult] = {}
    for baseline in LOAD_ONLY_PROFILES:
        runs[baseline.name] = _run(
            setup, config, baseline, arrivals, slots, timeline=timeline, initial=initial
        )
    runs[NO_PARTITION.name] = _run(
        setup, config, NO_PARTITION, arrivals, slots, timeline=timeline, initial=initial
    )
    runs[STATIC] = _run(
        setup,
        config,
        config.locality,
        arrivals,
        slots,
        partition=partition,
        timeline=timeline,
        initial=initial,
    )
    refitter = OnlineRefitter(prepared, partition, config, slots)
    runs[ONLINE] = _run(
        setup,
        config,
        config.locality,
        arrivals,
        slots,
        partition=partition,
        controller=refitter,
        timeline=timeline,
        initial=initial,
    )
    res0 = runs[BASELINES[0]]
    end_s = float(res0.assigned_s[-1])
    warm_s = float(res0.assigned_s[res0.assigned_s.size - res0.tpot_s.size])
    rows: list[dict[str, Any]] = []
    for label, res in runs.items():
        rows.append(
            {
                "policy": label,
                "run": _window_stats(res, warm_s, end_s + 1e-9),
                "checks": churn_checks(res, end_s, config.refit_interval_s),
            }
        )
    best = min(
        (r for r in rows if r["policy"] in BASELINES),
        key=lambda r: (r["run"]["tpot_p50_ms"], r["run"]["tpot_p99_ms"]),
    )
    for r in rows:
        r["gain_pct"] = _gain(r["run"]["union"], best["run"]["union"])
    return {
        "scenario": "churn",
        "input": _input_info(traces, setup, config, arrivals.size),
        "timeline": [
            {
                "at_s": round(e.at_s, 3),
                "join": [worker_name(s) for s in e.join],
                "leave": [worker_name(s) for s in e.leave],
            }
            for e in timeline
        ],
        "rows": rows,
        "refits": [e.as_dict() for e in refitter.events],
        "summary": {
            "best_baseline": best["policy"],
            "meets_target": {r["policy"]: r["checks"]["meets_target"] for r in rows},
            "refit_interval_s": config.refit_interval_s,
        },
        "wall_s": round(time.perf_counter() - started, 2),
    }


# --- reporting ------------------------------------------------------------------------


def _input_info(
    traces: TraceSet, setup: _Setup, config: OnlineConfig, arrivals: int
) -> dict[str, Any]:
    return {
        "traces": traces.source,
        "synthetic": traces.synthetic,
        "requests": len(traces),
        "decoders": config.decoders,
        "rate": setup.rate,
        "batch_target": config.batch_target,
        "arrivals": arrivals,
        "cost_profile": setup.cost.name,
        "tau": config.locality.band_tau,
        "seed": config.seed,
        "refit_interval_s": config.refit_interval_s,
        "window_s": config.window_s,
        "tick_s": config.tick_s,
        "fit_delay_s": config.fit_delay_s,
        "min_gain": config.min_gain,
        "holdout_fraction": config.holdout_fraction,
    }


def format_report(result: dict[str, Any]) -> str:
    inp = result["input"]
    lines = [
        f"scenario {result['scenario']}: {inp['traces']} "
        f"({'SYNTHETIC' if inp['synthetic'] else 'real'} traces), {inp['decoders']} decoders, "
        f"{inp['rate']} req/s (batch ~{inp['batch_target']:g}), {inp['arrivals']} arrivals, "
        f"refit every {inp['refit_interval_s']:g} s (simulated), window {inp['window_s']:g} s",
    ]
    if result["scenario"] == "drift":
        s = result["summary"]
        lines.append(f"shift at {s['shift_at_s']} s: {s['from']} -> {s['to']}")
        lines.append("")
        lines.append(
            f"{'policy':<50} {'union before':>12} {'union after':>11} {'gain after':>10} "
            f"{'P50 after':>9} {'P99 after':>9}"
        )
        for r in result["rows"]:
            lines.append(
                f"{r['policy']:<50} {r['before']['union']:>12.3f} {r['after']['union']:>11.3f} "
                f"{r['gain_after_pct']:>9.2f}% {r['after']['tpot_p50_ms']:>9.3f} "
                f"{r['after']['tpot_p99_ms']:>9.3f}"
            )
    else:
        lines.append(
            "timeline: "
            + "; ".join(
                f"{e['at_s']} s +{','.join(e['join']) or '-'} -{','.join(e['leave']) or '-'}"
                for e in result["timeline"]
            )
        )
        lines.append("")
        lines.append(
            f"{'policy':<14} {'union':>7} {'gain':>7} {'P50 ms':>8} {'P99 ms':>8} "
            f"{'to departed':>11} {'max gap s':>9}  first request after join (s)"
        )
        for r in result["rows"]:
            c = r["checks"]
            lines.append(
                f"{r['policy']:<14} {r['run']['union']:>7.3f} {r['gain_pct']:>6.2f}% "
                f"{r['run']['tpot_p50_ms']:>8.3f} {r['run']['tpot_p99_ms']:>8.3f} "
                f"{c['routed_to_departed']:>11} {c['max_gap_without_request_s']:>9.3f}  "
                + json.dumps(c["first_request_after_join_s"])
            )
    lines.append("")
    lines.append("refits:")
    for e in result["refits"]:
        lines.append(
            f"  {e['at_s']:>7.3f} s {e['trigger']:<8} "
            f"{'v' + str(e['version']) if e['version'] else '-':<5} {e['reason']}"
        )
    lines.append("")
    lines.append("summary: " + json.dumps(result["summary"]))
    lines.append(f"wall time {result['wall_s']} s")
    return "\n".join(lines)
