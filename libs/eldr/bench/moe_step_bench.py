"""`eldr bench-moe-step`: measure one MoE layer's decode step on a GPU and fit the cost model.

The cost model charges each distinct (MoE layer, expert) pair of a decode step its weight
bytes over HBM bandwidth (docs/COST_MODEL.md). This benchmark measures what an activated
expert really costs in a grouped-GEMM MoE kernel, the way serving engines run decode:

`measure` (needs torch; Triton for the default kernel; runs on the GPU machine, no vLLM)
    for the MoE layer shapes of the profiles in deployments.toml (Qwen3-30B-A3B BF16,
    GPT-OSS-120B MXFP4, Gemma-4-26B-A4B BF16, Llama-4-Maverick FP8 experts as one
    tensor-parallel eighth), batches of 1-64 tokens and a controlled number of distinct
    experts per layer (top-k up to batch x top-k), times one MoE layer forward (router
    output given) with CUDA events after warm-up: many repetitions, each after an L2 flush,
    median and spread. It also times the layer's dense part (the attention projections) at
    each batch and the routing bookkeeping (tokens sorted by expert, blocks padded per
    expert). It writes the raw table as JSON, with its provenance (GPU, driver, torch and
    Triton versions, date, command).
`fit` (numpy only; runs anywhere)
    per profile, least squares of step time = a + b x distinct experts, and
    a + b x distinct experts + c x tokens (kept when the data says so: |t| >= 3 and 10%
    less residual), with the residuals; compares b with bytes per expert / bandwidth from
    the datasheet; optionally writes measured deployments (`<profile>-measured`,
    `<profile>-measured-kernels`) with their provenance into `measured_deployments.toml`,
    which `eldr bench --whatif` reads beside the spec-derived deployments.

This module is the pure part (shapes, sweep, routing construction, table I/O, fit, profile
emission) and imports only the standard library at import time, so that `python -m
eldr.bench.cli bench-moe-step measure` runs with nothing but torch on the GPU machine; the
torch side is `moe_step_torch.py`, the Triton kernel `moe_step_triton.py`, the command line
`eldr.bench.cli`.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eldr.errors import InputError

__all__ = [
    "SHAPES",
    "FitReport",
    "LinearFit",
    "MoeShape",
    "controlled_routing",
    "distinct_expert_counts",
    "fit_table",
    "measured_deployment_tables",
    "read_table",
    "render_deployments_toml",
    "summarize_samples",
    "write_measured_deployments",
    "write_table",
]

TABLE_SCHEMA = 1
# Bits per weight parameter as stored by each format (MXFP4: 4-bit values plus one 8-bit
# scale per 32 values; FP8: the per-output-channel float32 scales are counted separately).
WEIGHT_BITS: dict[str, float] = {"bf16": 16.0, "fp8": 8.0, "mxfp4": 4.25}
DEFAULT_BATCHES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
MEASURED_SUFFIX = "-measured"
KERNELS_SUFFIX = "-measured-kernels"
# The token term is kept only when it is this many standard errors from zero and cuts the
# RMS residual by at least this fraction.
TOKEN_TERM_MIN_T = 3.0
TOKEN_TERM_MIN_RMS_CUT = 0.10


@dataclass(frozen=True)
class MoeShape:
    """One MoE layer as one GPU of its decode worker holds it.

    expert_ffn and the attention dims are per GPU (a tensor-parallel slice when tp > 1);
    hidden is the full model width. The expert's gate and up projections are one
    [2 x expert_ffn, hidden] matrix, its down projection [hidden, expert_ffn].
    """

    profile: str
    hidden: int
    expert_ffn: int
    num_experts: int
    top_k: int
    weight_format: str
    tp: int
    q_dim: int
    kv_dim: int
    note: str = ""

    def __post_init__(self) -> None:
        if self.weight_format not in WEIGHT_BITS:
            raise ValueError(f"{self.profile}: unknown weight format {self.weight_format!r}")
        if self.weight_format == "mxfp4" and (self.hidden % 32 or self.expert_ffn % 32):
            raise ValueError(f"{self.profile}: MXFP4 needs hidden and expert_ffn divisible by 32")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"{self.profile}: need 0 < top_k <= num_experts")

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.expert_ffn

    @property
    def expert_bytes(self) -> float:
        """Weight bytes one activated expert streams on this GPU."""
        stored = self.expert_params * WEIGHT_BITS[self.weight_format] / 8.0
        if self.weight_format == "fp8":
            stored += 4.0 * (2 * self.expert_ffn + self.hidden)  # float32 channel scales
        return stored

    @property
    def attention_params(self) -> int:
        """Q, K, V and output projections of one layer on this GPU."""
        return self.hidden * (self.q_dim + self.kv_dim) + self.q_dim * self.hidden

    @property
    def attention_bytes(self) -> float:
        return 2.0 * self.attention_params  # BF16

    def scaled(self, hidden: int, expert_ffn: int, num_experts: int) -> MoeShape:
        """A small copy of this shape (same format and top-k) for CPU tests."""
        return MoeShape(
            profile=self.profile,
            hidden=hidden,
            expert_ffn=expert_ffn,
            num_experts=num_experts,
            top_k=min(self.top_k, num_experts),
            weight_format=self.weight_format,
            tp=self.tp,
            q_dim=hidden,
            kv_dim=hidden // 2,
            note="tiny CPU copy",
        )


# The MoE layers of the deployments in deployments.toml (docs/COST_MODEL.md,
# "Model profiles"; tests/unit/bench/test_moe_step_bench.py checks them against the catalog).
# fmt: off
SHAPES: tuple[MoeShape, ...] = (
    MoeShape(
        "qwen3-30b-a3b-h200", hidden=2048, expert_ffn=768, num_experts=128, top_k=8,
        weight_format="bf16", tp=1, q_dim=32 * 128, kv_dim=2 * 4 * 128,
    ),
    MoeShape(
        "gpt-oss-120b-h200", hidden=2880, expert_ffn=2880, num_experts=128, top_k=4,
        weight_format="mxfp4", tp=1, q_dim=64 * 64, kv_dim=2 * 8 * 64,
        note="SiLU-and-mul stands in for GPT-OSS's clamped SwiGLU; expert biases left out",
    ),
    MoeShape(
        "gemma-4-26b-a4b-h200", hidden=2816, expert_ffn=704, num_experts=128, top_k=8,
        weight_format="bf16", tp=1, q_dim=16 * 256, kv_dim=2 * 8 * 256,
        note="attention of the 25 sliding-window layers (8 KV heads of 256)",
    ),
    MoeShape(
        "llama4-maverick-fp8-8xh200", hidden=5120, expert_ffn=8192 // 8, num_experts=128,
        top_k=1, weight_format="fp8", tp=8, q_dim=40 * 128 // 8, kv_dim=2 * 8 * 128 // 8,
        note="one GPU of TP8: experts and attention sliced 1/8; shared expert not timed",
    ),
)
# fmt: on


def shape_for(deployment: str) -> MoeShape:
    for shape in SHAPES:
        if shape.profile == deployment:
            return shape
    known = ", ".join(s.profile for s in SHAPES)
    raise ValueError(f"no MoE shape for deployment {deployment!r} (known: {known})")


def distinct_expert_counts(batch: int, top_k: int, num_experts: int, points: int = 6) -> list[int]:
    """Distinct-expert counts to time at `batch` tokens: top_k up to min(batch x top_k, E).

    Both ends and up to `points` values spaced geometrically between them.
    """
    if batch < 1 or points < 1:
        raise ValueError("batch and points must be positive")
    low, high = top_k, min(batch * top_k, num_experts)
    if points == 1 or high == low:
        return sorted({low, high})
    ratio = (high / low) ** (1.0 / (points - 1))
    return sorted({low, high, *(round(low * ratio**i) for i in range(1, points - 1))})


def controlled_routing(
    batch: int, top_k: int, distinct: int, num_experts: int, seed: int
) -> list[list[int]]:
    """Router output for `batch` tokens that activates exactly `distinct` experts.

    Each token gets `top_k` different experts; the `distinct` experts (a seeded random
    choice) are dealt round-robin over the batch x top_k slots, so every one is used and
    their token counts differ by at most one.
    """
    if not top_k <= distinct <= min(batch * top_k, num_experts):
        raise ValueError(
            f"distinct experts must be in [top_k, min(batch x top_k, experts)] = "
            f"[{top_k}, {min(batch * top_k, num_experts)}], got {distinct}"
        )
    import random

    chosen = random.Random(seed).sample(range(num_experts), distinct)
    return [[chosen[(t * top_k + j) % distinct] for j in range(top_k)] for t in range(batch)]


def summarize_samples(samples_s: Sequence[float]) -> dict[str, float]:
    """Median and spread of timed repetitions (seconds)."""
    if not samples_s:
        raise ValueError("no samples")
    xs = sorted(samples_s)

    def quantile(q: float) -> float:
        pos = q * (len(xs) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return {
        "median_s": statistics.median(xs),
        "p10_s": quantile(0.10),
        "p90_s": quantile(0.90),
        "min_s": xs[0],
        "max_s": xs[-1],
        "mean_s": statistics.fmean(xs),
    }


# --- the raw table ------------------------------------------------------------------------

ROW_FIELDS: tuple[str, ...] = (
    "profile",
    "part",  # "moe" (the layer's expert computation), "dense" (attention projections),
    # "align" (routing bookkeeping: tokens sorted by expert, blocks padded per expert)
    "kernel",
    "graph",
    "batch_tokens",
    "distinct_experts",
    "reps",
    "median_s",
    "p10_s",
    "p90_s",
    "min_s",
    "max_s",
    "mean_s",
)


def write_table(path: Path, table: dict[str, Any]) -> None:
    """Write a measurement table (provenance, shapes, rows) as JSON."""
    validate_table(table, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n", encoding="utf-8")


def read_table(path: Path) -> dict[str, Any]:
    try:
        table = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: not valid JSON ({exc})") from None
    validate_table(table, str(path))
    return dict(table)


def validate_table(table: Any, where: str) -> None:
    if not isinstance(table, dict) or table.get("schema") != TABLE_SCHEMA:
        raise InputError(f"{where}: not a moe-step table of schema {TABLE_SCHEMA}")
    for key in ("provenance", "shapes", "rows"):
        if key not in table:
            raise InputError(f"{where}: missing {key!r}")
    for i, row in enumerate(table["rows"]):
        missing = [f for f in ROW_FIELDS if f not in row]
        if missing:
            raise InputError(f"{where}: row {i} lacks {missing}")


# --- the fit --------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinearFit:
    """Least squares of the median layer time on [1, distinct experts (, tokens)]."""

    terms: tuple[str, ...]
    coef_s: tuple[float, ...]
    stderr_s: tuple[float, ...]
    rms_residual_s: float
    max_abs_residual_s: float
    r2: float
    residuals_s: tuple[float, ...]

    def coefficient(self, term: str) -> float:
        return self.coef_s[self.terms.index(term)] if term in self.terms else 0.0

    def t_value(self, term: str) -> float:
        i = self.terms.index(term)
        return self.coef_s[i] / self.stderr_s[i] if self.stderr_s[i] > 0 else math.inf


def least_squares(y_s: Sequence[float], columns: dict[str, Sequence[float]]) -> LinearFit:
    """y = X beta by least squares; X has an intercept column plus `columns`."""
    import numpy as np

    y = np.asarray(y_s, dtype=np.float64)
    terms = ("a", *columns)
    X = np.column_stack(
        [np.ones_like(y), *(np.asarray(c, dtype=np.float64) for c in columns.values())]
    )
    n, p = X.shape
    if n <= p:
        raise ValueError(f"need more than {p} points to fit {terms}, got {n}")
    beta, *_ = np.linalg.lstsq(X, y, rcond=None)
    resid = y - X @ beta
    dof = n - p
    sigma2 = float(resid @ resid) / dof
    cov = sigma2 * np.linalg.pinv(X.T @ X)
    total = float(((y - y.mean()) ** 2).sum())
    return LinearFit(
        terms=terms,
        coef_s=tuple(float(b) for b in beta),
        stderr_s=tuple(float(math.sqrt(max(v, 0.0))) for v in np.diag(cov)),
        rms_residual_s=float(np.sqrt(np.mean(resid**2))),
        max_abs_residual_s=float(np.max(np.abs(resid))),
        r2=1.0 - float(resid @ resid) / total if total > 0 else 1.0,
        residuals_s=tuple(float(r) for r in resid),
    )


@dataclass
class FitReport:
    """The fit of one profile's MoE rows and how it compares with the bandwidth model."""

    profile: str
    kernel: str
    points: list[tuple[int, int, float]]  # (batch tokens, distinct experts, median s)
    experts_only: LinearFit
    with_tokens: LinearFit | None
    token_term: bool
    expert_bytes: float
    datasheet_bytes_per_s: float
    achievable_bytes_per_s: float
    dense: list[tuple[int, float]] = field(default_factory=list)  # (batch, median s)
    attention_bytes: float = 0.0
    align: list[tuple[int, float]] = field(default_factory=list)

    @property
    def chosen(self) -> LinearFit:
        return self.with_tokens if self.token_term and self.with_tokens else self.experts_only

    @property
    def b_s(self) -> float:
        return self.chosen.coefficient("distinct_experts")

    @property
    def bandwidth_b_s(self) -> float:
        """Bytes per expert over the datasheet bandwidth: the cost model's b before its
        achievable fraction."""
        return self.expert_bytes / self.datasheet_bytes_per_s

    def as_dict(self) -> dict[str, Any]:
        chosen = self.chosen
        dense_median = statistics.median(t for _, t in self.dense) if self.dense else None
        return {
            "profile": self.profile,
            "kernel": self.kernel,
            "points": len(self.points),
            "token_term": self.token_term,
            "a_s": chosen.coefficient("a"),
            "b_s": self.b_s,
            "c_s": chosen.coefficient("batch_tokens"),
            "rms_residual_s": chosen.rms_residual_s,
            "max_abs_residual_s": chosen.max_abs_residual_s,
            "r2": chosen.r2,
            "experts_only": asdict(self.experts_only),
            "with_tokens": asdict(self.with_tokens) if self.with_tokens else None,
            "expert_bytes": self.expert_bytes,
            "b_datasheet_s": self.bandwidth_b_s,
            "b_achievable_s": self.expert_bytes / self.achievable_bytes_per_s,
            "b_over_datasheet": self.b_s / self.bandwidth_b_s if self.bandwidth_b_s else None,
            "expert_bytes_per_s": self.expert_bytes / self.b_s if self.b_s > 0 else None,
            "dense_attention_median_s": dense_median,
            "dense_attention_datasheet_s": self.attention_bytes / self.datasheet_bytes_per_s,
            "align_median_s": statistics.median(t for _, t in self.align) if self.align else None,
        }


