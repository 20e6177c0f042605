"""The torch side of `eldr bench-moe-step measure`: weights, routing, kernels, timing.

One MoE layer forward at decode, router output given, as serving engines run it:

1. routing bookkeeping (`align`, timed as its own part): the batch x top_k (token, expert)
   slots sorted by expert, each expert's run padded to a whole block of BLOCK_M rows, and
   the expert of every block; all on the device, no host synchronisation;
2. one grouped GEMM launch for the gate and up projections over all blocks (each block
   streams its expert's weight tiles; padding rows cost compute, not bytes), SiLU-and-mul,
   one grouped GEMM launch for the down projection scaled by the router weights, and the
   sum over each token's top_k slots (`moe_step_triton.py`; weights BF16, FP8 with
   per-channel scales, or MXFP4, dequantised in the kernel);

or, as a reference and CPU fallback, one matmul per activated expert (`loop`). The dense
part is the layer's attention projections at the same batch (two cuBLAS GEMMs through
`torch.nn.functional.linear`).

Timing on a GPU: warm-up, then each repetition after a write of an L2-sized flush buffer
(weights of one layer are never in L2 at decode: a step reads gigabytes), between two CUDA
events, the forward replayed through a CUDA graph as engines do at decode (falls back to
eager launches, recorded per row, if capture fails). On the CPU: `time.perf_counter`, for
the tests only. torch is imported when called: it is not a dependency of the project.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import importlib
import importlib.util
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from eldr.bench.moe_step_bench import (
    TABLE_SCHEMA,
    MoeShape,
    controlled_routing,
    distinct_expert_counts,
    summarize_samples,
)

__all__ = ["MeasureConfig", "MoeLayer", "measure"]

KERNELS = ("triton", "loop")
# Tiles of the grouped GEMM: BLOCK_M rows of padded (token, expert) slots per block; decode
# batches put few tokens on an expert, so 16 (the smallest tile tl.dot takes).
BLOCK_M = 16
BLOCK_N = 64
BLOCK_K = 128
NUM_WARPS = 4
NUM_STAGES = 3
CHECK_BATCH = 4
CHECK_MAX_REL_ERR = 3e-2


def _torch() -> Any:
    return importlib.import_module("torch")


@contextlib.contextmanager
def interpreter_env(active: bool) -> Iterator[None]:
    """TRITON_INTERPRET=1 while the block runs (CPU tensors), restored afterwards.

    Triton reads it when a kernel is decorated (at import of `moe_step_triton`) and again
    when an interpreted kernel runs; it is not left set, so that it does not leak into
    other code or child processes of the same interpreter.
    """
    if not active:
        yield
        return
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before


def triton_kernels(*, interpret: bool) -> Any:
    """The `moe_step_triton` module, its kernel built for the CPU interpreter if `interpret`.

    Triton settles interpreter mode when it is first imported: a process that imported
    Triton without TRITON_INTERPRET=1 cannot run the kernel on the CPU (set it before
    Python starts, as tests/vllm/test_moe_step_cpu.py does).
    """
    name = "eldr.bench.moe_step_triton"
    if (
        interpret
        and name not in sys.modules
        and "triton" in sys.modules
        and os.environ.get("TRITON_INTERPRET") != "1"
    ):
        raise RuntimeError(
            "triton was imported before TRITON_INTERPRET=1 was set: run with "
            "TRITON_INTERPRET=1 in the environment to use the Triton kernel on the CPU"
        )
    with interpreter_env(interpret):
        return importlib.import_module(name)


@dataclass(frozen=True)
class MeasureConfig:
    shapes: tuple[MoeShape, ...]
    batches: tuple[int, ...]
    points: int = 6
    reps: int = 100
    warmup: int = 10
    kernels: tuple[str, ...] = ()  # empty: triton on a GPU, loop on the CPU
    device: str = ""  # empty: cuda when available
    flush_mib: int = -1  # negative: 256 on a GPU, 0 on the CPU
    graph: bool = True
    check: bool = True
    seed: int = 0
    command: str = ""

    def __post_init__(self) -> None:
        if self.reps < 1 or self.warmup < 0 or self.points < 1:
            raise ValueError("reps and points must be positive, warmup non-negative")
        if any(b < 1 for b in self.batches) or not self.batches:
            raise ValueError("batches must be positive")
        unknown = set(self.kernels) - set(KERNELS)
        if unknown:
            raise ValueError(f"unknown kernels {sorted(unknown)} (known: {', '.join(KERNELS)})")


# --- weights ------------------------------------------------------------------------------


def _e2m1_values(torch: Any, device: Any) -> Any:
    """The 16 FP4 (E2M1) code points, indexed by their 4-bit code."""
    magnitudes = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    return torch.tensor(magnitudes + [-m for m in magnitudes], device=device)


class ExpertMatrix:
    """One stacked expert weight [E, N, K] in a storage format, with its dequantisation.

    bf16: `weight` in the activation dtype (BF16 on a GPU); fp8: `weight` uint8 bits of
    float8_e4m3fn plus float32 `scale` [E, N]; mxfp4: `weight` uint8 [E, N, K / 2], two
    E2M1 codes per byte (low nibble first), plus uint8 E8M0 `scale` [E, N, K / 32].
    """

    def __init__(
        self, fmt: str, e: int, n: int, k: int, dtype: Any, device: Any, seed: int
    ) -> None:
        torch = _torch()
        self.fmt, self.n, self.k, self.dtype = fmt, n, k, dtype
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        std = 1.0 / math.sqrt(k)
        chunk = max(1, (1 << 28) // max(1, n * k))  # experts per chunk: <= 256M values
        if fmt == "bf16":
            self.weight = torch.empty((e, n, k), dtype=dtype, device=device)
            for lo in range(0, e, chunk):
                hi = min(e, lo + chunk)
                self.weight[lo:hi] = torch.randn(
                    (hi - lo, n, k), generator=gen, device=device, dtype=torch.float32
                ).mul_(std)
            self.scale = self.weight  # unused by the kernel
        elif fmt == "fp8":
            self.weight = torch.empty((e, n, k), dtype=torch.uint8, device=device)
            for lo in range(0, e, chunk):
                hi = min(e, lo + chunk)
                w = torch.randn((hi - lo, n, k), generator=gen, device=device)
                self.weight[lo:hi] = w.to(torch.float8_e4m3fn).view(torch.uint8)
            self.scale = torch.full((e, n), std, dtype=torch.float32, device=device)
        elif fmt == "mxfp4":
            self.weight = torch.randint(
                0, 256, (e, n, k // 2), generator=gen, device=device, dtype=torch.uint8
            )
            # Scales 2^-7 .. 2^-4: with E2M1 values of at most 6, weights of order 1/sqrt(K).
            self.scale = torch.randint(
                120, 124, (e, n, k // 32), generator=gen, device=device, dtype=torch.uint8
            )
        else:
            raise ValueError(f"unknown weight format {fmt!r}")

    @property
    def bytes(self) -> int:
        extra = 0 if self.fmt == "bf16" else self.scale.numel() * self.scale.element_size()
        return int(self.weight.numel() * self.weight.element_size() + extra)

    def dense(self, expert: int) -> Any:
        """Expert `expert`'s weight [N, K] in the activation dtype (reference path)."""
        torch = _torch()
        if self.fmt == "bf16":
            return self.weight[expert]
        if self.fmt == "fp8":
            w = self.weight[expert].view(torch.float8_e4m3fn).to(torch.float32)
            return (w * self.scale[expert][:, None]).to(self.dtype)
        codes = self.weight[expert]
        lut = _e2m1_values(torch, codes.device)
        values = torch.stack([lut[(codes & 15).long()], lut[(codes >> 4).long()]], dim=-1)
        values = values.reshape(self.n, self.k)
        scale = torch.exp2(self.scale[expert].to(torch.float32) - 127.0)
        return (values * scale.repeat_interleave(32, dim=1)).to(self.dtype)


