"""`eldr bench --scenario drift|churn` on a small synthetic workload: shape and checks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from eldr.bench.online_bench import OnlineConfig, run_churn, run_drift
from eldr.cli import main
from eldr.core.workload.synthetic import SyntheticSpec, generate

SPEC = SyntheticSpec(
    num_topics=3,
    num_moe_layers=4,
    num_experts=16,
    top_k=2,
    decode_len_range=(8, 24),
    prompt_len_range=(8, 24),
)


def config(**kw: object) -> OnlineConfig:
    base: dict[str, object] = dict(
        decoders=4,
        arrivals=500,
        batch_target=4.0,
        refit_interval_s=0.5,
        tick_s=0.1,
        window_s=1.0,
        fit_delay_s=0.05,
        min_samples=8,
        min_holdout=8,
        churn_settle_s=0.05,
        drift_min_gap_s=0.2,
        drift_fit_s=0.3,
    )
    base.update(kw)
    return OnlineConfig(**base)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def traces():  # type: ignore[no-untyped-def]
    return generate(SPEC, 240, np.random.default_rng(0))


def test_drift_reports_every_policy_before_and_after_the_shift(traces) -> None:  # type: ignore[no-untyped-def]
    result = run_drift(traces, config())
    policies = {r["policy"] for r in result["rows"]}
    assert {"static partition", "online refit", "eldr_cost", "round_robin"} <= policies
    for row in result["rows"]:
        assert row["before"]["requests"] > 0
        assert row["after"]["requests"] > 0
    summary = result["summary"]
    assert summary["from"] != summary["to"]
    assert set(summary["recovered_share"]) == {
        "vs_static_before_shift",
        "vs_calibration_reference",
        "vs_replayed_reference",
    }
    assert isinstance(summary["meets_target"], bool)
    assert result["refits"], "the online refitter never ran"
    for refit in result["refits"]:
        assert refit["reason"]
        assert refit["promoted"] == (refit["version"] is not None)


def test_churn_never_routes_to_a_departed_worker_and_feeds_joiners(traces) -> None:  # type: ignore[no-untyped-def]
    result = run_churn(traces, config())
    assert len(result["timeline"]) == 3
    for row in result["rows"]:
        checks = row["checks"]
        assert checks["routed_to_departed"] == 0, row["policy"]
        assert set(checks["first_request_after_join_s"]) == {"w4", "w5", "w6"}
        assert all(v is not None for v in checks["first_request_after_join_s"].values())
    online = [e for e in result["refits"] if e["trigger"] == "churn"]
    assert online
    assert all(e["promoted"] for e in online)


@pytest.mark.slow
def test_cli_runs_a_scenario(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "churn.json"
    rc = main(
        [
            "bench",
            "--scenario",
            "churn",
            "--synthetic-requests",
            "120",
            "--decoders",
            "4",
            "--arrivals",
            "300",
            "--batch-targets",
            "4",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    assert json.loads(out.read_text())["scenario"] == "churn"
    assert "to departed" in capsys.readouterr().out