def fit_profile(
    rows: Sequence[dict[str, Any]],
    deployment: str,
    kernel: str,
    *,
    expert_bytes: float,
    attention_bytes: float,
    datasheet_bytes_per_s: float,
    achievable_bytes_per_s: float,
) -> FitReport:
    """Fit one profile's `moe` rows of one kernel (medians), with and without tokens."""
    mine = [r for r in rows if r["profile"] == deployment]
    moe = sorted(
        (int(r["batch_tokens"]), int(r["distinct_experts"]), float(r["median_s"]))
        for r in mine
        if r["part"] == "moe" and r["kernel"] == kernel
    )
    if len(moe) < 3:
        raise ValueError(f"{deployment}/{kernel}: {len(moe)} moe rows, need at least 3 to fit")
    y = [t for _, _, t in moe]
    experts = [float(u) for _, u, _ in moe]
    tokens = [float(b) for b, _, _ in moe]
    only = least_squares(y, {"distinct_experts": experts})
    both: LinearFit | None = None
    keep = False
    # The token term needs tokens that vary independently of the experts.
    if len(moe) > 3 and len(set(tokens)) > 1:
        both = least_squares(y, {"distinct_experts": experts, "batch_tokens": tokens})
        c = both.coefficient("batch_tokens")
        keep = (
            c > 0
            and abs(both.t_value("batch_tokens")) >= TOKEN_TERM_MIN_T
            and both.rms_residual_s <= (1.0 - TOKEN_TERM_MIN_RMS_CUT) * only.rms_residual_s
        )
    return FitReport(
        profile=deployment,
        kernel=kernel,
        points=moe,
        experts_only=only,
        with_tokens=both,
        token_term=keep,
        expert_bytes=expert_bytes,
        datasheet_bytes_per_s=datasheet_bytes_per_s,
        achievable_bytes_per_s=achievable_bytes_per_s,
        dense=sorted(
            (int(r["batch_tokens"]), float(r["median_s"])) for r in mine if r["part"] == "dense"
        ),
        attention_bytes=attention_bytes,
        align=sorted(
            (int(r["batch_tokens"]), float(r["median_s"])) for r in mine if r["part"] == "align"
        ),
    )