class MoeLayer:
    """One MoE layer's experts (all E of them, as a real layer holds) and attention weights."""

    def __init__(self, shape: MoeShape, dtype: Any, device: Any, seed: int) -> None:
        torch = _torch()
        self.shape, self.dtype, self.device = shape, dtype, device
        e, h, i = shape.num_experts, shape.hidden, shape.expert_ffn
        self.w13 = ExpertMatrix(shape.weight_format, e, 2 * i, h, dtype, device, seed)
        self.w2 = ExpertMatrix(shape.weight_format, e, h, i, dtype, device, seed + 1)
        gen = torch.Generator(device=device)
        gen.manual_seed(seed + 2)
        qkv = shape.q_dim + shape.kv_dim
        self.w_qkv = (torch.randn((qkv, h), generator=gen, device=device) / math.sqrt(h)).to(dtype)
        self.w_o = (
            torch.randn((h, shape.q_dim), generator=gen, device=device) / math.sqrt(shape.q_dim)
        ).to(dtype)

    # routing --------------------------------------------------------------------------

    def routing(self, batch: int, distinct: int, seed: int) -> tuple[Any, Any]:
        """topk_ids [batch, top_k] int64 on the device and uniform router weights."""
        torch = _torch()
        k = self.shape.top_k
        ids = controlled_routing(batch, k, distinct, self.shape.num_experts, seed)
        topk_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        topk_w = torch.full((batch, k), 1.0 / k, dtype=torch.float32, device=self.device)
        return topk_ids, topk_w

    def max_blocks(self, batch: int) -> int:
        slots = batch * self.shape.top_k
        return -(-slots // BLOCK_M) + min(self.shape.num_experts, slots)

    def align(self, topk_ids: Any) -> tuple[Any, Any]:
        """(sorted slot ids [max_blocks * BLOCK_M] int32, expert per block [max_blocks] int32).

        Slot s = token * top_k + j. Each expert's slots are contiguous, padded to a multiple
        of BLOCK_M with the sentinel batch x top_k; blocks past the end have expert -1.
        Device-side only (no .item()), so that it can be captured in a CUDA graph.
        """
        torch = _torch()
        e = self.shape.num_experts
        flat = topk_ids.reshape(-1)
        slots = flat.numel()
        blocks = self.max_blocks(topk_ids.shape[0])
        counts = torch.zeros(e, dtype=torch.int64, device=flat.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = torch.cumsum(padded, 0)
        starts = ends - padded
        order = torch.argsort(flat, stable=True)
        sorted_e = flat[order]
        run_start = torch.cumsum(counts, 0) - counts
        rank = torch.arange(slots, device=flat.device) - run_start[sorted_e]
        sorted_ids = torch.full((blocks * BLOCK_M,), slots, dtype=torch.int32, device=flat.device)
        sorted_ids.scatter_(0, starts[sorted_e] + rank, order.to(torch.int32))
        pos = torch.arange(blocks, device=flat.device) * BLOCK_M
        block_e = torch.searchsorted(ends, pos, right=True)
        block_e = torch.where(pos < ends[-1], block_e, -1).to(torch.int32)
        return sorted_ids, block_e

    # forwards -------------------------------------------------------------------------

    def forward_triton(self, x: Any, aligned: tuple[Any, Any], topk_w: Any) -> Any:
        on_cpu = x.device.type != "cuda"
        moe_step_triton = triton_kernels(interpret=on_cpu)
        sorted_ids, block_e = aligned
        with interpreter_env(on_cpu):
            return self._grouped_forward(moe_step_triton, x, sorted_ids, block_e, topk_w)

    def _grouped_forward(
        self, moe_step_triton: Any, x: Any, sorted_ids: Any, block_e: Any, topk_w: Any
    ) -> Any:
        torch = _torch()
        batch, k, h, i = x.shape[0], self.shape.top_k, self.shape.hidden, self.shape.expert_ffn
        slots = batch * k
        inter = torch.empty((slots, 2 * i), dtype=x.dtype, device=x.device)
        moe_step_triton.grouped_gemm(
            x, self.w13, inter, sorted_ids, block_e, topk_w, slots, rows_per_a=k,
            block=(BLOCK_M, BLOCK_N, BLOCK_K), num_warps=NUM_WARPS, num_stages=NUM_STAGES,
            mul_route_weight=False,
        )  # fmt: skip
        act = torch.nn.functional.silu(inter[:, :i]) * inter[:, i:]
        out = torch.empty((slots, h), dtype=x.dtype, device=x.device)
        moe_step_triton.grouped_gemm(
            act, self.w2, out, sorted_ids, block_e, topk_w, slots, rows_per_a=1,
            block=(BLOCK_M, BLOCK_N, BLOCK_K), num_warps=NUM_WARPS, num_stages=NUM_STAGES,
            mul_route_weight=True,
        )  # fmt: skip
        return out.view(batch, k, h).sum(dim=1)

    def loop_plan(self, topk_ids: Any, topk_w: Any) -> list[tuple[int, Any, Any]]:
        """(expert, token indices, router weights) per activated expert (host side: the
        loop launches one matmul per expert, so it must know them)."""
        torch = _torch()
        ids = topk_ids.cpu()
        plan = []
        for expert in sorted({int(v) for v in ids.reshape(-1).tolist()}):
            tok, j = torch.nonzero(ids == expert, as_tuple=True)
            plan.append(
                (expert, tok.to(self.device), topk_w[tok.to(self.device), j.to(self.device)])
            )
        return plan

    def forward_loop(self, x: Any, plan: Sequence[tuple[int, Any, Any]]) -> Any:
        torch = _torch()
        i = self.shape.expert_ffn
        out = torch.zeros((x.shape[0], self.shape.hidden), dtype=torch.float32, device=x.device)
        for expert, tok, w in plan:
            h = torch.nn.functional.linear(x[tok], self.w13.dense(expert))
            a = torch.nn.functional.silu(h[:, :i]) * h[:, i:]
            y = torch.nn.functional.linear(a, self.w2.dense(expert))
            out.index_add_(0, tok, y.to(torch.float32) * w[:, None])
        return out.to(x.dtype)

    def forward_dense(self, x: Any, attn: Any) -> tuple[Any, Any]:
        torch = _torch()
        qkv = torch.nn.functional.linear(x, self.w_qkv)
        return qkv, torch.nn.functional.linear(attn, self.w_o)


# --- timing -------------------------------------------------------------------------------


def time_callable(
    fn: Callable[[], Any],
    *,
    device: Any,
    reps: int,
    warmup: int,
    flush: Any,
    graph: bool,
) -> tuple[list[float], bool]:
    """Seconds per repetition of `fn`, and whether a CUDA graph replayed it."""
    torch = _torch()
    if device.type != "cuda":
        for _ in range(warmup):
            fn()
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        return samples, False
    for _ in range(max(warmup, 1)):
        fn()
    run = fn
    used_graph = False
    if graph:
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            run = g.replay
            used_graph = True
        except Exception:  # capture unsupported for this forward: time eager launches
            torch.cuda.synchronize()
            run = fn
        for _ in range(warmup):
            run()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        if flush is not None:
            flush.zero_()
        starts[i].record()
        run()
        ends[i].record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends, strict=True)], used_graph


