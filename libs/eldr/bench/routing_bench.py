"""`eldr bench`: trace-driven comparison of routing policies on a simulated PD cluster.

The benchmark follows the paper's method on recorded expert traces:

1. split the requests (per label) into a calibration set and a disjoint evaluation pool;
2. fit the signature calibration (counts x IDF, greedy layer mask) and a balanced
   partition (one centroid per decode worker) on the calibration set only; the
   `decode_signature` row gets a partition fitted on the calibration set's *decode*
   profiles and routes each request by its true decode signature, which no router knows at
   routing time (what the prefill signature leaves on the table; not a bound);
3. for each arrival rate, replay one Poisson arrival sequence of evaluation requests
   through every policy in the discrete-event simulator (`eldr.sim.cluster`), where each
   decode step costs what the deployment says for the experts its batch really
   activated. Arrivals keep copies of one request apart (`eldr.core.workload.arrivals`): no
   request is drawn again while an earlier copy is still decoding, where the pool is large
   enough for the load; where it is not, the run says so and reports, per policy, the
   share of requests that decoded next to an identical copy on their worker;
4. on the same arrivals, an offline reference (`eldr.bench.reference`): the lowest
   union a local search finds over assignments that never load a worker more than the
   default policy's assignment does at that step, replayed through the simulator;
5. report per policy and rate TPOT P50/P95/P99, the mean number of distinct experts per
   MoE layer per step and per decode token, load imbalance and copies; and a summary row per
   batch target: the default policy ("eldr_cost", docs/ONLINE.md) and the paper's rule
   ("eldr") against the best load-only baseline *for each metric* (union against the
   lowest-union baseline, P50 against the best-P50 one, P99 against the best-P99 one, each
   named), and the share of the offline reference's union cut each reaches. The top-level
   summary keeps the highest rate at which no baseline saturates, with whether the default
   meets issue 8's bar (union at least 15% lower, TPOT P50 lower, P99 no higher).

6. again for the baselines, the default and the paper's rule, with the information a live
   router has (`eldr.sim.information.LIVE_DEFAULTS`: two router replicas, load reports
   every 100 ms, decisions and finishes seen after their hops), each against the best
   baseline under the same information, and each policy's change from perfect to live
   information: a policy that wins only with perfect information shows as such.

`--variants` adds the tail-safe variants studied (the paper's rule balancing KV tokens,
the load-bounded band, the cost-aware policy with a partition bonus); `--scenario drift`
and `--scenario churn` run the online benchmarks instead (`eldr.bench.online_bench`).

Arrival rates are derived from target batch sizes with Little's law and the deployment
(a rate at which a round-robin worker would hold about B requests), so that every cost
profile is exercised at comparable batch sizes; `--rates` sets them explicitly.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from eldr.bench.reference import LockstepModel
from eldr.core.costmodel import Deployment
from eldr.core.partition.kmeans import balanced_spherical_kmeans
from eldr.core.routing.activity import ExpertDemand, expert_demand
from eldr.core.routing.pipeline import FixedAssignment, Policy, make_policy
from eldr.core.routing.profile import (
    DEFAULT_PROFILE,
    LOAD_ONLY_PROFILES,
    PAPER_PROFILE,
    EldrBoundedProfile,
    EldrCostProfile,
    FixedAssignmentProfile,
    LoadMeasure,
    OracleProfile,
    ProfileBase,
    params_taken,
    profile_from_params,
)
from eldr.core.signature.signature import Calibration, fit_calibration
from eldr.core.stats import best_baselines
from eldr.core.workload.arrivals import (
    ArrivalDraw,
    copy_overlap,
    draw_apart,
    draw_with_replacement,
)
from eldr.core.workload.sizing import expected_step_s, rates_for_batch_targets, stratified_split
from eldr.core.workload.trace import TraceSet, counts_matrix
from eldr.data.deployments import DEFAULT_DEPLOYMENT_FOR_TRACES, load_catalog
from eldr.progress import NO_PROGRESS, Progress
from eldr.sim.cluster import (
    SimConfig,
    SimRequest,
    SimResult,
    flatten_decode_ids,
    poisson_arrival_times_s,
    simulate,
    worker_name,
)
from eldr.sim.information import LIVE_DEFAULTS, InformationModel
from eldr.sim.information import describe as describe_information

log = logging.getLogger(__name__)

BASELINES: tuple[str, ...] = tuple(p.name for p in LOAD_ONLY_PROFILES)
STATISTIC_KEYS: dict[str, str] = {
    "union": "expert_union_mean",
    "union_per_token": "expert_union_per_token",
    "tpot_p50": "tpot_p50_ms",
    "tpot_p99": "tpot_p99_ms",
}
"""The compared statistics (`core.stats.TIE_BREAKS`) -> their keys in a result row."""
DEFAULT_POLICY = DEFAULT_PROFILE.name
"""Row label of the routers' default profile."""
PAPER_POLICY = PAPER_PROFILE.name
"""Row label of the ELDR paper's rule."""
QUICK_BATCH_TARGETS: tuple[float, ...] = (8.0, 16.0, 32.0)
FULL_BATCH_TARGETS: tuple[float, ...] = (4.0, 8.0, 16.0, 32.0, 48.0)
SATURATION_QUEUED_SHARE = 0.01
"""A run is saturated when more than this share of requests waited for a batch slot."""
TARGET_UNION_PCT = -15.0
"""Issue 8's bar: the default policy's expert union at least this much below the best
load-only baseline's, with TPOT P50 lower and P99 no higher."""
LOCALITY_WEIGHT_VARIANT = 60.0
"""Partition bonus of the "eldr_cost+partition" variant, in expert loads per unit cosine
(about 2.5 per MoE layer for the 24-layer traces); a variant, not a default."""
PREVIOUS_DEFAULT = EldrCostProfile().name
"""The variant that was the routers' default before issue 21 (no partition)."""
DECODE_SIGNATURE = "decode_signature"
"""Row of the ELDR band rule fed each request's true decode signature against a partition
fitted on decode signatures (the core policy "oracle"): locality the prefill signature does
not see. Not a bound: the default policy beats it in most runs."""
REFERENCE = "reference"
"""Row of the offline reference: the best assignment the local search found from several
starts, replayed (`eldr.bench.reference`)."""
REFERENCE_STARTS: tuple[str, ...] = (DEFAULT_POLICY, PAPER_POLICY, DECODE_SIGNATURE)
"""Where the reference search starts: the default's, the paper rule's and the
decode-signature rule's assignments, and a random balanced one (`RANDOM_ROUNDS`)."""
RANDOM_ROUNDS = "random rounds"
"""The reference's random start: workers dealt in a random order, each once per round."""


