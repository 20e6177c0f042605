"""`eldr bench-moe-step measure` on the CPU, with tiny shapes (needs torch: .venv-vllm).

The benchmark's numbers mean something only on a GPU; here it must keep working: every
weight format's MoE forward (the Triton grouped GEMM under Triton's CPU interpreter, and
the per-expert loop) computes what a naive per-token MoE computes, the routing bookkeeping
places every (token, expert) slot once in a block of its expert, and the command writes a
complete table that `fit` reads. No vLLM engine is used (none of conftest's fixtures).

Triton settles interpreter mode when it is first imported, and other tests of this session
may import it first, so the tests that run the Triton kernel (`*_interpreted`) run in a
fresh `pytest` process started with TRITON_INTERPRET=1 by
`test_triton_kernel_tests_pass_under_the_interpreter`; in this process they skip.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="torch is installed in .venv-vllm only")

from eldr.bench import cli as bench_cli  # noqa: E402
from eldr.bench import moe_step_bench, moe_step_torch  # noqa: E402
from eldr.bench.moe_step_bench import SHAPES, distinct_expert_counts, tiny_shape  # noqa: E402
from eldr.bench.moe_step_torch import BLOCK_M, MoeLayer  # noqa: E402

TINY = {s.profile: tiny_shape(s) for s in SHAPES}
FORMATS = sorted({s.weight_format for s in TINY.values()})


HAS_TRITON = importlib.util.find_spec("triton") is not None  # without importing it
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
ROOT = Path(__file__).resolve().parents[2]

interpreted_only = pytest.mark.skipif(
    not (HAS_TRITON and INTERPRETED),
    reason="runs in the TRITON_INTERPRET=1 subprocess of "
    "test_triton_kernel_tests_pass_under_the_interpreter (needs triton)",
)


def naive_dequant(layer_matrix: Any, expert: int) -> Any:
    """An expert's weight [N, K] in float32, decoded independently of the benchmark."""
    w = layer_matrix.weight[expert]
    if layer_matrix.fmt == "bf16":
        return w.to(torch.float32)
    if layer_matrix.fmt == "fp8":
        return w.view(torch.float8_e4m3fn).to(torch.float32) * layer_matrix.scale[expert][:, None]
    n, k = layer_matrix.n, layer_matrix.k
    out = torch.empty((n, k))
    for code_pos in range(k):
        byte = w[:, code_pos // 2].to(torch.int64)
        code = (byte >> (4 * (code_pos % 2))) & 15
        sign = torch.where(code >= 8, -1.0, 1.0)
        exp, man = (code >> 1) & 3, (code & 1).to(torch.float32)
        mag = torch.where(exp == 0, man / 2, 2.0 ** (exp.to(torch.float32) - 1) * (1 + man / 2))
        scale = 2.0 ** (layer_matrix.scale[expert][:, code_pos // 32].to(torch.float32) - 127)
        out[:, code_pos] = sign * mag * scale
    return out


def naive_moe(layer: MoeLayer, x: Any, topk_ids: Any, topk_w: Any) -> Any:
    """Token by token: sum over its experts of w_j * down(silu(gate x) * up x)."""
    i = layer.shape.expert_ffn
    out = torch.zeros((x.shape[0], layer.shape.hidden))
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            h = naive_dequant(layer.w13, e) @ x[t].to(torch.float32)
            a = torch.nn.functional.silu(h[:i]) * h[i:]
            out[t] += float(topk_w[t, j]) * (naive_dequant(layer.w2, e) @ a)
    return out


def tiny_layer(fmt: str) -> MoeLayer:
    shape = next(s for s in TINY.values() if s.weight_format == fmt)
    return MoeLayer(shape, torch.float32, torch.device("cpu"), seed=3)


def rel_err(got: Any, want: Any) -> float:
    return float((got.to(torch.float32) - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("fmt", FORMATS)
def test_loop_forward_equals_a_naive_moe(fmt: str) -> None:
    layer = tiny_layer(fmt)
    k = layer.shape.top_k
    topk_ids, topk_w = layer.routing(batch=3, distinct=min(3 * k, 16), seed=1)
    topk_w = torch.rand(topk_w.shape)  # unequal router weights: their placement matters
    x = torch.randn((3, layer.shape.hidden))
    want = naive_moe(layer, x, topk_ids, topk_w)
    got = layer.forward_loop(x, layer.loop_plan(topk_ids, topk_w))
    assert rel_err(got, want) < 1e-4


@interpreted_only
@pytest.mark.parametrize("fmt", FORMATS)
def test_triton_grouped_gemm_equals_a_naive_moe_interpreted(fmt: str) -> None:
    layer = tiny_layer(fmt)
    k = layer.shape.top_k
    # 20 tokens put more than BLOCK_M slots on some experts: several blocks per expert.
    batch = 20
    topk_ids, topk_w = layer.routing(batch=batch, distinct=max(k, 4), seed=2)
    topk_w = torch.rand(topk_w.shape)
    x = torch.randn((batch, layer.shape.hidden))
    got = layer.forward_triton(x, layer.align(topk_ids), topk_w)
    assert rel_err(got, naive_moe(layer, x, topk_ids, topk_w)) < 1e-4


def test_align_puts_every_slot_once_in_a_block_of_its_expert() -> None:
    layer = tiny_layer("bf16")
    k = layer.shape.top_k
    for batch, distinct in ((1, k), (5, 2 * k), (20, k), (4, 16)):
        topk_ids, _ = layer.routing(batch, distinct, seed=batch)
        sorted_ids, block_e = layer.align(topk_ids)
        slots = batch * k
        flat = topk_ids.reshape(-1)
        assert sorted_ids.numel() == block_e.numel() * BLOCK_M
        valid = sorted_ids[sorted_ids < slots]
        assert sorted(valid.tolist()) == list(range(slots))
        assert set(sorted_ids[sorted_ids >= slots].tolist()) <= {slots}  # padding sentinel
        used = block_e >= 0
        # blocks in use come first, then only -1; each block holds its own expert's slots
        assert not used[int(used.sum()) :].any()
        for b in range(int(used.sum())):
            members = sorted_ids[b * BLOCK_M : (b + 1) * BLOCK_M]
            members = members[members < slots]
            assert members.numel() > 0
            assert set(flat[members.long()].tolist()) == {int(block_e[b])}
        # the number of blocks is the padded count, not more
        counts = torch.bincount(flat, minlength=layer.shape.num_experts)
        assert int(used.sum()) == int(((counts + BLOCK_M - 1) // BLOCK_M).sum())


PROFILES = ["qwen3-30b-a3b-h200", "llama4-maverick-fp8-8xh200"]


def run_measure(tmp_path: Path, kernels: str) -> dict[str, Any]:
    out = tmp_path / "moe_step.json"
    args = ["measure", "--tiny", "--deployments", ",".join(PROFILES), "--kernels", kernels]
    args += ["--batches", "1,2,4", "--points", "3", "--reps", "3", "--warmup", "1"]
    assert bench_cli.main(["bench-moe-step", *args, "--out", str(out)]) == 0
    table = moe_step_bench.read_table(out)
    prov = table["provenance"]
    assert prov["device_type"] == "cpu"
    assert prov["torch"] == torch.__version__
    assert prov["reps"] == 3
    rows = table["rows"]
    for profile in PROFILES:
        shape = TINY[profile]
        for kernel in kernels.split(","):
            got = {
                (r["batch_tokens"], r["distinct_experts"])
                for r in rows
                if r["profile"] == profile and r["part"] == "moe" and r["kernel"] == kernel
            }
            want = {
                (b, u)
                for b in (1, 2, 4)
                for u in distinct_expert_counts(b, shape.top_k, shape.num_experts, 3)
            }
            assert got == want
        dense = [r for r in rows if r["profile"] == profile and r["part"] == "dense"]
        assert sorted(r["batch_tokens"] for r in dense) == [1, 2, 4]
    for r in rows:
        assert r["reps"] == 3
        assert 0 < r["min_s"] <= r["p10_s"] <= r["median_s"] <= r["p90_s"] <= r["max_s"]
        assert r["graph"] is False  # CUDA graphs only on a GPU
    return table


def test_measure_writes_a_complete_table_that_fit_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    table = run_measure(tmp_path, "loop")
    assert table["checks"] == []  # nothing to check without the Triton kernel
    report = tmp_path / "fit.json"
    out = str(tmp_path / "moe_step.json")
    assert bench_cli.main(["bench-moe-step", "fit", out, "--json", str(report)]) == 0
    printed = capsys.readouterr().out
    assert "NOT A GPU MEASUREMENT" in printed
    fits = json.loads(report.read_text())["fits"]
    assert [(f["profile"], f["kernel"]) for f in fits] == [(p, "loop") for p in sorted(PROFILES)]
    # A CPU table never becomes a deployment.
    with pytest.raises(ValueError, match="not measured on a GPU"):
        bench_cli.main(
            ["bench-moe-step", "fit", out, "--write-deployments", str(tmp_path / "m.toml")]
        )
    assert not (tmp_path / "m.toml").exists()


@interpreted_only
def test_measure_with_the_triton_kernel_interpreted(tmp_path: Path) -> None:
    table = run_measure(tmp_path, "triton,loop")
    checks = {c["profile"]: c["status"] for c in table["checks"]}
    assert checks == dict.fromkeys(PROFILES, "passed")
    aligns = {(r["profile"], r["batch_tokens"]) for r in table["rows"] if r["part"] == "align"}
    assert aligns == {(p, b) for p in PROFILES for b in (1, 2, 4)}
    assert table["provenance"]["triton_interpreter"] is True


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.skipif(INTERPRETED, reason="this is the interpreter subprocess itself")
def test_triton_kernel_tests_pass_under_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    args = [sys.executable, "-m", "pytest", __file__, "-k", "interpreted", "-q", "-rs"]
    proc = subprocess.run(
        [*args, "-p", "no:cacheprovider"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    tail = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    expected = len(FORMATS) + 1
    assert f"{expected} passed" in proc.stdout, tail
    assert "skipped" not in proc.stdout, tail


def test_cpu_timing_returns_one_sample_per_repetition() -> None:
    calls = []
    samples, graph = moe_step_torch.time_callable(
        lambda: calls.append(1),
        device=torch.device("cpu"),
        reps=7,
        warmup=2,
        flush=None,
        graph=True,
    )
    assert len(samples) == 7
    assert len(calls) == 9  # warm-up included
    assert graph is False