# --- provenance ----------------------------------------------------------------------------


def _nvidia_smi(query: str) -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        )
        return out.stdout.strip().splitlines()[0].strip()
    except (OSError, subprocess.SubprocessError, IndexError):
        return ""


def provenance(device: Any, command: str) -> dict[str, Any]:
    torch = _torch()
    try:
        triton_version = str(importlib.import_module("triton").__version__)
    except ImportError:
        triton_version = ""
    info: dict[str, Any] = {
        "device_type": device.type,
        "torch": str(torch.__version__),
        "triton": triton_version,
        "python": platform.python_version(),
        # timezone.utc, not datetime.UTC: the GPU machine's Python may predate 3.11.
        "date": datetime.datetime.now(datetime.timezone.utc).strftime(  # noqa: UP017
            "%Y-%m-%dT%H:%M:%SZ"
        ),
        "command": command,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            gpu=str(props.name),
            gpu_memory_bytes=int(props.total_memory),
            sm_count=int(props.multi_processor_count),
            compute_capability=f"{props.major}.{props.minor}",
            cuda=str(torch.version.cuda or ""),
            driver=_nvidia_smi("driver_version"),
            clocks=_nvidia_smi("clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem"),
            power_limit=_nvidia_smi("power.limit"),
        )
    else:
        info.update(gpu=f"cpu ({platform.processor() or platform.machine()})", driver="", cuda="")
    return info


