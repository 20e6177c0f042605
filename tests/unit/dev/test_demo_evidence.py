"""The demo's and compare-live's evidence: evaluation arrivals drawn with copies kept apart,
the copies a pass had, every policy against the best baseline of each statistic, and the
replay of a fixed assignment."""

from __future__ import annotations

import argparse
import math
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from eldr.core.routing.pipeline import FixedAssignment, FleetView
from eldr.core.routing.profile import DEFAULT_PROFILE, PAPER_PROFILE, FixedAssignmentProfile
from eldr.core.workload.synthetic import SyntheticSpec, generate
from eldr.data.deployments import DEFAULT_DEPLOYMENT_FOR_TRACES, load_catalog
from eldr.dev.compare import (
    CHECKS,
    LivePass,
    Measured,
    PolicyComparison,
    cuts,
    live_view_error,
    seen_in_flight,
)
from eldr.dev.demo import (
    BASELINES,
    DemoConfig,
    FinishClock,
    add_run_arguments,
    against_best_baseline,
    best_baselines,
    evaluation_draw,
    format_against_best,
    format_arrivals,
    run_config_fields,
    with_baselines,
)
from support.messages import decision

SMALL = SyntheticSpec(
    num_topics=3, num_moe_layers=4, num_experts=16, top_k=1, decode_len_range=(8, 16)
)


def _draw(pool_size: int, rate_per_s: float, **config: Any) -> Any:
    traces = generate(SMALL, 400, np.random.default_rng(0))
    cost = load_catalog().get(DEFAULT_DEPLOYMENT_FOR_TRACES)
    demo = DemoConfig(evaluation_requests=600, decoders=4, **config)
    return evaluation_draw(demo, traces, np.arange(pool_size), cost, rate_per_s)


def _held_copies(draw: Any, hold_s: float) -> int:
    """Arrivals drawn while an earlier copy was within `hold_s` of its arrival."""
    last: dict[int, float] = {}
    hits = 0
    for r, t in zip(draw.requests.tolist(), draw.arrival_s.tolist(), strict=True):
        hits += r in last and t - last[r] < hold_s
        last[r] = t
    return hits


def test_the_evaluation_draw_keeps_copies_apart_where_the_pool_allows() -> None:
    draw = _draw(pool_size=300, rate_per_s=100.0)
    assert draw.apart
    assert draw.forced_share == 0.0
    assert draw.arrival_s[0] == 0.0
    assert np.all(np.diff(draw.arrival_s) >= 0)
    assert set(draw.requests.tolist()) <= set(range(300))
    with_replacement = _draw(pool_size=300, rate_per_s=100.0, arrivals_apart=False)
    assert with_replacement.method == "with replacement"
    assert not with_replacement.apart
    # The same arrival times; within the shortest hold (decode 8-16 tokens: at least half
    # the mean), no copy comes back when drawn apart, and some do with replacement.
    np.testing.assert_array_equal(draw.arrival_s, with_replacement.arrival_s)
    shortest_hold_s = 0.5 * draw.expected_in_flight / 100.0
    assert _held_copies(draw, shortest_hold_s) == 0
    assert _held_copies(with_replacement, shortest_hold_s) > 0
    assert "no request drawn while a copy of it was in flight" in format_arrivals(draw.describe())


def test_the_evaluation_draw_is_the_same_for_every_pass() -> None:
    a, b = _draw(pool_size=100, rate_per_s=20.0), _draw(pool_size=100, rate_per_s=20.0)
    np.testing.assert_array_equal(a.requests, b.requests)
    np.testing.assert_array_equal(a.arrival_s, b.arrival_s)


def test_a_pool_too_small_for_the_load_is_said_and_counted() -> None:
    draw = _draw(pool_size=5, rate_per_s=400.0)
    assert not draw.apart
    assert draw.forced_share > 0
    text = format_arrivals(draw.describe())
    assert "too small" in text
    assert f"{100 * draw.forced_share:.1f}%" in text


def test_each_statistic_has_its_own_best_baseline() -> None:
    stats = {
        "round_robin": (11.0, 11.50, 11.70),
        "random": (10.9, 11.60, 11.90),
        "jsq": (11.2, 11.45, 11.65),
        "p2c": (11.1, 11.48, 11.60),
        "eldr_band_cost": (9.9, 11.40, 11.62),
    }
    assert best_baselines(stats) == {"union": "random", "tpot_p50": "jsq", "tpot_p99": "p2c"}
    versus = against_best_baseline(stats)
    assert list(versus) == ["eldr_band_cost"]
    row = versus["eldr_band_cost"]
    assert row["union"] == pytest.approx(100 * (9.9 / 10.9 - 1), abs=0.01)
    assert row["tpot_p50"] == pytest.approx(100 * (11.40 / 11.45 - 1), abs=0.01)
    assert row["tpot_p99"] == pytest.approx(100 * (11.62 / 11.60 - 1), abs=0.01)
    assert (row["union_baseline"], row["tpot_p50_baseline"], row["tpot_p99_baseline"]) == (
        "random",
        "jsq",
        "p2c",
    )
    assert "(vs random)" in "\n".join(format_against_best(stats))


def test_without_a_baseline_nothing_is_compared() -> None:
    assert against_best_baseline({"eldr": (9.0, 11.0, 11.5)}) == {}
    assert "no load-only baseline" in format_against_best({"eldr": (9.0, 11.0, 11.5)})[0]


