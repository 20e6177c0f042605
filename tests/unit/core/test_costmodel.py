"""Decode-step cost model and the packaged deployments."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from eldr.core.costmodel import Deployment, GpuSpec, ModelSpec, expected_uniform_union
from eldr.data.deployments import DEFAULT_DEPLOYMENT_FOR_TRACES, DeploymentError, load_catalog


def tiny_deployment(overhead_s: float = 0.001) -> Deployment:
    gpu = GpuSpec("g", hbm_bytes_per_s=1e12, achievable_fraction=0.5)
    model = ModelSpec(
        "m",
        num_layers=2,
        num_moe_layers=2,
        num_experts=8,
        top_k=2,
        expert_params=1e6,
        expert_bits_per_param=8,
        dense_params=2e6,
        dense_bits_per_param=16,
        kv_bytes_per_token=1000,
    )
    return Deployment("p", model, gpu, gpus_per_worker=2, overhead_s=overhead_s)


def test_step_time_is_overhead_plus_bytes_over_bandwidth() -> None:
    p = tiny_deployment()
    # dense 4e6 B + 3 experts * 1e6 B + 10 tokens * 1000 B over 2 * 1e12 * 0.5 B/s
    expected = 0.001 + (4e6 + 3e6 + 1e4) / 1e12
    assert p.step_time_s(3, 10) == pytest.approx(expected)


def test_step_time_grows_with_the_expert_union() -> None:
    p = tiny_deployment()
    assert p.step_time_s(4, 0) > p.step_time_s(3, 0)


def test_negative_inputs_are_rejected() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        tiny_deployment().step_time_s(-1, 0)


def test_with_overhead_changes_only_the_overhead() -> None:
    p = tiny_deployment()
    q = p.with_overhead(0.0)
    assert q.step_time_s(3, 10) == pytest.approx(p.step_time_s(3, 10) - 0.001)


def test_uniform_union_formula() -> None:
    assert expected_uniform_union(128, 1, 1) == pytest.approx(1.0)
    assert expected_uniform_union(128, 8, 16) == pytest.approx(128 * (1 - (1 - 8 / 128) ** 16))
    assert expected_uniform_union(8, 2, 0) == 0.0


def test_packaged_deployments_load_and_maverick_matches_its_published_size() -> None:
    catalog = load_catalog()
    p = catalog.get(DEFAULT_DEPLOYMENT_FOR_TRACES)
    m = p.model
    total_params = m.dense_params + m.expert_params * m.num_experts * m.num_moe_layers
    # Llama-4-Maverick: ~400B total parameters (plus the ~1B input embedding, not read).
    assert 395e9 < total_params + 1.03e9 < 405e9
    assert p.gpus_per_worker == 8
    assert math.isclose(p.overhead_s, 0.000202 * 48)
    for name in ("qwen3-30b-a3b-mi300x", "gpt-oss-120b-h200", "gemma-4-26b-a4b-h200"):
        assert catalog.get(name).step_time_s(10, 100) > 0


def test_unknown_deployment_names_the_known_ones() -> None:
    with pytest.raises(DeploymentError, match="llama4-maverick"):
        load_catalog().get("nope")


def test_malformed_deployment_file_is_rejected_with_its_path(tmp_path: Path) -> None:
    bad = tmp_path / "p.toml"
    bad.write_text('schema = 1\n[overhead]\nper_layer_s = 0.1\n[deployment.x]\nmodel = "m"\n')
    with pytest.raises(DeploymentError, match=r"p\.toml.*gpu"):
        load_catalog(bad)
    bad.write_text("schema = [")
    with pytest.raises(DeploymentError, match="not valid TOML"):
        load_catalog(bad)


def test_a_measured_expert_cost_replaces_only_the_expert_bytes() -> None:
    p = tiny_deployment()
    m = dataclasses.replace(p, name="m", expert_s=5e-6, token_s=1e-6)
    assert m.measured
    assert not p.measured
    # dense 4e6 B + 10 tokens * 1000 B over 1e12 B/s; 3 experts * 5 us; 4 tokens * 1 us
    assert m.step_time_s(3, 10, 4) == pytest.approx(0.001 + (4e6 + 1e4) / 1e12 + 15e-6 + 4e-6)
    assert m.expert_time_s == 5e-6
    assert p.expert_time_s == pytest.approx(1e6 / 1e12)
    assert m.with_overhead(0.0).step_time_s(3, 10, 4) == pytest.approx(
        m.step_time_s(3, 10, 4) - 0.001
    )
    assert m.with_overhead(0.0).expert_s == 5e-6


def test_spec_deployments_ignore_batch_tokens_and_keep_their_exact_formula() -> None:
    for p in load_catalog().deployments.values():
        if p.measured:
            continue
        exact = p.overhead_s + p.step_bytes(123.0, 4567.0) / p.worker_bytes_per_s
        assert p.step_time_s(123.0, 4567.0) == exact
        assert p.step_time_s(123.0, 4567.0, 32) == exact


def test_measured_terms_must_be_non_negative() -> None:
    with pytest.raises(ValueError, match="expert_s"):
        dataclasses.replace(tiny_deployment(), expert_s=-1e-6)
    with pytest.raises(ValueError, match="token_s"):
        dataclasses.replace(tiny_deployment(), token_s=-1e-6)
    with pytest.raises(ValueError, match="non-negative"):
        tiny_deployment().step_time_s(1, 0, -1)
