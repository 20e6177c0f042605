"""Routing policies: the ELDR band rule and the load-only baselines."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from eldr.core.routing.pipeline import FleetView, make_policy
from eldr.core.routing.profile import (
    EldrProfile,
    JsqProfile,
    P2cProfile,
    RandomProfile,
    RoundRobinProfile,
    profile_from_params,
)
from eldr.core.routing.stages import band as band_of

scores_st = arrays(
    np.float64,
    st.integers(1, 40),
    elements=st.one_of(st.floats(-1.0, 1.0, allow_nan=False), st.just(float("-inf"))),
)
tau_st = st.sampled_from([0.0, 0.05, 0.1, 0.2, 0.3, 1.0])


def view(n: int, loads: list[int] | None = None, scores: np.ndarray | None = None) -> FleetView:
    in_flight = np.array(loads if loads is not None else [0] * n, dtype=np.int64)
    return FleetView(
        workers=tuple(f"w{i}" for i in range(n)),
        in_flight=in_flight,
        kv_tokens=in_flight * 100,
        scores=scores,
    )


@given(scores_st, tau_st)
def test_band_members_are_within_tau_of_the_best_or_the_widened_pair(
    scores: np.ndarray, tau: float
) -> None:
    band = band_of(scores, np.arange(scores.size), tau, 2)[0]
    finite = np.isfinite(scores)
    if not finite.any():
        assert band.size == 0
        return
    best = scores[finite].max()
    within = set(np.flatnonzero(finite & (scores >= best - tau)).tolist())
    assert set(band.tolist()) >= {int(np.flatnonzero(scores == best)[0])}
    assert all(np.isfinite(scores[i]) for i in band)
    if tau > 0 and len(within) == 1:
        assert band.size == min(2, int(finite.sum()))
        order = np.argsort(-np.where(finite, scores, -np.inf), kind="stable")
        assert set(band.tolist()) == set(order[: band.size].tolist())
    else:
        assert set(band.tolist()) == within


@given(scores_st)
def test_tau_zero_band_is_exactly_the_argmax_ties(scores: np.ndarray) -> None:
    band = band_of(scores, np.arange(scores.size), 0.0, 2)[0]
    finite = np.isfinite(scores)
    if finite.any():
        assert set(band.tolist()) == set(np.flatnonzero(scores == scores[finite].max()).tolist())


@settings(max_examples=200)
@given(
    st.integers(2, 30).flatmap(
        lambda n: st.tuples(
            arrays(np.float64, n, elements=st.floats(-1, 1, allow_nan=False)),
            arrays(np.int64, n, elements=st.integers(0, 50)),
        )
    ),
    tau_st,
    st.integers(0, 2**32 - 1),
)
def test_locality_band_picks_a_least_loaded_band_member(
    data: tuple[np.ndarray, np.ndarray], tau: float, seed: int
) -> None:
    scores, loads = data
    policy = make_policy(EldrProfile(tau=tau))
    choice = policy.choose(view(scores.size, loads.tolist(), scores), np.random.default_rng(seed))
    band = band_of(scores, np.arange(scores.size), tau, 2)[0]
    assert choice.index in band
    assert set(choice.band) == set(band.tolist())
    assert loads[choice.index] == loads[band].min()
    assert choice.fallback is None


def test_locality_band_falls_back_to_jsq_without_scores() -> None:
    choice = make_policy(EldrProfile()).choose(view(3, [5, 1, 4]), np.random.default_rng(0))
    assert choice.index == 1
    assert choice.fallback == "no_signature"


def test_locality_band_falls_back_when_no_worker_has_a_centroid() -> None:
    scores = np.full(3, -np.inf)
    choice = make_policy(EldrProfile()).choose(view(3, [5, 4, 1], scores), np.random.default_rng(0))
    assert choice.index == 2
    assert choice.fallback == "no_centroid"


def test_locality_band_uses_kv_tokens_when_asked() -> None:
    v = FleetView(
        workers=("a", "b"),
        in_flight=np.array([1, 5]),
        kv_tokens=np.array([9000, 10]),
        scores=np.array([0.9, 0.89]),
    )
    assert (
        make_policy(EldrProfile(tau=0.1, load_measure="kv_tokens"))
        .choose(v, np.random.default_rng(0))
        .index
        == 1
    )
    assert (
        make_policy(EldrProfile(tau=0.1, load_measure="requests"))
        .choose(v, np.random.default_rng(0))
        .index
        == 0
    )


def test_round_robin_cycles_in_order() -> None:
    rr = make_policy(RoundRobinProfile())
    picks = [rr.choose(view(3), np.random.default_rng(0)).index for _ in range(7)]
    assert picks == [0, 1, 2, 0, 1, 2, 0]


def test_round_robin_survives_a_departed_worker() -> None:
    rr = make_policy(RoundRobinProfile())
    rng = np.random.default_rng(0)
    assert rr.choose(view(3), rng).index == 0
    smaller = FleetView(("w0", "w2"), np.zeros(2, np.int64), np.zeros(2, np.int64))
    # w1 was next but left: the cycle continues without a crash and stays in range.
    assert rr.choose(smaller, rng).index in (0, 1)


def test_jsq_breaks_ties_with_the_rng_only() -> None:
    v = view(4, [2, 0, 0, 3])
    picks = {make_policy(JsqProfile()).choose(v, np.random.default_rng(s)).index for s in range(50)}
    assert picks == {1, 2}


def test_p2c_never_picks_the_more_loaded_of_its_pair() -> None:
    loads = [10, 0, 5, 7]
    v = view(4, loads)
    rng = np.random.default_rng(1)
    picks = [make_policy(P2cProfile()).choose(v, rng).index for _ in range(200)]
    assert 0 not in picks  # the most loaded worker loses every pair it is in
    assert set(picks) <= {1, 2, 3}


def test_random_policy_is_deterministic_for_a_seed() -> None:
    a = [
        make_policy(RandomProfile()).choose(view(5), np.random.default_rng(7)).index
        for _ in range(3)
    ]
    b = [
        make_policy(RandomProfile()).choose(view(5), np.random.default_rng(7)).index
        for _ in range(3)
    ]
    assert a == b


def test_make_policy_rejects_unknown_names_and_bad_tau() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        profile_from_params("nope")
    with pytest.raises(ValueError, match="tau"):
        make_policy(EldrProfile(tau=-0.1))


def test_fleet_view_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="in_flight"):
        FleetView(("a", "b"), np.zeros(3), np.zeros(2))