def default_kernel(table: dict[str, Any]) -> str:
    """The table's grouped-GEMM kernel if it has one, else whatever it measured."""
    kernels = sorted({str(r["kernel"]) for r in table["rows"] if r["part"] == "moe"})
    if not kernels:
        raise ValueError("the table has no moe rows")
    return "triton" if "triton" in kernels else kernels[0]


def fit_table(
    table: dict[str, Any], kernel: str | None = None, catalog: Any = None
) -> list[FitReport]:
    """Fit every profile of a table against the catalog's datasheet bandwidths."""
    from eldr.data.deployments import load_catalog

    catalog = catalog if catalog is not None else load_catalog()
    kernel = kernel or default_kernel(table)
    shapes = {s["profile"]: s for s in table["shapes"]}
    reports = []
    for profile in sorted({r["profile"] for r in table["rows"] if r["kernel"] == kernel}):
        cost = catalog.get(profile)
        shape = MoeShape(**shapes[profile])
        reports.append(
            fit_profile(
                table["rows"],
                profile,
                kernel,
                expert_bytes=shape.expert_bytes,
                attention_bytes=shape.attention_bytes,
                datasheet_bytes_per_s=cost.gpu.hbm_bytes_per_s,
                achievable_bytes_per_s=cost.gpu.effective_bytes_per_s,
            )
        )
    return reports