@dataclass(frozen=True)
class BenchPolicy:
    """A policy as the benchmark runs it: a row label and the policy's profile."""

    label: str
    profile: ProfileBase


def profile_label(profile: ProfileBase) -> str:
    """A row label for a profile: its policy's name and what differs from that policy's
    defaults (e.g. "eldr_band_cost slack=0.1")."""
    defaults = type(profile)().params()
    changed = [
        f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
        for k, v in profile.params().items()
        if defaults.get(k) != v
    ]
    return " ".join([profile.name, ",".join(changed)]) if changed else profile.name


def policy_lineup(
    names: Sequence[str],
    overrides: Mapping[str, object],
    variants: bool,
    extra: Sequence[ProfileBase] = (),
) -> list[BenchPolicy]:
    """The policies of a run: `names` as given (their own label; DECODE_SIGNATURE is the
    oracle profile), each with the `overrides` it takes (`BenchConfig.overrides`), plus
    the variants, plus `extra` profiles as given (`profile_label`)."""

    def profile(name: str, **fixed: object) -> ProfileBase:
        return profile_from_params(name, {**params_taken(name, overrides), **fixed})

    out = [
        BenchPolicy(DECODE_SIGNATURE, profile(OracleProfile().name))
        if n in (DECODE_SIGNATURE, OracleProfile().name)
        else BenchPolicy(n, profile(n))
        for n in names
    ]
    if variants:
        out += [
            BenchPolicy(PREVIOUS_DEFAULT, profile(PREVIOUS_DEFAULT)),
            BenchPolicy("eldr@kv_tokens", profile(PAPER_POLICY, load_measure="kv_tokens")),
            BenchPolicy("eldr_bounded", profile(EldrBoundedProfile().name)),
            BenchPolicy(
                "eldr_cost+partition",
                profile(EldrCostProfile().name, locality_weight=LOCALITY_WEIGHT_VARIANT),
            ),
        ]
    taken = {bp.label for bp in out}
    for extra_profile in extra:
        label = profile_label(extra_profile)
        if label in taken:
            raise ValueError(f"profile {label!r} is already in the lineup")
        taken.add(label)
        out.append(BenchPolicy(label, extra_profile))
    return out


@dataclass(frozen=True)
class BenchConfig:
    decoders: int = 16
    tau: float | None = None
    """Band width of every band policy of the lineup; None: the profiles' own."""
    load_measure: LoadMeasure | None = None
    """Load measure of every policy of the lineup that takes one; None: the profiles'."""
    calibration_fraction: float = 0.4
    arrivals_per_rate: int = 3000
    max_batch: int = 256
    batch_targets: tuple[float, ...] = QUICK_BATCH_TARGETS
    rates: tuple[float, ...] | None = None
    deployment: str = DEFAULT_DEPLOYMENT_FOR_TRACES
    whatif_deployments: tuple[str, ...] = ()
    layer_selection: str = "greedy"
    transform: str = "idf"
    seed: int = 0
    policies: tuple[str, ...] = (*BASELINES, DEFAULT_POLICY, PAPER_POLICY, DECODE_SIGNATURE)
    variants: bool = False
    extra_profiles: tuple[ProfileBase, ...] = ()
    """Further profiles to run as given (`--add-profile`), labelled by `profile_label`."""
    arrivals_apart: bool = True
    """Keep copies of one request apart (False: draw with replacement, as before issue 17)."""
    reference: bool = True
    """Search the offline reference on the primary profile's arrivals (needs the default)."""
    information: InformationModel | None = LIVE_DEFAULTS
    """Also run the baselines, the default and the paper's rule with what a live router
    knows (primary profile only); None: perfect information only."""

    @property
    def overrides(self) -> dict[str, object]:
        """The profile parameters set for the whole lineup (`tau`, `load_measure`)."""
        pairs = (("tau", self.tau), ("load_measure", self.load_measure))
        return {k: v for k, v in pairs if v is not None}

    def lineup(self) -> list[BenchPolicy]:
        return policy_lineup(self.policies, self.overrides, self.variants, self.extra_profiles)


@dataclass
class Prepared:
    """Everything the simulations share: requests, signatures and partition scores."""

    traces: TraceSet
    calibration_idx: np.ndarray
    evaluation_idx: np.ndarray
    calibration: Calibration
    calibration_notes: dict[str, Any]
    requests: list[SimRequest]
    scores: np.ndarray  # [requests, decoders], prefill signature vs partition centroids
    oracle_scores: np.ndarray  # [requests, decoders], decode signature vs decode partition
    partition_info: dict[str, Any] = field(default_factory=dict)
    prefill_counts: np.ndarray | None = None  # float32 [requests, L * E]
    _demands: dict[tuple[int, float], list[ExpertDemand]] = field(default_factory=dict)

    def demands(self, profile: ProfileBase) -> list[ExpertDemand]:
        """Per request, its predicted per-step expert activation under `profile`'s demand
        model (top-k 0: the traces' own)."""
        geometry = self.traces.geometry
        top_k, prior = profile.demand_model
        top_k = top_k or geometry.top_k
        key = (top_k, prior)
        if key not in self._demands:
            assert self.prefill_counts is not None
            shape = (geometry.num_moe_layers, geometry.num_experts)
            self._demands[key] = [
                expert_demand(row.reshape(shape), top_k=top_k, prior_tokens=prior)
                for row in self.prefill_counts
            ]
        return self._demands[key]


