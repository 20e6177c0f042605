"""The pure parts of `eldr bench-moe-step`: shapes, sweep, routing, table, fit, profiles.

No torch here (the main .venv has none); the measurement itself is tested on the CPU in
tests/vllm/test_moe_step_bench.py.
"""

from __future__ import annotations

import json
import math
import tomllib
from collections import Counter
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from eldr.bench import cli as bench_cli
from eldr.bench import moe_step_bench as msb
from eldr.bench import routing_bench
from eldr.bench.routing_bench import BenchConfig, run_bench
from eldr.core.workload.synthetic import SyntheticSpec, generate
from eldr.data.deployments import DeploymentError, load_catalog

H200 = {
    "device_type": "cuda",
    "gpu": "NVIDIA H200",
    "driver": "999.1",
    "torch": "9.9.9",
    "triton": "9.9",
    "cuda": "99.9",
    "date": "2027-01-01T00:00:00Z",
    "command": "python -m eldr.bench.cli bench-moe-step measure --out x.json",
}


def test_shapes_match_the_deployments() -> None:
    catalog = load_catalog()
    assert {s.profile for s in msb.SHAPES} == {
        "qwen3-30b-a3b-h200",
        "gpt-oss-120b-h200",
        "gemma-4-26b-a4b-h200",
        "llama4-maverick-fp8-8xh200",
    }
    for shape in msb.SHAPES:
        cost = catalog.get(shape.profile)
        m = cost.model
        assert shape.tp == cost.gpus_per_worker
        assert shape.expert_params * shape.tp == m.expert_params, shape.profile
        assert msb.WEIGHT_BITS[shape.weight_format] == m.expert_bits_per_param
        assert (shape.num_experts, shape.top_k) == (m.num_experts, m.top_k)
        # the measured slice streams the profile's bytes per expert and GPU (FP8 adds its
        # channel scales, < 0.2%)
        per_gpu = m.expert_bytes / cost.gpus_per_worker
        assert per_gpu <= shape.expert_bytes < per_gpu * 1.002
        assert shape.attention_params * shape.tp * m.num_layers < m.dense_params


def test_qwen_attention_projections_are_the_deployment_comment() -> None:
    # deployments.toml: attention 48 * (2048*4096*2 + 2048*512*2) = 905,969,664
    assert msb.shape_for("qwen3-30b-a3b-h200").attention_params * 48 == 905_969_664


def test_unknown_deployment_has_no_shape() -> None:
    with pytest.raises(ValueError, match="known"):
        msb.shape_for("qwen3-30b-a3b-mi300x")


@pytest.mark.parametrize(
    ("batch", "top_k", "experts"),
    [(1, 8, 128), (2, 8, 128), (64, 8, 128), (64, 1, 128), (16, 4, 128), (3, 1, 16)],
)
def test_distinct_counts_span_top_k_to_the_most_the_batch_can_activate(
    batch: int, top_k: int, experts: int
) -> None:
    counts = msb.distinct_expert_counts(batch, top_k, experts, points=6)
    assert counts == sorted(set(counts))
    assert counts[0] == top_k
    assert counts[-1] == min(batch * top_k, experts)
    assert len(counts) <= 6


def test_controlled_routing_activates_exactly_the_asked_experts() -> None:
    for batch, k, u in ((1, 8, 8), (4, 8, 20), (64, 8, 128), (64, 1, 7), (5, 4, 17)):
        ids = msb.controlled_routing(batch, k, u, 128, seed=batch)
        assert len(ids) == batch
        assert all(len(row) == k == len(set(row)) for row in ids)
        counts = Counter(e for row in ids for e in row)
        assert len(counts) == u
        assert max(counts.values()) - min(counts.values()) <= 1  # balanced
        assert all(0 <= e < 128 for e in counts)
    assert msb.controlled_routing(4, 2, 5, 64, seed=1) == msb.controlled_routing(4, 2, 5, 64, 1)
    assert msb.controlled_routing(4, 2, 5, 64, seed=1) != msb.controlled_routing(4, 2, 5, 64, 2)


@pytest.mark.parametrize("distinct", [3, 17])
def test_controlled_routing_refuses_impossible_counts(distinct: int) -> None:
    with pytest.raises(ValueError, match="distinct experts"):
        msb.controlled_routing(batch=4, top_k=4, distinct=distinct, num_experts=16, seed=0)