def format_fits(reports: Sequence[FitReport], provenance: dict[str, Any]) -> str:
    lines = [
        f"device {provenance.get('gpu', '?')} (driver {provenance.get('driver', '?')}), "
        f"torch {provenance.get('torch', '?')}, triton {provenance.get('triton', '-')}, "
        f"{provenance.get('date', '?')}"
    ]
    if provenance.get("device_type") != "cuda":
        lines.append("NOT A GPU MEASUREMENT: these numbers are not to be reported")
    lines.append(
        f"{'profile':<28} {'kernel':<7} {'n':>3} {'a us':>8} {'b us':>8} {'c us':>7} "
        f"{'rms us':>7} {'r2':>6} {'bytes/bw us':>11} {'b/bw':>6} {'GB/s':>7}"
    )
    for r in reports:
        d = r.as_dict()
        gbps = d["expert_bytes_per_s"]
        ratio = d["b_over_datasheet"]
        lines.append(
            f"{r.profile:<28} {r.kernel:<7} {d['points']:>3} {d['a_s'] * 1e6:>8.2f} "
            f"{d['b_s'] * 1e6:>8.3f} {d['c_s'] * 1e6:>7.3f} {d['rms_residual_s'] * 1e6:>7.2f} "
            f"{d['r2']:>6.3f} {d['b_datasheet_s'] * 1e6:>11.3f} "
            f"{ratio if ratio is not None else math.nan:>6.2f} "
            f"{gbps / 1e9 if gbps else math.nan:>7.0f}"
        )
    return "\n".join(lines)