def prepare(traces: TraceSet, config: BenchConfig) -> Prepared:
    """Split, calibrate signatures and fit the partitions (calibration split only)."""
    geometry = traces.geometry
    rng = np.random.default_rng(config.seed)
    cal, ev = stratified_split([t.label for t in traces.traces], config.calibration_fraction, rng)
    if cal.size < config.decoders:
        raise ValueError(
            f"calibration set has {cal.size} requests, fewer than {config.decoders} decoders"
        )
    prefill = counts_matrix(traces.traces, geometry, "prefill")
    decode = counts_matrix(traces.traces, geometry, "decode")
    calibration, report = fit_calibration(
        prefill[cal],
        decode[cal],
        geometry,
        transform=config.transform,
        layer_selection=config.layer_selection,
        rng=np.random.default_rng([config.seed, 2]),
    )
    signatures = calibration.apply(prefill)
    decode_signatures = calibration.apply(decode)
    fit = balanced_spherical_kmeans(signatures[cal], config.decoders, seed=config.seed)
    oracle_fit = balanced_spherical_kmeans(
        decode_signatures[cal], config.decoders, seed=config.seed
    )
    scores = (signatures @ fit.centroids.T).astype(np.float32)
    oracle_scores = (decode_signatures @ oracle_fit.centroids.T).astype(np.float32)
    requests = [
        SimRequest(
            request_id=t.request_id,
            label=t.label,
            prompt_tokens=t.prompt_tokens,
            decode_flat=flatten_decode_ids(t.decode, geometry.num_experts),
        )
        for t in traces.traces
    ]
    return Prepared(
        traces=traces,
        calibration_idx=cal,
        evaluation_idx=ev,
        calibration=calibration,
        calibration_notes={
            "transform": report.transform,
            "layer_selection": report.layer_selection_used,
            "kept_moe_layers": len(report.kept_layers),
            "of_moe_layers": geometry.num_moe_layers,
            "spearman_all_layers": _finite_or_none(report.all_layers_correlation),
            "spearman_chosen_mask": _finite_or_none(report.peak_correlation),
            "notes": list(report.notes),
        },
        requests=requests,
        scores=scores,
        oracle_scores=oracle_scores,
        prefill_counts=prefill,
        partition_info={
            "k": config.decoders,
            "cluster_size_max": int(fit.sizes.max()),
            "cluster_size_min": int(fit.sizes.min()),
            "capacity": fit.capacity,
            "inertia": round(float(fit.inertia), 4),
        },
    )


def _finite_or_none(x: float) -> float | None:
    return round(float(x), 4) if math.isfinite(x) else None


def draw_arrivals(
    prepared: Prepared, cost: Deployment, rate: float, config: BenchConfig
) -> ArrivalDraw:
    """Which evaluation request arrives when, for one rate (identical for every policy).

    Copies of one request are kept apart for their estimated decode time
    (`eldr.core.workload.arrivals`); with `arrivals_apart` off, requests are drawn with
    replacement.
    """
    arrival_s = poisson_arrival_times_s(rate, config.arrivals_per_rate, config.seed)
    pool = prepared.evaluation_idx
    tokens = np.array([r.decode_tokens for r in prepared.requests], dtype=np.float64)
    hold_s = tokens * expected_step_s(cost, prepared.traces, config.decoders, rate)
    draw = draw_apart if config.arrivals_apart else draw_with_replacement
    return draw(pool, hold_s, arrival_s, np.random.default_rng([config.seed, 3]))


def run_policy(
    prepared: Prepared,
    profile: ProfileBase,
    cost: Deployment,
    rate: float,
    config: BenchConfig,
    arrivals: np.ndarray,
    policy: Policy | None = None,
    information: InformationModel | None = None,
) -> SimResult:
    """Simulate one policy (`policy` overrides `profile`'s) on the given arrivals, with
    perfect information or `information`'s delays."""
    policy = policy or make_policy(profile)
    scores: np.ndarray | None = None
    if profile.scores_decode:
        scores = prepared.oracle_scores
    elif policy.wants_scores:
        scores = prepared.scores
    geometry = prepared.traces.geometry
    return simulate(
        prepared.requests,
        arrivals,
        policy,
        cost,
        SimConfig(
            num_workers=config.decoders,
            arrival_rate_per_s=rate,
            num_arrivals=int(arrivals.size),
            max_batch=config.max_batch,
            seed=config.seed,
        ),
        num_moe_layers=geometry.num_moe_layers,
        union_slots=geometry.signature_dim,
        scores=scores,
        demands=prepared.demands(profile) if policy.uses_activity else None,
        information=information,
    )


INFORMATION_POLICIES: tuple[str, ...] = (*BASELINES, DEFAULT_POLICY, PAPER_POLICY)
"""The policies `eldr bench` also runs with a live router's information."""
LIVE = "live"
PERFECT = "perfect"


def live_lineup(lineup: Sequence[BenchPolicy]) -> list[BenchPolicy]:
    """The lineup's policies that are run again with live information."""
    return [bp for bp in lineup if bp.label in INFORMATION_POLICIES]