# --- the sweep ----------------------------------------------------------------------------


def _row(
    shape: MoeShape, part: str, kernel: str, batch: int, distinct: int, samples: list[float],
    graph: bool,
) -> dict[str, Any]:  # fmt: skip
    return {
        "profile": shape.profile,
        "part": part,
        "kernel": kernel,
        "graph": graph,
        "batch_tokens": batch,
        "distinct_experts": distinct,
        "reps": len(samples),
        **summarize_samples(samples),
    }


def check_kernel(layer: MoeLayer, seed: int) -> float:
    """Max relative error of the Triton forward against the per-expert loop, on two
    routings: every slot its own expert, and few experts with several blocks each."""
    torch = _torch()
    k, e = layer.shape.top_k, layer.shape.num_experts
    worst = 0.0
    for batch, distinct in ((CHECK_BATCH, min(CHECK_BATCH * k, e)), (2 * BLOCK_M + 3, k)):
        topk_ids, topk_w = layer.routing(batch, distinct, seed)
        topk_w = torch.rand(topk_w.shape, device=layer.device)  # placement must matter
        x = torch.randn((batch, layer.shape.hidden), device=layer.device).to(layer.dtype)
        got = layer.forward_triton(x, layer.align(topk_ids), topk_w).to(torch.float32)
        want = layer.forward_loop(x, layer.loop_plan(topk_ids, topk_w)).to(torch.float32)
        scale = float(want.abs().max())
        err = float((got - want).abs().max()) / scale if scale > 0 else float(got.abs().max())
        worst = max(worst, err)
    return worst


