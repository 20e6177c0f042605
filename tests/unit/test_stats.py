"""Rank statistics: rankdata, spearman, pearson, percentile."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from eldr.core.stats import pearson, percentile, rankdata, spearman

ints = st.integers(min_value=-1000, max_value=1000)
paired = st.integers(min_value=2, max_value=40).flatmap(
    lambda n: st.tuples(
        st.lists(ints, min_size=n, max_size=n), st.lists(ints, min_size=n, max_size=n)
    )
)


def test_rankdata_averages_ties() -> None:
    assert rankdata([10, 20, 20, 30]).tolist() == [1.0, 2.5, 2.5, 4.0]


def test_rankdata_unsorted_input() -> None:
    assert rankdata([3.0, 1.0, 2.0, 1.0]).tolist() == [4.0, 1.5, 3.0, 1.5]


def test_rankdata_empty() -> None:
    assert rankdata([]).shape == (0,)


def test_rankdata_rejects_2d() -> None:
    with pytest.raises(ValueError, match="one-dimensional"):
        rankdata([[1, 2], [3, 4]])


@given(st.lists(ints, min_size=1, max_size=60))
def test_rankdata_sums_to_triangular_number(xs: list[int]) -> None:
    n = len(xs)
    assert rankdata(xs).sum() == pytest.approx(n * (n + 1) / 2)


@given(st.lists(ints, min_size=1, max_size=60), st.data())
def test_rankdata_is_permutation_equivariant(xs: list[int], data: st.DataObject) -> None:
    perm = np.array(data.draw(st.permutations(range(len(xs)))), dtype=np.int64)
    x = np.array(xs)
    assert np.array_equal(rankdata(x[perm]), rankdata(x)[perm])


def test_pearson_perfect_linear() -> None:
    assert pearson([1, 2, 3, 4], [3, 5, 7, 9]) == pytest.approx(1.0)
    assert pearson([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)


def test_pearson_known_value() -> None:
    # x = [1, 2, 3], y = [1, 3, 2]: cov = 0.5 (sum of products of deviations 1), r = 0.5.
    assert pearson([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5)


def test_pearson_constant_is_nan() -> None:
    assert math.isnan(pearson([1, 1, 1], [1, 2, 3]))


def test_pearson_length_mismatch() -> None:
    with pytest.raises(ValueError, match="same length"):
        pearson([1, 2, 3], [1, 2])


def test_pearson_rejects_nan() -> None:
    with pytest.raises(ValueError, match="NaN"):
        pearson([1.0, float("nan")], [1.0, 2.0])


@given(paired)
def test_spearman_in_unit_interval(ab: tuple[list[int], list[int]]) -> None:
    r = spearman(*ab)
    assert math.isnan(r) or -1.0 <= r <= 1.0


@given(paired)
def test_spearman_equals_pearson_of_ranks(ab: tuple[list[int], list[int]]) -> None:
    a, b = ab
    r = spearman(a, b)
    expected = pearson(rankdata(a), rankdata(b))
    assert (math.isnan(r) and math.isnan(expected)) or r == pytest.approx(expected)


@given(paired)
def test_spearman_invariant_to_monotone_transform(ab: tuple[list[int], list[int]]) -> None:
    a, b = ab
    x = np.array(a, dtype=np.float64)
    # Strictly increasing and exact in float64 on this range, so ties are preserved.
    transformed = x**3 + 5 * x + 7
    r = spearman(a, b)
    r2 = spearman(transformed, np.exp(np.array(b) / 1000.0))
    assert (math.isnan(r) and math.isnan(r2)) or r2 == pytest.approx(r, abs=1e-12)


def test_spearman_of_reversed_order_is_minus_one() -> None:
    assert spearman([1, 2, 3, 4, 5], [50, 40, 30, 20, 10]) == pytest.approx(-1.0)


@given(
    st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50),
    st.floats(0.0, 100.0),
)
def test_percentile_matches_linear_interpolation(xs: list[float], q: float) -> None:
    assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-9, abs=1e-6)


def test_percentile_sequence_returns_array() -> None:
    result = percentile([1, 2, 3, 4, 5], [0, 50, 100])
    assert isinstance(result, np.ndarray)
    assert result.tolist() == [1.0, 3.0, 5.0]


def test_percentile_empty_raises() -> None:
    with pytest.raises(ValueError, match="empty"):
        percentile([], 50)


def test_percentile_out_of_range_q_raises() -> None:
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        percentile([1, 2], 101)