def random_rounds(arrivals: int, workers: int, rng: np.random.Generator) -> np.ndarray:
    """A balanced assignment without locality: the workers dealt in a fresh random order
    every round of `workers` arrivals (each worker once per round)."""
    rounds = -(-arrivals // workers)
    order = np.concatenate([rng.permutation(workers) for _ in range(rounds)])
    return order[:arrivals].astype(np.int64)


def search_reference(
    prepared: Prepared,
    cost: Deployment,
    rate: float,
    config: BenchConfig,
    draw: ArrivalDraw,
    starts: Mapping[str, SimResult],
) -> tuple[SimResult, dict[str, Any]]:
    """The offline reference on these arrivals (`eldr.bench.reference`), simulated.

    Starts: the given policies' assignments (`REFERENCE_STARTS`) and a random balanced one
    (`RANDOM_ROUNDS`).
    Lockstep steps last the default's median TPOT. The ceiling at each step is the largest
    batch any start runs at that step, so every start meets it and the search can only
    improve on each (in the lockstep model); the reference is the best assignment found,
    replayed through the simulator like a policy.
    """
    started = time.perf_counter()
    default = starts[DEFAULT_POLICY]
    step_s = float(np.median(default.tpot_s))
    model = LockstepModel(
        [r.decode_flat for r in prepared.requests],
        draw.requests,
        draw.arrival_s,
        step_s,
        config.decoders,
        prepared.traces.geometry.signature_dim,
    )
    assignments = {label: res.worker_of for label, res in starts.items()}
    assignments[RANDOM_ROUNDS] = random_rounds(
        draw.requests.size, config.decoders, np.random.default_rng([config.seed, 7])
    )
    cap = np.max([model.batches(a).max(axis=0) for a in assignments.values()], axis=0)
    labels = list(assignments)
    found = model.search([assignments[k] for k in labels], cap)
    res = run_policy(
        prepared,
        FixedAssignmentProfile(),
        cost,
        rate,
        config,
        draw.requests,
        policy=FixedAssignment([worker_name(int(w)) for w in found.assignment]),
    )
    named = {f"start {i}": label for i, label in enumerate(labels)}
    info = {
        "ceiling": "per step, the largest batch any start runs at that step",
        "starts": labels,
        "best_start": named[found.start],
        "lockstep_step_ms": round(step_s * 1e3, 4),
        "lockstep_loads_start": {named[k]: v for k, v in found.start_loads.items()},
        "lockstep_loads_found": found.loads,
        "passes": found.passes,
        "moves": found.moves,
        "search_s": round(time.perf_counter() - started, 2),
    }
    return res, info


def _row(
    res: SimResult, label: str, params: dict[str, Any], deployment: str, draw: ArrivalDraw
) -> dict[str, Any]:
    measured_from = res.worker_of.size - res.tpot_s.size
    copies = copy_overlap(
        draw.requests, res.worker_of, res.assigned_s, res.finished_s, measured_from
    )
    tokens = float(res.batch_steps.sum())
    row: dict[str, Any] = {
        "policy": label,
        "profile": deployment,
        "rate": res.arrival_rate_per_s,
        "tpot_p50_ms": round(res.tpot_percentile_ms(50), 4),
        "tpot_p95_ms": round(res.tpot_percentile_ms(95), 4),
        "tpot_p99_ms": round(res.tpot_percentile_ms(99), 4),
        "expert_union_mean": round(res.expert_union_mean, 4),
        "expert_union_per_token": (
            round(float(res.union_per_layer_steps.sum()) / tokens, 5) if tokens else math.nan
        ),
        "batch_mean": round(res.batch_mean, 3),
        "imbalance": round(res.imbalance, 4),
        "queued_share": round(res.queued_share, 4),
        "saturated": res.queued_share > SATURATION_QUEUED_SHARE,
        "copies_in_flight_share": copies.in_flight_share,
        "copies_same_worker_share": copies.same_worker_share,
        "fallbacks": dict(res.fallbacks),
        "params": params,
    }
    if res.view_error.size:
        row["information"] = LIVE
        row["view_in_flight_error_mean"] = round(float(res.view_error.mean()), 4)
        if res.activity_excess.size:
            row["activity_excess_mean"] = round(float(res.activity_excess.mean()), 3)
    return row


def _spec_row(
    res: SimResult, bp: BenchPolicy, deployment: str, draw: ArrivalDraw
) -> dict[str, Any]:
    row = _row(res, bp.label, bp.profile.params(), deployment, draw)
    if bp.profile.band_tau is not None:
        row["tau"] = bp.profile.band_tau
    return row


def _paper(config: BenchConfig) -> ProfileBase:
    """The paper's rule with the run's overrides."""
    return profile_from_params(PAPER_POLICY, params_taken(PAPER_POLICY, config.overrides))


def _pct(new: float, base: float) -> float:
    return round(100.0 * (new - base) / base, 2)


def _share(base: float, policy: float, bound: float) -> float | None:
    """The policy's reduction from `base` as a share of the bound's (None: no reduction)."""
    if not bound < base:
        return None
    return round((base - policy) / (base - bound), 3)


def summarize_rate(
    rows: Sequence[dict[str, Any]],
    deployment: str,
    arrivals: dict[str, Any] | None = None,
    batch_target: float | None = None,
) -> dict[str, Any]:
    """One summary row: every non-baseline policy against the best baseline of each metric.

    Union (per step and per decode token) against the lowest-union baseline, TPOT P50
    against the best-P50 baseline, P99 against the best-P99 baseline, each named; the
    share of the offline reference's union cut (against the lowest-union baseline) each
    policy reaches; and the copies each policy put next to each other.
    """
    at = {r["policy"]: r for r in rows}
    rate = rows[0]["rate"] if rows else None
    baselines = [at[p] for p in BASELINES if p in at]
    out: dict[str, Any] = {"profile": deployment, "rate": rate}
    if batch_target is not None:
        out["batch_target"] = batch_target
    if not baselines:
        out["note"] = "no load-only baseline in the run"
        return out
    best = best_baselines(
        {r["policy"]: {stat: r[key] for stat, key in STATISTIC_KEYS.items()} for r in baselines},
        BASELINES,
    )
    p50, p99 = at[best["tpot_p50"]], at[best["tpot_p99"]]
    union, per_token = at[best["union"]], at[best["union_per_token"]]
    bound = at.get(REFERENCE)
    out.update(
        {
            "best_baseline": p50["policy"],  # by TPOT P50, as before
            "best_p50_baseline": p50["policy"],
            "best_p99_baseline": p99["policy"],
            "best_union_baseline": union["policy"],
            "best_union_per_token_baseline": per_token["policy"],
            "best_baseline_tpot_p50_ms": p50["tpot_p50_ms"],
            "best_baseline_tpot_p99_ms": p99["tpot_p99_ms"],
            "best_baseline_union": union["expert_union_mean"],
            "best_baseline_union_per_token": per_token["expert_union_per_token"],
            "baseline_saturated": any(r["saturated"] for r in baselines),
            "batch_mean": at.get(DEFAULT_POLICY, p50)["batch_mean"],
        }
    )
    if arrivals is not None:
        out["arrivals"] = arrivals

    def versus(e: dict[str, Any]) -> dict[str, Any]:
        v: dict[str, Any] = {
            "union_pct": _pct(e["expert_union_mean"], union["expert_union_mean"]),
            "union_per_token_pct": _pct(
                e["expert_union_per_token"], per_token["expert_union_per_token"]
            ),
            "tpot_p50_pct": _pct(e["tpot_p50_ms"], p50["tpot_p50_ms"]),
            "tpot_p99_pct": _pct(e["tpot_p99_ms"], p99["tpot_p99_ms"]),
            "imbalance": e["imbalance"],
            "copies_same_worker_share": e["copies_same_worker_share"],
        }
        if bound is not None and e is not bound:
            # The reference minimises the expert loads its arrivals' decode tokens stream
            # (union per token); union per step also moves with how requests are packed
            # into steps, which the search ignores: shares are of the per-token cut.
            v["share_of_reference"] = _share(
                per_token["expert_union_per_token"],
                e["expert_union_per_token"],
                bound["expert_union_per_token"],
            )
            v["share_of_reference_per_step"] = _share(
                union["expert_union_mean"], e["expert_union_mean"], bound["expert_union_mean"]
            )
        return v

    out["policies"] = {r["policy"]: versus(r) for r in rows if r["policy"] not in BASELINES}
    out["copies_same_worker_share"] = {r["policy"]: r["copies_same_worker_share"] for r in rows}
    out["copies_in_flight_share"] = {r["policy"]: r["copies_in_flight_share"] for r in rows}
    for key, label in (("default", DEFAULT_POLICY), ("eldr", PAPER_POLICY)):
        if label not in at:
            continue
        v = out["policies"][label]
        if key == "default":
            out["default_policy"] = label
        out[f"{key}_vs_best_baseline_tpot_p50_pct"] = v["tpot_p50_pct"]
        out[f"{key}_vs_best_baseline_tpot_p99_pct"] = v["tpot_p99_pct"]
        out[f"{key}_vs_best_baseline_union_pct"] = v["union_pct"]
        out[f"{key}_vs_best_baseline_union_per_token_pct"] = v["union_per_token_pct"]
        if "share_of_reference" in v:
            out[f"{key}_share_of_reference"] = v["share_of_reference"]
    if DEFAULT_POLICY in at:
        e = at[DEFAULT_POLICY]
        out["default_meets_target"] = bool(
            out["default_vs_best_baseline_union_pct"] <= TARGET_UNION_PCT
            and e["tpot_p50_ms"] < p50["tpot_p50_ms"]
            and e["tpot_p99_ms"] <= p99["tpot_p99_ms"]
        )
    named = (DEFAULT_POLICY, PAPER_POLICY, DECODE_SIGNATURE, REFERENCE)
    for label, v in out["policies"].items():
        if label not in named:
            out.setdefault("variants_vs_best_baseline", {})[label] = {
                k: v[k] for k in ("union_pct", "tpot_p50_pct", "tpot_p99_pct")
            }
    for label, key in ((DECODE_SIGNATURE, "decode_signature"), (REFERENCE, "reference")):
        if label in out["policies"]:
            out[f"{key}_vs_best_baseline_union_pct"] = out["policies"][label]["union_pct"]
    if bound is not None:
        # The reference is what it says only if no policy of the table gets below it.
        out["reference_beaten_by"] = sorted(
            r["policy"]
            for r in rows
            if r is not bound and r["expert_union_per_token"] < bound["expert_union_per_token"]
        )
    return out


def summarize(
    results: list[dict[str, Any]],
    deployment: str,
    arrivals_by_rate: dict[float, dict[str, Any]] | None = None,
    targets_by_rate: dict[float, float] | None = None,
    information: str = PERFECT,
) -> dict[str, Any]:
    """A summary row per rate (`by_target`), and at the top level the row of the highest
    rate at which no baseline saturates (the keys `eldr bench` has always reported).
    `information`: summarise the perfect-information rows or the live-information ones."""
    rows = [
        r
        for r in results
        if r["profile"] == deployment and r.get("information", PERFECT) == information
    ]
    rates = sorted({r["rate"] for r in rows})
    by_target = [
        summarize_rate(
            [r for r in rows if r["rate"] == rate],
            deployment,
            (arrivals_by_rate or {}).get(rate),
            (targets_by_rate or {}).get(rate),
        )
        for rate in rates
    ]
    ok = [s for s in by_target if "best_baseline" in s and not s["baseline_saturated"]]
    if not ok:
        return {
            "profile": deployment,
            "rate": None,
            "note": "every rate saturates a baseline",
            "by_target": by_target,
        }
    return {**ok[-1], "by_target": by_target}


def information_effect(results: Sequence[dict[str, Any]], deployment: str) -> list[dict[str, Any]]:
    """Per rate and policy run both ways: union, P50 and P99 with live information against
    the same policy with perfect information (percent; positive = worse live)."""
    perfect = {
        (r["rate"], r["policy"]): r
        for r in results
        if r["profile"] == deployment and r.get("information", PERFECT) == PERFECT
    }
    out = []
    for r in results:
        if r["profile"] != deployment or r.get("information") != LIVE:
            continue
        p = perfect.get((r["rate"], r["policy"]))
        if p is None:
            continue
        out.append(
            {
                "rate": r["rate"],
                "policy": r["policy"],
                "union_pct": _pct(r["expert_union_mean"], p["expert_union_mean"]),
                "tpot_p50_pct": _pct(r["tpot_p50_ms"], p["tpot_p50_ms"]),
                "tpot_p99_pct": _pct(r["tpot_p99_ms"], p["tpot_p99_ms"]),
                "imbalance_perfect": p["imbalance"],
                "imbalance_live": r["imbalance"],
                "view_in_flight_error_mean": r.get("view_in_flight_error_mean"),
                "activity_excess_mean": r.get("activity_excess_mean"),
            }
        )
    return out


def run_bench(
    traces: TraceSet, config: BenchConfig, progress: Progress = NO_PROGRESS
) -> dict[str, Any]:
    """Run the whole benchmark and return the JSON-ready result."""
    started = time.perf_counter()
    catalog = load_catalog()
    primary = catalog.get(config.deployment)
    progress.describe("calibrating")
    prepared = prepare(traces, config)
    deployments = [primary] + [catalog.get(name) for name in config.whatif_deployments]
    results: list[dict[str, Any]] = []
    rates_by_deployment: dict[str, list[float]] = {}
    arrivals_by_deployment: dict[str, dict[float, dict[str, Any]]] = {}
    targets_by_deployment: dict[str, dict[float, float]] = {}
    bound_info: dict[str, dict[str, Any]] = {}
    lineup = config.lineup()
    for cost in deployments:
        rates = (
            list(config.rates)
            if config.rates
            else rates_for_batch_targets(cost, traces, config.decoders, config.batch_targets)
        )
        rates_by_deployment[cost.name] = rates
        if not config.rates:
            targets_by_deployment[cost.name] = dict(zip(rates, config.batch_targets, strict=True))
        arrivals_by_deployment[cost.name] = {}
        for rate in rates:
            draw = draw_arrivals(prepared, cost, rate, config)
            arrivals_by_deployment[cost.name][rate] = draw.describe()
            starts: dict[str, SimResult] = {}
            for bp in lineup:
                progress.describe(f"{rate:.0f} req/s {bp.label}")
                res = run_policy(prepared, bp.profile, cost, rate, config, draw.requests)
                results.append(_spec_row(res, bp, cost.name, draw))
                if bp.label in REFERENCE_STARTS:
                    starts[bp.label] = res
                progress.advance()
                log.info(
                    "deployment=%s rate=%.1f policy=%s p50=%.3fms p99=%.3fms union=%.3f",
                    cost.name,
                    rate,
                    bp.label,
                    results[-1]["tpot_p50_ms"],
                    results[-1]["tpot_p99_ms"],
                    results[-1]["expert_union_mean"],
                )
            if cost is primary and config.information is not None:
                for bp in live_lineup(lineup):
                    progress.describe(f"{rate:.0f} req/s {bp.label} (live information)")
                    res = run_policy(
                        prepared,
                        bp.profile,
                        cost,
                        rate,
                        config,
                        draw.requests,
                        information=config.information,
                    )
                    results.append(_spec_row(res, bp, cost.name, draw))
                    progress.advance()
            if cost is primary and config.reference and DEFAULT_POLICY in starts:
                progress.describe(f"{rate:.0f} req/s reference")
                res, info = search_reference(prepared, cost, rate, config, draw, starts)
                row = _row(res, REFERENCE, {}, cost.name, draw)
                row["search"] = {k: v for k, v in info.items() if k != "search_s"}  # deterministic
                results.append(row)
                bound_info[str(rate)] = info
                progress.advance()
                log.info(
                    "deployment=%s rate=%.1f reference union=%.3f (%d moves, %.1f s)",
                    cost.name,
                    rate,
                    row["expert_union_mean"],
                    info["moves"],
                    info["search_s"],
                )
    geometry = traces.geometry
    return {
        "input": {
            "traces": traces.source,
            "synthetic": traces.synthetic,
            "requests": len(traces),
            "labels": traces.labels,
            "geometry": {
                "num_layers": geometry.num_layers,
                "num_moe_layers": geometry.num_moe_layers,
                "num_experts": geometry.num_experts,
                "top_k": geometry.top_k,
            },
            "calibration_requests": int(prepared.calibration_idx.size),
            "evaluation_requests": int(prepared.evaluation_idx.size),
            "signature": prepared.calibration_notes,
            "partition": prepared.partition_info,
            "decoders": config.decoders,
            "max_batch": config.max_batch,
            "arrivals_per_rate": config.arrivals_per_rate,
            "arrivals_apart": config.arrivals_apart,
            "arrivals_by_profile": {
                name: [{"rate": rate, **info} for rate, info in by_rate.items()]
                for name, by_rate in arrivals_by_deployment.items()
            },
            # What the lineup's band rules and load-balancing policies ran with.
            "tau": _paper(config).band_tau,
            "load_measure": _paper(config).measure,
            "policies": [bp.label for bp in lineup],
            "default_policy": DEFAULT_POLICY,
            "paper_policy": PAPER_POLICY,
            "seed": config.seed,
            "cost_profile": _deployment_info(primary),
            "whatif_profiles": [_deployment_info(p) for p in deployments[1:]],
            "rates_by_profile": rates_by_deployment,
            "reference": bound_info,
        },
        "rates": rates_by_deployment[primary.name],
        "results": results,
        "summary": summarize(
            results,
            primary.name,
            arrivals_by_deployment[primary.name],
            targets_by_deployment.get(primary.name),
        ),
        "whatif_summaries": [
            summarize(
                results, p.name, arrivals_by_deployment[p.name], targets_by_deployment.get(p.name)
            )
            for p in deployments[1:]
        ],
        **(
            {}
            if config.information is None
            else {
                "live_information": {
                    "model": config.information.as_dict(),
                    "description": describe_information(config.information),
                    "summary": summarize(
                        results,
                        primary.name,
                        arrivals_by_deployment[primary.name],
                        targets_by_deployment.get(primary.name),
                        information=LIVE,
                    ),
                    "versus_perfect": information_effect(results, primary.name),
                }
            }
        ),
        "wall_s": round(time.perf_counter() - started, 2),
    }


def bench_steps(config: BenchConfig, num_rates: int) -> int:
    """Units of work `run_bench` reports to its progress (simulations and searches)."""
    profiles = 1 + len(config.whatif_deployments)
    lineup = len(config.lineup())
    bound = 1 if config.reference and DEFAULT_POLICY in config.policies else 0
    live = 0
    if config.information is not None:
        live = len(live_lineup(config.lineup()))
    return num_rates * (profiles * lineup + bound + live)


def _deployment_info(cost: Deployment) -> dict[str, Any]:
    info: dict[str, Any] = {
        "name": cost.name,
        "model": cost.model.name,
        "gpu": cost.gpu.name,
        "gpus_per_worker": cost.gpus_per_worker,
        "overhead_ms": round(cost.overhead_s * 1e3, 3),
        "description": cost.description,
    }
    if cost.measured:  # spec-derived deployments keep exactly the keys above
        info["measured"] = {
            "expert_us": round(cost.expert_time_s * 1e6, 4),
            "bandwidth_expert_us": round(
                cost.model.expert_bytes / cost.worker_bytes_per_s * 1e6, 4
            ),
            "token_us": round(cost.token_s * 1e6, 4),
            "provenance": dict(cost.provenance),
        }
    return info


def _signed(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:+.{digits}f}%"


def format_summary(summary: dict[str, Any]) -> list[str]:
    """The per-target summary rows as text: each metric against its own best baseline."""
    lines = [
        f"summary ({summary['profile']}): each metric against the load-only baseline best "
        "at it; share = the policy's cut of the union per token / the reference's",
    ]
    for t in summary.get("by_target", []):
        if "best_baseline" not in t:
            lines.append(f"  rate {t['rate']}: {t.get('note', '')}")
            continue
        target = f"batch ~{t['batch_target']:g}, " if "batch_target" in t else ""
        arr = t.get("arrivals") or {}
        lines.append("")
        lines.append(
            f"  {target}{t['rate']:.1f} req/s (mean batch {t['batch_mean']:.1f})"
            + ("  [a baseline saturates]" if t["baseline_saturated"] else "")
        )
        if arr:
            if arr.get("apart"):
                lines.append(
                    f"    arrivals: no request drawn while a copy of it decodes (pool "
                    f"{arr['pool_requests']}, ~{arr['expected_in_flight']:.0f} in flight)"
                )
            else:
                why = (
                    f"pool of {arr['pool_requests']} distinct requests for "
                    f"~{arr['expected_in_flight']:.0f} in flight, "
                    f"{100 * arr['forced_share']:.2g}% of arrivals drawn while every request "
                    "of the pool was held"
                    if arr["method"] == "apart"
                    else f"drawn with replacement from {arr['pool_requests']} requests"
                )
                shares = ", ".join(
                    f"{k} {100 * v:.1f}%" for k, v in t["copies_same_worker_share"].items()
                )
                lines.append(
                    f"    COPIES IN FLIGHT: {why}; requests that decoded next to an identical "
                    f"copy on their worker: {shares}"
                )
        lines.append(
            f"    best baselines: union {t['best_union_baseline']} "
            f"{t['best_baseline_union']:.3f}/step, {t['best_union_per_token_baseline']} "
            f"{t['best_baseline_union_per_token']:.4f}/token; P50 {t['best_p50_baseline']} "
            f"{t['best_baseline_tpot_p50_ms']:.3f} ms; P99 {t['best_p99_baseline']} "
            f"{t['best_baseline_tpot_p99_ms']:.3f} ms"
        )
        lines.append(
            f"    {'policy':<20} {'union/step':>10} {'/token':>8} {'P50':>8} {'P99':>8} "
            f"{'share of ref':>14} {'imbal':>6} {'next to copy':>12}"
        )
        for label, v in t["policies"].items():
            share = v.get("share_of_reference")
            lines.append(
                f"    {label:<20} {_signed(v['union_pct']):>10} "
                f"{_signed(v['union_per_token_pct']):>8} {_signed(v['tpot_p50_pct'], 2):>8} "
                f"{_signed(v['tpot_p99_pct'], 2):>8} "
                f"{'-' if share is None else f'{100 * share:.0f}%':>14} {v['imbalance']:>6.2f} "
                f"{100 * v['copies_same_worker_share']:>11.1f}%"
            )
    return lines


def format_table(result: dict[str, Any]) -> str:
    """Human-readable report: input, per-rate table, per-target summary."""
    inp = result["input"]
    lines = [
        f"input: {inp['traces']} ({'SYNTHETIC' if inp['synthetic'] else 'real'} traces), "
        f"{inp['requests']} requests, calibration {inp['calibration_requests']} / "
        f"evaluation pool {inp['evaluation_requests']}, {inp['decoders']} decoders, "
        f"profile {inp['cost_profile']['name']} (overhead {inp['cost_profile']['overhead_ms']} ms)",
        f"signature: {inp['signature']['transform']}, "
        f"{inp['signature']['kept_moe_layers']}/{inp['signature']['of_moe_layers']} MoE layers; "
        f"partition: K={inp['partition']['k']}, sizes {inp['partition']['cluster_size_min']}-"
        f"{inp['partition']['cluster_size_max']} (cap {inp['partition']['capacity']})",
        "",
        f"{'profile':<36} {'rate':>7} {'policy':<20} {'P50 ms':>8} {'P95 ms':>8} "
        f"{'P99 ms':>8} {'union':>7} {'/token':>7} {'batch':>6} {'imbal':>6} {'copy':>6} "
        f"{'sat':>4}",
    ]
    for r in result["results"]:
        label = r["policy"] + (" [live]" if r.get("information") == LIVE else "")
        lines.append(
            f"{r['profile']:<36} {r['rate']:>7.1f} {label:<20} {r['tpot_p50_ms']:>8.3f} "
            f"{r['tpot_p95_ms']:>8.3f} {r['tpot_p99_ms']:>8.3f} {r['expert_union_mean']:>7.3f} "
            f"{r['expert_union_per_token']:>7.4f} {r['batch_mean']:>6.2f} "
            f"{r['imbalance']:>6.2f} {100 * r['copies_same_worker_share']:>5.1f}% "
            f"{'yes' if r['saturated'] else '':>4}"
        )
    lines.append(
        "(union: distinct experts per MoE layer per step; /token: per decode token; copy: "
        "requests that decoded next to an identical copy on their worker; [live]: with a "
        "live router's information)"
    )
    for s in [result["summary"], *result.get("whatif_summaries", [])]:
        lines.append("")
        lines.extend(format_summary(s))
    live = result.get("live_information")
    if live:
        lines.append("")
        lines.append(f"WITH LIVE INFORMATION ({live['description']}):")
        lines.extend(format_summary(live["summary"]))
        lines.append("  live against perfect information, same policy (positive = worse live):")
        lines.append(
            f"    {'rate':>7} {'policy':<14} {'union':>7} {'P50':>7} {'P99':>7} "
            f"{'imbal':>11} {'load error':>10} {'activity +':>10}"
        )
        for e in live["versus_perfect"]:
            act = e.get("activity_excess_mean")
            lines.append(
                f"    {e['rate']:>7.1f} {e['policy']:<14} {_signed(e['union_pct'], 2):>7} "
                f"{_signed(e['tpot_p50_pct'], 2):>7} {_signed(e['tpot_p99_pct'], 2):>7} "
                f"{e['imbalance_perfect']:>5.2f}>{e['imbalance_live']:<5.2f} "
                f"{e['view_in_flight_error_mean'] or 0:>10.2f} "
                f"{'-' if act is None else f'{act:.1f}':>10}"
            )
    lines.append(f"wall time {result['wall_s']} s")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """TPOT P50/P99 and expert union vs rate, one line per policy (primary deployment)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    deployment = result["input"]["cost_profile"]["name"]
    rows = [
        r
        for r in result["results"]
        if r["profile"] == deployment and r.get("information", PERFECT) == PERFECT
    ]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for policy in dict.fromkeys(r["policy"] for r in rows):
        pr = sorted((r for r in rows if r["policy"] == policy), key=lambda r: r["rate"])
        x = [r["rate"] for r in pr]
        style = "--" if policy in BASELINES else (":" if policy == REFERENCE else "-")
        axes[0].plot(x, [r["tpot_p50_ms"] for r in pr], style, marker="o", label=policy)
        axes[1].plot(x, [r["tpot_p99_ms"] for r in pr], style, marker="o", label=policy)
        axes[2].plot(x, [r["expert_union_mean"] for r in pr], style, marker="o", label=policy)
    for ax, title in zip(
        axes, ("TPOT P50 (ms)", "TPOT P99 (ms)", "distinct experts / MoE layer / step"), strict=True
    ):
        ax.set_xlabel("arrival rate (req/s)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend()
    synthetic = " [SYNTHETIC input]" if result["input"]["synthetic"] else ""
    fig.suptitle(f"eldr bench: {result['input']['traces']}, {deployment}{synthetic}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def robustness(summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Worst case over seeds of the default's and the paper rule's summary numbers, at the
    summary's rate and per batch target (by position in `by_target`)."""
    out: dict[str, Any] = {"seeds": len(summaries), **_worst(summaries)}
    met = [s.get("default_meets_target") for s in summaries]
    out["default_meets_target_every_seed"] = bool(met) and all(m is True for m in met)
    targets = min((len(s.get("by_target", [])) for s in summaries), default=0)
    out["by_target"] = [
        {
            "batch_target": summaries[0]["by_target"][i].get("batch_target"),
            "rates": [s["by_target"][i].get("rate") for s in summaries],
            **_worst([s["by_target"][i] for s in summaries]),
        }
        for i in range(targets)
    ]
    return out


def _worst(summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("default", "eldr"):
        rows = [s for s in summaries if f"{key}_vs_best_baseline_union_pct" in s]
        if not rows:
            continue
        out[key] = {
            "union_pct_worst": max(s[f"{key}_vs_best_baseline_union_pct"] for s in rows),
            "union_pct_mean": round(
                float(np.mean([s[f"{key}_vs_best_baseline_union_pct"] for s in rows])), 2
            ),
            "tpot_p50_pct_worst": max(s[f"{key}_vs_best_baseline_tpot_p50_pct"] for s in rows),
            "tpot_p99_pct_worst": max(s[f"{key}_vs_best_baseline_tpot_p99_pct"] for s in rows),
        }
        # Without the reference (`--no-reference`) no summary holds a share.
        shares = (
            [x for s in rows if (x := s[f"{key}_share_of_reference"]) is not None]
            if all(f"{key}_share_of_reference" in s for s in rows)
            else []
        )
        if shares:
            out[key]["share_of_reference_worst"] = min(shares)
    return out