def test_summary_statistics() -> None:
    s = msb.summarize_samples([5.0, 1.0, 3.0, 2.0, 4.0])
    assert s == {
        "median_s": 3.0,
        "p10_s": pytest.approx(1.4),
        "p90_s": pytest.approx(4.6),
        "min_s": 1.0,
        "max_s": 5.0,
        "mean_s": 3.0,
    }
    with pytest.raises(ValueError, match="no samples"):
        msb.summarize_samples([])


def synthetic_table(
    a_s: float, b_s: float, c_s: float, noise_s: float = 0.0, provenance: dict[str, Any] = H200
) -> dict[str, Any]:
    """Rows as `measure` writes them, from a known a + b U + c B (+ noise)."""
    rng = np.random.default_rng(0)
    rows = []
    shapes = [msb.shape_for("qwen3-30b-a3b-h200"), msb.shape_for("llama4-maverick-fp8-8xh200")]
    for shape in shapes:
        for batch in msb.DEFAULT_BATCHES:
            t = 20e-6 + 1e-8 * batch
            rows.append(dense_row(shape.profile, "dense", "torch.linear", batch, 0, t))
            for u in msb.distinct_expert_counts(batch, shape.top_k, shape.num_experts):
                t = a_s + b_s * u + c_s * batch + noise_s * rng.standard_normal()
                rows.append(dense_row(shape.profile, "moe", "triton", batch, u, t))
                rows.append(dense_row(shape.profile, "moe", "loop", batch, u, 3 * t))
    return {
        "schema": 1,
        "provenance": dict(provenance),
        "shapes": [asdict(shape) for shape in shapes],
        "checks": [],
        "rows": rows,
    }


def dense_row(
    deployment: str, part: str, kernel: str, batch: int, u: int, t: float
) -> dict[str, Any]:
    return {
        "profile": deployment,
        "part": part,
        "kernel": kernel,
        "graph": True,
        "batch_tokens": batch,
        "distinct_experts": u,
        "reps": 100,
        **msb.summarize_samples([t * 0.99, t, t * 1.02]),
    }


def test_fit_recovers_a_known_line_and_leaves_tokens_out() -> None:
    reports = msb.fit_table(synthetic_table(30e-6, 4e-6, 0.0, noise_s=0.05e-6))
    qwen = next(r for r in reports if r.profile == "qwen3-30b-a3b-h200")
    assert qwen.kernel == "triton"  # preferred over the loop
    assert not qwen.token_term
    assert qwen.b_s == pytest.approx(4e-6, rel=0.01)
    assert qwen.chosen.coefficient("a") == pytest.approx(30e-6, rel=0.02)
    assert qwen.chosen.rms_residual_s < 0.1e-6
    assert len(qwen.chosen.residuals_s) == len(qwen.points)
    # bandwidth model: 9,437,184 B / 4.8e12 B/s = 1.966 us
    d = qwen.as_dict()
    assert d["b_datasheet_s"] == pytest.approx(3 * 2048 * 768 * 2 / 4.8e12)
    assert d["b_over_datasheet"] == pytest.approx(4e-6 / d["b_datasheet_s"], rel=0.01)
    assert d["dense_attention_median_s"] == pytest.approx(20e-6 + 8e-8, rel=0.01)


def test_fit_keeps_the_token_term_when_the_data_says_so() -> None:
    reports = msb.fit_table(synthetic_table(30e-6, 4e-6, 0.5e-6, noise_s=0.05e-6))
    qwen = next(r for r in reports if r.profile == "qwen3-30b-a3b-h200")
    assert qwen.token_term
    assert qwen.chosen.coefficient("batch_tokens") == pytest.approx(0.5e-6, rel=0.05)
    assert qwen.b_s == pytest.approx(4e-6, rel=0.02)
    assert qwen.experts_only.rms_residual_s > 3 * qwen.chosen.rms_residual_s


def test_fit_of_the_loop_rows_on_request() -> None:
    reports = msb.fit_table(synthetic_table(30e-6, 4e-6, 0.0), kernel="loop")
    assert {r.kernel for r in reports} == {"loop"}
    assert reports[0].b_s == pytest.approx(12e-6, rel=0.01)


def test_fit_needs_enough_points() -> None:
    rows = [dense_row("qwen3-30b-a3b-h200", "moe", "triton", 1, 8, 1e-5)] * 2
    with pytest.raises(ValueError, match="need at least 3"):
        msb.fit_profile(
            rows, "qwen3-30b-a3b-h200", "triton", expert_bytes=1.0, attention_bytes=1.0,
            datasheet_bytes_per_s=1.0, achievable_bytes_per_s=1.0,
        )  # fmt: skip


