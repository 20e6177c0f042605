"""Evaluation arrivals keep copies of one request apart; the copies a run had are counted."""

from __future__ import annotations

import numpy as np

from eldr.core.workload.arrivals import copy_overlap, draw_apart


def _arrivals(n: int, rate: float, seed: int = 0) -> np.ndarray:
    return np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, size=n))


def test_no_request_is_drawn_again_while_it_is_held() -> None:
    pool = np.arange(10, 60)  # 50 requests of the first 60
    hold_s = np.full(60, 0.4)
    t = _arrivals(2000, rate=50.0)  # ~20 held at a time, well under 50
    draw = draw_apart(pool, hold_s, t, np.random.default_rng(1))
    assert draw.apart
    assert set(draw.requests.tolist()) <= set(pool.tolist())
    last: dict[int, float] = {}
    for r, at in zip(draw.requests.tolist(), t.tolist(), strict=True):
        assert at >= last.get(r, -np.inf) + 0.4
        last[r] = at
    assert draw.describe()["apart"] is True
    assert abs(draw.expected_in_flight - 20.0) < 2.0


def test_a_pool_too_small_for_the_load_is_reported_and_copies_spread_evenly() -> None:
    pool = np.arange(20)
    hold_s = np.full(20, 1.0)
    t = _arrivals(3000, rate=100.0)  # ~100 held at a time, 5 per request
    draw = draw_apart(pool, hold_s, t, np.random.default_rng(2))
    assert not draw.apart
    assert draw.forced_share > 0.9
    # Copies held at each instant stay within a few of each other (drawn with replacement,
    # the spread reaches 12 on these arrivals).
    for i in range(200, 3000, 7):
        recent = draw.requests[(t > t[i] - 1.0) & (t <= t[i])]
        held = np.bincount(recent, minlength=20)
        assert held.max() - held.min() <= 3


def test_the_draw_is_deterministic_for_a_seed() -> None:
    t = _arrivals(500, rate=50.0)
    a = draw_apart(np.arange(30), np.full(30, 0.5), t, np.random.default_rng(7))
    b = draw_apart(np.arange(30), np.full(30, 0.5), t, np.random.default_rng(7))
    assert np.array_equal(a.requests, b.requests)


def test_copy_overlap_counts_copies_decoding_at_the_same_time() -> None:
    # Request 0: arrivals 0 and 1 overlap on worker 0; arrival 2 overlaps arrival 0 only in
    # time (worker 1). Request 1: arrivals 3 and 4 touch at t = 3 (no overlap).
    requests = np.array([0, 0, 0, 1, 1])
    worker = np.array([0, 0, 1, 0, 0])
    start = np.array([0.0, 1.0, 5.0, 0.0, 3.0])
    end = np.array([10.0, 2.0, 6.0, 3.0, 4.0])
    ov = copy_overlap(requests, worker, start, end, measured_from=0)
    assert ov.in_flight_share == 3 / 5
    assert ov.same_worker_share == 2 / 5
    # Only arrivals from 2 on are measured; arrival 2's copy from the warm-up still counts.
    ov = copy_overlap(requests, worker, start, end, measured_from=2)
    assert ov.in_flight_share == round(1 / 3, 4)
    assert ov.same_worker_share == 0.0
