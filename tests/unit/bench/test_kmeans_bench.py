"""`eldr bench-kmeans` at a tiny size, and its synthetic signature generator."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from eldr.bench.kmeans_bench import run_benchmark, synthetic_signatures
from eldr.cli import build_parser


def test_synthetic_signatures_are_unit_non_negative_and_deterministic() -> None:
    a = synthetic_signatures(300, 256, seed=5)
    b = synthetic_signatures(300, 256, seed=5)
    assert a.shape == (300, 256)
    assert a.dtype == np.float32
    assert np.array_equal(a, b)
    assert a.min() >= 0.0
    np.testing.assert_allclose(np.linalg.norm(a, axis=1), 1.0, atol=1e-5)
    assert (a == 0.0).mean() > 0.2  # sparse-ish
    assert not np.array_equal(a, synthetic_signatures(300, 256, seed=6))


def test_synthetic_signatures_reject_empty_shapes() -> None:
    with pytest.raises(ValueError, match="positive"):
        synthetic_signatures(0, 10, seed=0)


def test_run_benchmark_tiny() -> None:
    report = run_benchmark(300, 256, 4, seed=1, reduce_dim=16, unconstrained=True, max_iter=20)
    assert report["input"].startswith("synthetic")
    assert report["capacity"] == 75
    assert report["max_size"] <= 75
    assert report["reduce_dim"] == 16
    assert report["inertia"] > 0.0
    assert report["inertia_ratio"] == pytest.approx(
        report["inertia"] / report["unconstrained_inertia"]
    )


def test_cli_prints_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "kmeans.json"
    args = build_parser().parse_args(
        [
            *("bench-kmeans", "--n", "200", "--dim", "128", "--k", "5", "--reduce-dim", "0"),
            *("--json", str(out)),
        ]
    )
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "synthetic" in printed
    assert "capacity=40" in printed
    report = json.loads(out.read_text())
    assert report["n"] == 200
    assert report["k"] == 5
    assert report["reduce_dim"] is None
    assert "inertia_ratio" not in report
