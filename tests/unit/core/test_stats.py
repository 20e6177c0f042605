"""The calibration's two hand-written kernels (eldr.core.stats) against the libraries they
stand in for: ranks are scipy's bit for bit, the greedy selection's Spearman is scipy's."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.stats
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from eldr.core.signature.signature import greedy_layer_mask
from eldr.core.stats import best_baselines, dot, rank_unchecked

few_values = arrays(np.float64, st.integers(0, 80), elements=st.integers(-5, 5).map(float))
any_values = arrays(np.float64, st.integers(0, 80), elements=st.floats(-1e9, 1e9, allow_nan=False))


@given(st.one_of(few_values, any_values))
def test_ranks_are_scipys_average_ranks_bit_for_bit(values: np.ndarray) -> None:
    expected = scipy.stats.rankdata(values) if values.size else np.zeros(0)
    assert np.array_equal(rank_unchecked(values), expected)


def test_ties_share_their_average_rank() -> None:
    assert rank_unchecked(np.array([3.0, 1.0, 2.0, 1.0])).tolist() == [4.0, 1.5, 3.0, 1.5]


@given(arrays(np.float64, st.integers(0, 200), elements=st.floats(-1e3, 1e3)))
def test_dot_is_the_dot_product(values: np.ndarray) -> None:
    assert dot(values, values[::-1]) == pytest.approx(float(np.dot(values, values[::-1])))


def _pair_cosine_distances(x: np.ndarray) -> np.ndarray:
    i, j = np.triu_indices(x.shape[0], k=1)
    norms = np.linalg.norm(x, axis=1)
    return np.asarray(1.0 - np.sum(x[i] * x[j], axis=1) / (norms[i] * norms[j]))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_greedy_selections_spearman_is_scipys(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n, layers, experts = 14, 3, 5
    topics = rng.integers(0, 3, n)
    base = rng.random((3, layers * experts)) ** 3
    prefill = (rng.poisson(base[topics] * 6) + 1).astype(np.float32)
    decode = (rng.poisson(base[topics] * 6 + rng.random((n, layers * experts))) + 1).astype(
        np.float32
    )
    _, trace, n_pairs = greedy_layer_mask(
        prefill, decode, layers, experts, rng=np.random.default_rng(0)
    )
    assert n_pairs == n * (n - 1) // 2  # every pair, in order: the same pairs as below
    # The last step holds every layer: compare it with scipy on the whole signatures.
    expected = scipy.stats.spearmanr(
        _pair_cosine_distances(prefill.astype(np.float64)),
        _pair_cosine_distances(decode.astype(np.float64)),
    ).statistic
    assert trace[-1].correlation == pytest.approx(float(expected), abs=1e-12)


def test_the_best_baseline_of_each_statistic_is_the_lowest_ties_by_its_tie_break() -> None:
    stats = {
        "eldr": {"union": 1.0, "tpot_p50": 1.0, "tpot_p99": 1.0},  # not a baseline
        "jsq": {"union": 9.0, "tpot_p50": 5.0, "tpot_p99": 7.0},
        "random": {"union": 8.0, "tpot_p50": 5.0, "tpot_p99": 6.0},
        "round_robin": {"union": 8.0, "tpot_p50": 4.0, "tpot_p99": 6.0},
    }
    best = best_baselines(stats, ("jsq", "random", "round_robin", "absent"))
    # union: random and round_robin tie at 8, round_robin's TPOT P50 is lower;
    # TPOT P99: the same tie, broken the same way; union per token: nobody has it.
    assert best == {"union": "round_robin", "tpot_p50": "round_robin", "tpot_p99": "round_robin"}
    stats["round_robin"]["tpot_p50"] = 5.0
    # A full tie goes to the first in the baselines' order.
    assert best_baselines(stats, ("jsq", "random", "round_robin"))["union"] == "random"
    assert best_baselines(stats, ("jsq", "round_robin", "random"))["union"] == "round_robin"
    assert best_baselines(stats, ("absent",)) == {}