@dataclass(frozen=True)
class _Timer:
    device: Any
    reps: int
    warmup: int
    flush: Any
    graph: bool

    def __call__(self, fn: Callable[[], Any]) -> tuple[list[float], bool]:
        return time_callable(
            fn,
            device=self.device,
            reps=self.reps,
            warmup=self.warmup,
            flush=self.flush,
            graph=self.graph,
        )


def measure_shape(
    shape: MoeShape,
    kernels: Sequence[str],
    config: MeasureConfig,
    timer: _Timer,
    *,
    dtype: Any,
    seed: int,
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """One MoE shape: its rows (dense; per distinct-expert count, align and moe) and the
    check of the Triton kernel against the loop (None when not checked). The layer's
    weights are freed on return."""
    torch = _torch()
    device = timer.device
    layer = MoeLayer(shape, dtype, device, seed=seed)
    check = None
    if "triton" in kernels and config.check:
        err = check_kernel(layer, config.seed)
        ok = err <= CHECK_MAX_REL_ERR
        check = {
            "profile": shape.profile,
            "max_rel_err": err,
            "status": "passed" if ok else "failed",
        }
        if not ok:  # no timings from a kernel that computes the wrong thing
            kernels = [k for k in kernels if k != "triton"]
    gen = torch.Generator(device=device)
    gen.manual_seed(config.seed)
    rows: list[dict[str, Any]] = []
    for batch in config.batches:
        x = torch.randn((batch, shape.hidden), generator=gen, device=device).to(dtype)
        attn = torch.randn((batch, shape.q_dim), generator=gen, device=device).to(dtype)
        samples, graph = timer(functools.partial(layer.forward_dense, x, attn))
        rows.append(_row(shape, "dense", "torch.linear", batch, 0, samples, graph))
        counts = distinct_expert_counts(batch, shape.top_k, shape.num_experts, config.points)
        for distinct in counts:
            topk_ids, topk_w = layer.routing(batch, distinct, config.seed + batch + distinct)
            if "triton" in kernels:
                if distinct == counts[-1]:
                    samples, graph = timer(functools.partial(layer.align, topk_ids))
                    rows.append(_row(shape, "align", "torch", batch, distinct, samples, graph))
                aligned = layer.align(topk_ids)
                samples, graph = timer(functools.partial(layer.forward_triton, x, aligned, topk_w))
                rows.append(_row(shape, "moe", "triton", batch, distinct, samples, graph))
            if "loop" in kernels:
                plan = layer.loop_plan(topk_ids, topk_w)
                samples, graph = timer(functools.partial(layer.forward_loop, x, plan))
                rows.append(_row(shape, "moe", "loop", batch, distinct, samples, graph))
    return rows, check


def measure(
    config: MeasureConfig, checkpoint: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    """Run the sweep; return the table (provenance, shapes, checks, rows).

    checkpoint: called with the table so far after each shape, so that a run stopped by a
    time limit still leaves the shapes it finished.
    """
    torch = _torch()
    started = time.perf_counter()
    device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = device.type == "cuda"
    has_triton = importlib.util.find_spec("triton") is not None
    kernels = config.kernels or (("triton",) if on_gpu and has_triton else ("loop",))
    interpreted = "triton" in kernels and not on_gpu
    if "triton" in kernels:
        # Triton has no CPU backend; its interpreter runs the same kernel on CPU tensors.
        triton_kernels(interpret=interpreted)
    # The interpreter's tl.dot mishandles BF16, so CPU runs use float32 activations.
    dtype = torch.bfloat16 if on_gpu else torch.float32
    flush_mib = config.flush_mib if config.flush_mib >= 0 else (256 if on_gpu else 0)
    flush = torch.empty(flush_mib << 20, dtype=torch.uint8, device=device) if flush_mib else None
    timer = _Timer(device, config.reps, config.warmup, flush, config.graph)
    rows: list[dict[str, Any]] = []
    checks: list[dict[str, Any]] = []
    prov = provenance(device, config.command)
    prov.update(
        dtype=str(dtype).removeprefix("torch."),
        flush_mib=flush_mib,
        block=[BLOCK_M, BLOCK_N, BLOCK_K],
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
        triton_interpreter=interpreted,
        kernels=list(kernels),
        reps=config.reps,
        warmup=config.warmup,
        seed=config.seed,
    )

    def table(shapes: Sequence[MoeShape]) -> dict[str, Any]:
        return {
            "schema": TABLE_SCHEMA,
            "provenance": {**prov, "wall_s": round(time.perf_counter() - started, 2)},
            "shapes": [asdict(s) for s in shapes],
            "checks": list(checks),
            "rows": list(rows),
        }

    for n, shape in enumerate(config.shapes):
        shape_rows, check = measure_shape(
            shape, list(kernels), config, timer, dtype=dtype, seed=config.seed + 10 * n
        )
        rows.extend(shape_rows)
        if check is not None:
            checks.append(check)
        if on_gpu:
            torch.cuda.empty_cache()
        if checkpoint is not None:
            checkpoint(table(config.shapes[: n + 1]))
    return table(config.shapes)