# --- measured deployments -------------------------------------------------------------------


def _gpu_key(catalog: Any, gpu: Any) -> str:
    for key, g in catalog.gpus.items():
        if g is gpu:
            return str(key)
    raise ValueError(f"gpu {gpu.name!r} not in the catalog")


def measured_deployment_tables(
    reports: Sequence[FitReport],
    provenance: dict[str, Any],
    *,
    table_ref: str,
    fit_command: str,
    catalog: Any = None,
    allow_gpu_mismatch: bool = False,
) -> dict[str, dict[str, Any]]:
    """The `[deployment.*]` tables of the measured deployments, two per fitted profile.

    `<profile>-measured`: the base profile with the expert term measured (expert_s = b;
    token_s = c x MoE layers when the token term was kept) and the base's overhead, which
    is the carried-over non-kernel time (scheduling, sampling, attention over the KV cache,
    collectives) that one layer's kernels do not show.
    `<profile>-measured-kernels`: the same with the overhead replaced by the measured fixed
    cost of the MoE kernels alone (a x MoE layers): what a step costs if nothing but the
    kernels measured here took time beyond the streamed bytes of the other parts.
    """
    from eldr.data.deployments import load_catalog

    catalog = catalog if catalog is not None else load_catalog()
    device = str(provenance.get("gpu", ""))
    if provenance.get("device_type") != "cuda" and not allow_gpu_mismatch:
        raise ValueError("the table was not measured on a GPU; refusing to write profiles")
    out: dict[str, dict[str, Any]] = {}
    for r in reports:
        base = catalog.get(r.profile)
        if base.measured:
            raise ValueError(f"{r.profile} is itself a measured profile")
        gpu_key = _gpu_key(catalog, base.gpu)
        if gpu_key.lower() not in device.lower() and not allow_gpu_mismatch:
            raise ValueError(
                f"{r.profile} is a {base.gpu.name} profile but the table was measured on "
                f"{device!r}; add a GPU and profile for that device instead"
            )
        model_key = next(k for k, m in catalog.models.items() if m is base.model)
        chosen = r.chosen
        b = r.b_s
        if b <= 0:
            raise ValueError(f"{r.profile}: fitted b = {b:.3g} s is not positive")
        a = chosen.coefficient("a")
        c = chosen.coefficient("batch_tokens") if r.token_term else 0.0
        moe_layers = base.model.num_moe_layers
        fit_text = (
            f"median MoE layer time = {a * 1e6:.3f} us + {b * 1e6:.4f} us x distinct experts"
            + (f" + {c * 1e6:.4f} us x tokens" if r.token_term else "")
            + f" over {len(r.points)} points (batch 1-{max(p[0] for p in r.points)}), "
            f"rms residual {chosen.rms_residual_s * 1e6:.3f} us, r2 {chosen.r2:.4f}; "
            f"bytes per expert / datasheet bandwidth = {r.bandwidth_b_s * 1e6:.4f} us "
            f"(b is {b / r.bandwidth_b_s:.2f}x that)"
        )
        prov = {
            "gpu": device,
            "driver": str(provenance.get("driver", "")),
            "torch": str(provenance.get("torch", "")),
            "triton": str(provenance.get("triton", "")),
            "cuda": str(provenance.get("cuda", "")),
            "date": str(provenance.get("date", "")),
            "command": str(provenance.get("command", "")),
            "fit_command": fit_command,
            "table": table_ref,
            "kernel": r.kernel,
            "fit": fit_text,
        }
        common = {
            "model": model_key,
            "gpu": gpu_key,
            "gpus_per_worker": base.gpus_per_worker,
            "expert_s": b,
        }
        if r.token_term:
            common["token_s"] = c * moe_layers
        out[r.profile + MEASURED_SUFFIX] = {
            **common,
            "overhead_s": base.overhead_s,
            "description": (
                f"{base.description}; expert term measured on {device} "
                f"({b * 1e6:.3f} us per distinct expert per layer), overhead as {r.profile}"
            ),
            "provenance": prov,
        }
        out[r.profile + KERNELS_SUFFIX] = {
            **common,
            "overhead_s": max(a, 0.0) * moe_layers,
            "description": (
                f"what-if: {r.profile} with the expert term and the MoE kernels' fixed cost "
                f"measured on {device} ({moe_layers} x {max(a, 0.0) * 1e6:.2f} us) in place "
                "of the carried-over overhead"
            ),
            "provenance": prov,
        }
    return out