def test_the_baselines_always_run() -> None:
    profiles = with_baselines((PAPER_PROFILE, DEFAULT_PROFILE))
    assert tuple(p.name for p in profiles) == (*BASELINES, "eldr", DEFAULT_PROFILE.name)
    assert with_baselines(profiles) == profiles
    assert tuple(p.name for p in DemoConfig.policies) == tuple(p.name for p in profiles)


def test_copies_are_measured_from_the_finish_events() -> None:
    clock = FinishClock(bus=None)  # type: ignore[arg-type]
    # Request 7 twice, overlapping on worker a; request 8 twice, one after the other.
    clock.decoded = {
        "r1": (0.0, 2.0, "decode-a"),
        "r2": (1.0, 3.0, "decode-a"),
        "r3": (0.5, 1.0, "decode-b"),
        "r4": (1.0, 1.5, "decode-b"),
    }
    records = [
        SimpleNamespace(request_id=rid, trace_index=t)
        for rid, t in (("r1", 7), ("r2", 7), ("r3", 8), ("r4", 8), ("lost", 9))
    ]
    driver = SimpleNamespace(records=records)
    assert clock.copies(driver) == (0.5, 0.5)  # type: ignore[arg-type]
    assert FinishClock(bus=None).copies(driver) is None  # type: ignore[arg-type]


def test_compare_live_cuts_are_against_the_best_baseline_of_each_column() -> None:
    def comparison(policy: str, live: tuple[float, ...], sim: tuple[float, ...]) -> Any:
        m_live, m_sim = Measured(*live, batch=14.0), Measured(*sim, batch=14.0)
        return PolicyComparison(policy, m_live, m_sim, m_sim, m_sim, {}, {}, {}, {})

    rows = [
        comparison("round_robin", (11.0, 11.5, 11.7), (11.0, 11.5, 11.6)),
        comparison("jsq", (11.2, 11.4, 11.8), (10.8, 11.6, 11.7)),
        comparison("eldr", (9.9, 11.3, 11.6), (9.9, 11.3, 11.6)),
    ]
    out = cuts(rows)
    assert list(out) == ["eldr"]
    assert out["eldr"]["live"]["union_baseline"] == "round_robin"
    assert out["eldr"]["live"]["tpot_p50_baseline"] == "jsq"
    assert out["eldr"]["sim_live_information"]["union_baseline"] == "jsq"
    assert out["eldr"]["sim_perfect"]["tpot_p99_baseline"] == "round_robin"
    assert "information model" in CHECKS
    assert "cost model" in CHECKS


def test_a_fixed_assignment_routes_each_decision_where_it_was_told() -> None:
    policy = FixedAssignment(["w2", "w0", "w2"])
    assert policy.profile == FixedAssignmentProfile()
    assert policy.name == "fixed_assignment"
    view = FleetView(
        workers=("w0", "w1", "w2"),
        in_flight=np.zeros(3, dtype=np.int64),
        kv_tokens=np.zeros(3, dtype=np.int64),
    )
    rng = np.random.default_rng(0)
    assert [policy.choose(view, rng).index for _ in range(3)] == [2, 0, 2]


def test_the_live_load_error_reads_only_the_workers_a_decision_listed() -> None:
    live = LivePass(
        policy="eldr_band_cost",
        trace_index=np.array([0, 1]),
        decided_s=np.array([0.0, 1.0]),
        worker=np.array([0, 0]),
        router=np.array([0, 0]),
        # the second decision listed worker 0 only (its candidate), seeing 1 in flight
        seen_in_flight=np.array([[0, 0], [1, -1]]),
        finish_s=np.array([5.0, 6.0]),
        delays={},
        fallbacks={},
    )
    assert live_view_error(live) == 0.0


def test_the_command_line_adds_the_baselines_and_can_draw_with_replacement() -> None:
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    args = parser.parse_args(["--with-replacement", "--profile", '{"policy": "eldr"}'])
    fields = run_config_fields(args, DemoConfig.policies)
    assert fields["arrivals_apart"] is False
    assert tuple(p.name for p in fields["policies"]) == (*BASELINES, "eldr")
    assert run_config_fields(parser.parse_args([]), DemoConfig.policies)["arrivals_apart"]


def test_the_live_load_view_is_read_from_the_candidates_of_a_fleet_scale_record() -> None:
    full = decision("a", "decode-0", fleet=[("decode-0", 2, 10), ("decode-1", 3, 20)])
    fleet_scale = decision(
        "b",
        "decode-1",
        considered=[("decode-1", 4, 30, 0.9, 5.0, 0.5)],
        live_workers=2,
        fleet_totals=(7, 60),
    )
    seen = seen_in_flight([full, fleet_scale], decoders=2)
    assert seen.tolist() == [[2, 3], [-1, 4]]


def test_a_live_load_error_with_nothing_listed_is_not_a_number() -> None:
    live = LivePass(
        policy="p",
        trace_index=np.array([0]),
        decided_s=np.array([0.0]),
        worker=np.array([0]),
        router=np.array([0]),
        seen_in_flight=np.array([[-1, -1]]),
        finish_s=np.array([1.0]),
        delays={},
        fallbacks={},
    )
    assert math.isnan(live_view_error(live))