def test_table_round_trip_and_validation(tmp_path: Path) -> None:
    table = synthetic_table(30e-6, 4e-6, 0.0)
    path = tmp_path / "sub" / "t.json"
    msb.write_table(path, table)
    assert msb.read_table(path) == json.loads(json.dumps(table))
    del table["rows"][3]["median_s"]
    with pytest.raises(ValueError, match="row 3 lacks"):
        msb.write_table(path, table)
    path.write_text('{"schema": 2}')
    with pytest.raises(ValueError, match="schema 1"):
        msb.read_table(path)


def write_profiles(tmp_path: Path, table: dict[str, Any]) -> Path:
    reports = msb.fit_table(table)
    tables = msb.measured_deployment_tables(
        reports, table["provenance"], table_ref="docs/x.json", fit_command="eldr ... fit"
    )
    path = tmp_path / "measured.toml"
    written = msb.write_measured_deployments(path, tables)
    assert written == sorted(tables)
    return path


def test_measured_deployments_load_beside_the_unchanged_spec_deployments(tmp_path: Path) -> None:
    path = write_profiles(tmp_path, synthetic_table(30e-6, 4e-6, 0.5e-6, noise_s=0.05e-6))
    spec = load_catalog(measured_path=None)
    catalog = load_catalog(measured_path=path)
    base = catalog.get("qwen3-30b-a3b-h200")
    assert base == spec.get("qwen3-30b-a3b-h200")
    assert not base.measured
    for name, p in spec.deployments.items():
        assert catalog.get(name) == p
    m = catalog.get("qwen3-30b-a3b-h200-measured")
    k = catalog.get("qwen3-30b-a3b-h200-measured-kernels")
    assert m.measured
    assert m.model is base.model
    assert m.expert_s == pytest.approx(4e-6, rel=0.02)
    assert m.token_s == pytest.approx(0.5e-6 * 48, rel=0.05)
    assert m.overhead_s == base.overhead_s
    assert k.overhead_s == pytest.approx(30e-6 * 48, rel=0.05)
    prov = dict(m.provenance)
    assert prov["gpu"] == "NVIDIA H200"
    assert prov["driver"] == "999.1"
    assert prov["torch"] == "9.9.9"
    assert prov["date"] == H200["date"]
    assert prov["command"] == H200["command"]
    assert prov["table"] == "docs/x.json"
    assert "us x distinct experts" in prov["fit"]
    # the step: spec dense and KV bytes over bandwidth, measured experts and tokens
    union, kv, batch = 480.0, 3000.0, 12
    bw = base.worker_bytes_per_s
    want = (
        m.overhead_s
        + (base.model.dense_bytes + kv * base.model.kv_bytes_per_token) / bw
        + union * m.expert_s
        + batch * m.token_s
    )
    assert m.step_time_s(union, kv, batch) == pytest.approx(want)
    assert base.step_time_s(union, kv, batch) == base.step_time_s(union, kv)
    mav = catalog.get("llama4-maverick-fp8-8xh200-measured")
    assert mav.gpus_per_worker == 8
    assert mav.overhead_s == catalog.get("llama4-maverick-fp8-8xh200").overhead_s


def test_rewriting_replaces_only_the_deployments_it_fits(tmp_path: Path) -> None:
    path = write_profiles(tmp_path, synthetic_table(30e-6, 4e-6, 0.0))
    first = tomllib.loads(path.read_text())["deployment"]
    table = synthetic_table(30e-6, 5e-6, 0.0)
    table["rows"] = [r for r in table["rows"] if r["profile"] == "qwen3-30b-a3b-h200"]
    write_profiles(tmp_path, table)
    second = tomllib.loads(path.read_text())["deployment"]
    assert set(second) == set(first)
    assert second["qwen3-30b-a3b-h200-measured"]["expert_s"] == pytest.approx(5e-6, rel=0.01)
    mav = "llama4-maverick-fp8-8xh200-measured"
    assert second[mav] == first[mav]


def test_no_deployment_from_a_cpu_run_or_another_gpu(tmp_path: Path) -> None:
    cpu = synthetic_table(30e-6, 4e-6, 0.0, provenance={**H200, "device_type": "cpu"})
    with pytest.raises(ValueError, match="not measured on a GPU"):
        write_profiles(tmp_path, cpu)
    a100 = synthetic_table(30e-6, 4e-6, 0.0, provenance={**H200, "gpu": "NVIDIA A100-SXM4"})
    with pytest.raises(ValueError, match="measured on 'NVIDIA A100"):
        write_profiles(tmp_path, a100)
    assert not (tmp_path / "measured.toml").exists()


