"""Linear sum assignment: optimality against brute force, shapes, flags, input checks."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from eldr.core.partition.assignment import linear_sum_assignment


def brute_force_min(cost: np.ndarray) -> float:
    rows, cols = cost.shape
    if rows <= cols:
        return min(
            float(cost[np.arange(rows), list(p)].sum())
            for p in itertools.permutations(range(cols), rows)
        )
    return min(
        float(cost[list(p), np.arange(cols)].sum())
        for p in itertools.permutations(range(rows), cols)
    )


shapes = st.tuples(st.integers(1, 5), st.integers(1, 5))
# Small integers produce many ties, which stress the tie handling; floats the general case.
small_int_matrices = shapes.flatmap(
    lambda s: arrays(np.int64, s, elements=st.integers(-3, 3)).map(lambda a: a.astype(float))
)
float_matrices = shapes.flatmap(
    lambda s: arrays(np.float64, s, elements=st.floats(-1e3, 1e3, allow_nan=False))
)


@settings(max_examples=200, deadline=None)
@given(st.one_of(small_int_matrices, float_matrices))
def test_matches_brute_force(cost: np.ndarray) -> None:
    rows, cols = linear_sum_assignment(cost)
    assert cost[rows, cols].sum() == pytest.approx(brute_force_min(cost), abs=1e-6)


@settings(max_examples=100, deadline=None)
@given(st.one_of(small_int_matrices, float_matrices))
def test_result_is_a_valid_matching(cost: np.ndarray) -> None:
    rows, cols = linear_sum_assignment(cost)
    assert rows.size == cols.size == min(cost.shape)
    assert np.all(np.diff(rows) > 0)  # ascending, hence unique
    assert np.unique(cols).size == cols.size
    assert rows.dtype == np.int64
    assert cols.dtype == np.int64


@settings(max_examples=100, deadline=None)
@given(st.one_of(small_int_matrices, float_matrices))
def test_maximize_matches_brute_force_on_negated_costs(cost: np.ndarray) -> None:
    rows, cols = linear_sum_assignment(cost, maximize=True)
    assert cost[rows, cols].sum() == pytest.approx(-brute_force_min(-cost), abs=1e-6)


def test_known_example() -> None:
    cost = np.array([[4.0, 1.0, 3.0], [2.0, 0.0, 5.0], [3.0, 2.0, 2.0]])
    rows, cols = linear_sum_assignment(cost)
    assert rows.tolist() == [0, 1, 2]
    assert cols.tolist() == [1, 0, 2]


def test_tall_matrix_returns_rows_ascending() -> None:
    cost = np.array([[5.0, 9.0], [1.0, 9.0], [9.0, 0.0]])
    rows, cols = linear_sum_assignment(cost)
    assert rows.tolist() == [1, 2]
    assert cols.tolist() == [0, 1]


def test_recovers_a_hidden_permutation() -> None:
    rng = np.random.default_rng(3)
    perm = rng.permutation(50)
    similarity = rng.uniform(0.0, 0.5, size=(50, 50))
    similarity[np.arange(50), perm] = 1.0
    rows, cols = linear_sum_assignment(similarity, maximize=True)
    assert np.array_equal(cols[np.argsort(rows)], perm)


def test_integer_input_is_accepted() -> None:
    _, cols = linear_sum_assignment(np.array([[1, 2], [2, 1]]))
    assert cols.tolist() == [0, 1]


def test_empty_matrix_gives_empty_matching() -> None:
    rows, cols = linear_sum_assignment(np.zeros((0, 3)))
    assert rows.size == 0
    assert cols.size == 0


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_rejects_non_finite(bad: float) -> None:
    cost = np.ones((3, 3))
    cost[1, 2] = bad
    with pytest.raises(ValueError, match="NaN or infinite"):
        linear_sum_assignment(cost)


def test_rejects_non_2d() -> None:
    with pytest.raises(ValueError, match="2-D"):
        linear_sum_assignment(np.ones(4))


def test_rejects_non_numeric() -> None:
    with pytest.raises(ValueError, match="real numbers"):
        linear_sum_assignment(np.array([["a", "b"], ["c", "d"]]))


def test_does_not_modify_input() -> None:
    cost = np.arange(9.0).reshape(3, 3)
    before = cost.copy()
    linear_sum_assignment(cost, maximize=True)
    assert np.array_equal(cost, before)


def test_512_square_runs_well_under_a_second() -> None:
    cost = np.random.default_rng(0).random((512, 512))
    start = time.perf_counter()
    rows, _ = linear_sum_assignment(cost)
    elapsed_s = time.perf_counter() - start
    assert rows.size == 512
    assert elapsed_s < 1.0  # about 0.1 s here; generous for a shared machine
