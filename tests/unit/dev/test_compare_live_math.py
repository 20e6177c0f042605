"""The pure parts of `eldr compare-live` and the demo's chart."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from eldr.dev.compare import LivePass, information_from, live_view_error, split_pattern
from eldr.dev.compare import true_in_flight as truth_of
from eldr.dev.demo import DemoResult, PolicyResult, plot_result


def live_pass(**overrides: object) -> LivePass:
    fields: dict[str, object] = {
        "policy": "jsq",
        # three requests: on workers 0, 1, 0; decided at 0, 1, 2 s; finished at 1.5, 5, 6 s
        "trace_index": np.array([0, 1, 2]),
        "decided_s": np.array([0.0, 1.0, 2.0]),
        "worker": np.array([0, 1, 0]),
        "router": np.array([0, 1, 0]),
        "seen_in_flight": np.array([[0, 0], [1, 0], [0, 1]]),
        "finish_s": np.array([1.5, 5.0, 6.0]),
        "delays": {
            "report_hop_s": 0.003,
            "decision_hop_s": 0.002,
            "finish_hop_s": 0.002,
            "dispatch_s": 0.008,
            "finish_lag_s": 0.005,
            "decide_s": 0.001,
        },
        "fallbacks": {},
    }
    fields.update(overrides)
    return LivePass(**fields)  # type: ignore[arg-type]


def test_true_in_flight_counts_decided_and_unfinished_requests() -> None:
    live = live_pass()
    # At 1 s request 0 is on worker 0; at 2 s it has finished and request 1 is on worker 1.
    assert truth_of(live).tolist() == [[0, 0], [1, 0], [0, 1]]
    assert live_view_error(live) == 0.0
    stale = live_pass(seen_in_flight=np.array([[0, 0], [1, 0], [1, 1]]))
    assert live_view_error(stale) == pytest.approx(1 / 6)


def test_split_pattern_and_the_information_model_take_the_measured_split() -> None:
    assert split_pattern(np.array([0, 0, 1, 0])) == {
        "shares": [0.75, 0.25],
        "consecutive_same_replica": pytest.approx(1 / 3, abs=1e-3),
    }
    model = information_from(live_pass(), routers=2, report_interval_s=0.1)
    assert model.shares == pytest.approx((2 / 3, 1 / 3))
    assert (model.report_hop_s, model.propagation_s, model.dispatch_s) == (0.003, 0.002, 0.008)
    assert model.commit_s == 0.0  # a live router counts its own decision when it makes it
    assert model.finish_lag_s == 0.005


def test_the_demo_chart_is_written(tmp_path: Path) -> None:
    def row(policy: str, union: float, p50: float, p99: float) -> PolicyResult:
        return PolicyResult(policy, 10, 10, 0, 0, {}, 1.0, 2.0, union, 8.0, p50, p99, 10)

    result = DemoResult(
        input={"synthetic": True, "decoders": 2},
        rate_per_s=10.0,
        partition_version=1,
        refit_message="",
        calibration={},
        requests_sent=30,
        decisions_recorded=30,
        results=[row("round_robin", 10.0, 11.5, 11.7), row("eldr_cost", 9.0, 11.4, 11.6)],
        wall_s=1.0,
    )
    path = tmp_path / "demo.png"
    plot_result(result, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