def test_a_measured_file_cannot_redefine_a_spec_deployment(tmp_path: Path) -> None:
    path = tmp_path / "m.toml"
    path.write_text(
        msb.render_deployments_toml(
            {"qwen3-30b-a3b-h200": {"model": "qwen3-30b-a3b", "gpu": "h200",
                                    "gpus_per_worker": 1, "expert_s": 1e-6}}
        )
    )  # fmt: skip
    with pytest.raises(DeploymentError, match="already defined"):
        load_catalog(measured_path=path)
    path.write_text('schema = 1\n[gpu.x]\nname = "x"\n')
    with pytest.raises(DeploymentError, match=r"only \[deployment"):
        load_catalog(measured_path=path)


def test_packaged_catalog_spec_deployments_are_not_measured() -> None:
    catalog = load_catalog()
    for name in (
        "llama4-maverick-fp8-8xh200",
        "llama4-maverick-fp8-8xh200-roofline",
        "qwen3-30b-a3b-mi300x",
        "qwen3-30b-a3b-h200",
        "gpt-oss-120b-h200",
        "gemma-4-26b-a4b-h200",
    ):
        assert not catalog.get(name).measured
    for name, p in catalog.deployments.items():  # whatever a GPU run added carries provenance
        if name.endswith((msb.MEASURED_SUFFIX, msb.KERNELS_SUFFIX)):
            prov = dict(p.provenance)
            assert p.measured
            assert {"gpu", "driver", "torch", "date", "command", "table"} <= set(prov)


def test_bench_whatif_reports_a_measured_deployment(tmp_path: Path, monkeypatch: Any) -> None:
    path = write_profiles(tmp_path, synthetic_table(30e-6, 4e-6, 0.0))
    monkeypatch.setattr(routing_bench, "load_catalog", partial(load_catalog, measured_path=path))
    spec = SyntheticSpec(
        num_topics=4,
        num_moe_layers=4,
        num_experts=16,
        top_k=2,
        decode_len_range=(8, 24),
        prompt_len_range=(8, 24),
    )
    traces = generate(spec, 80, np.random.default_rng(0))
    config: dict[str, Any] = dict(decoders=4, arrivals_per_rate=200, batch_targets=(2.0,), seed=1)
    plain = run_bench(traces, BenchConfig(**config))
    measured = "llama4-maverick-fp8-8xh200-measured"
    both = run_bench(traces, BenchConfig(**config, whatif_deployments=(measured,)))
    primary = [r for r in both["results"] if r["profile"] == plain["input"]["cost_profile"]["name"]]
    assert primary == plain["results"]  # the spec profile's rows do not move
    assert plain["input"]["cost_profile"] == both["input"]["cost_profile"]
    assert "measured" not in plain["input"]["cost_profile"]
    info = both["input"]["whatif_profiles"][0]
    assert info["name"] == measured
    assert info["measured"]["expert_us"] == pytest.approx(4.0, rel=0.01)
    assert info["measured"]["provenance"]["gpu"] == "NVIDIA H200"
    rows = [r for r in both["results"] if r["profile"] == measured]
    assert rows
    assert all(math.isfinite(r["tpot_p50_ms"]) and r["tpot_p50_ms"] > 0 for r in rows)
    assert both["whatif_summaries"][0]["profile"] == measured


def test_cli_fit_prints_and_writes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from eldr.cli import main

    table = tmp_path / "t.json"
    msb.write_table(table, synthetic_table(30e-6, 4e-6, 0.0, noise_s=0.05e-6))
    out = tmp_path / "m.toml"
    fit = tmp_path / "fit.json"
    args = [
        "bench-moe-step",
        "fit",
        str(table),
        "--json",
        str(fit),
        "--write-deployments",
        str(out),
    ]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "qwen3-30b-a3b-h200" in printed
    assert "NOT A GPU" not in printed
    assert "wrote " in printed
    report = json.loads(fit.read_text())
    assert report["provenance"]["gpu"] == "NVIDIA H200"
    assert len(report["fits"]) == 2
    catalog = load_catalog(measured_path=out)
    assert dict(catalog.get("qwen3-30b-a3b-h200-measured").provenance)["table"] == str(table)


def test_measure_without_torch_says_what_it_needs(capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    if importlib.util.find_spec("torch") is not None:
        pytest.skip("torch is installed here; tests/vllm/test_moe_step_cpu.py runs measure")
    assert bench_cli.main(["bench-moe-step", "measure", "--tiny"]) == 2
    assert "needs torch" in capsys.readouterr().err