_HEADER = """\
# Measured decode deployments, written by `eldr bench-moe-step fit --write-deployments` from
# the GPU microbenchmark `eldr bench-moe-step measure` (docs/COST_MODEL.md, "Measuring an MoE
# decode step"). Each [deployment.*] table names a model and GPU of deployments.toml, sets a
# measured `expert_s` (seconds per distinct (MoE layer, expert) pair of a step) and carries
# its provenance. Generated: re-run the fit instead of editing by hand.
"""


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"not a finite number: {value}")
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def render_deployments_toml(profiles: dict[str, dict[str, Any]]) -> str:
    """A measured-deployments file holding `profiles` (name -> table; one nested table each)."""
    lines = [_HEADER.rstrip("\n")]
    if not profiles:
        lines.append("#\n# No measurement yet.")
    lines += ["", "schema = 1"]
    for name in sorted(profiles):
        table = profiles[name]
        lines += ["", f"[deployment.{name}]"]
        nested = {k: v for k, v in table.items() if isinstance(v, dict)}
        for key, value in table.items():
            if key not in nested:
                lines.append(f"{key} = {_toml_value(value)}")
        for key, sub in nested.items():
            lines.append(f"[deployment.{name}.{key}]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in sub.items()]
    return "\n".join(lines) + "\n"


def packaged_measured_path() -> Path:
    import eldr.data
    from eldr.data.deployments import MEASURED_DEPLOYMENTS_FILE

    return Path(eldr.data.__file__).parent / MEASURED_DEPLOYMENTS_FILE


def write_measured_deployments(path: Path, profiles: dict[str, dict[str, Any]]) -> list[str]:
    """Add (or replace) `profiles` in the measured-deployments file at `path`; keep the others.

    Returns the names written. The result is checked by loading it with the spec catalog.
    """
    import tomllib

    from eldr.data.deployments import load_catalog

    existing: dict[str, dict[str, Any]] = {}
    if path.exists():
        existing = dict(tomllib.loads(path.read_text("utf-8")).get("deployment", {}))
    existing.update(profiles)
    text = render_deployments_toml(existing)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    try:
        load_catalog(measured_path=tmp)  # refuses clashes with the spec-derived deployments
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return sorted(profiles)


# --- command line ---------------------------------------------------------------------------


def tiny_shape(shape: MoeShape) -> MoeShape:
    return shape.scaled(hidden=64, expert_ffn=64, num_experts=16)
