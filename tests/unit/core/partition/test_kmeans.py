"""Balanced spherical K-means, the capacitated assignment under it, and centroid alignment."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import linear_sum_assignment

from eldr.core.partition.kmeans import (
    align_centroids,
    balanced_spherical_kmeans,
    capacitated_assignment,
    spherical_kmeans,
    unmatched_new,
)


def unit_rows(a: np.ndarray) -> np.ndarray:
    unit: np.ndarray = a / np.linalg.norm(a, axis=1, keepdims=True)
    return unit


def separated_clusters(
    k: int, per_cluster: int, dim: int, seed: int, noise: float = 0.05
) -> tuple[np.ndarray, np.ndarray]:
    """k tight non-negative clusters of equal size around random sparse directions."""
    rng = np.random.default_rng(seed)
    centres = np.zeros((k, dim))
    for c in range(k):
        support = rng.choice(dim, size=max(2, dim // k), replace=False)
        centres[c, support] = rng.uniform(0.5, 1.0, size=support.size)
    truth = np.repeat(np.arange(k), per_cluster)
    X = centres[truth] + noise * rng.random((truth.size, dim))
    order = rng.permutation(truth.size)
    return unit_rows(X[order]).astype(np.float32), truth[order]


def is_one_to_one(labels: np.ndarray, truth: np.ndarray, k: int) -> bool:
    table = np.zeros((k, k), dtype=np.int64)
    np.add.at(table, (truth, labels), 1)
    return bool(((table > 0).sum(axis=1) == 1).all() and ((table > 0).sum(axis=0) == 1).all())


@st.composite
def kmeans_inputs(draw: st.DrawFn) -> tuple[np.ndarray, int, int]:
    n = draw(st.integers(1, 60))
    d = draw(st.integers(1, 8))
    k = draw(st.integers(1, n))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    # Skewed, non-negative, sparse-ish rows; never all zero.
    X = rng.exponential(size=(n, d)) ** 3 * (rng.random((n, d)) < 0.6)
    X[np.arange(n), rng.integers(0, d, size=n)] += 0.1
    return unit_rows(X).astype(np.float32), k, seed


# --- balanced_spherical_kmeans ---------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(kmeans_inputs())
def test_every_cluster_is_within_capacity(case: tuple[np.ndarray, int, int]) -> None:
    X, k, seed = case
    fit = balanced_spherical_kmeans(X, k, seed=seed, max_iter=10)
    capacity = math.ceil(X.shape[0] / k)
    assert fit.capacity == capacity
    assert fit.sizes.max() <= capacity
    assert np.array_equal(np.bincount(fit.labels, minlength=k), fit.sizes)


@settings(max_examples=40, deadline=None)
@given(kmeans_inputs(), st.integers(0, 5))
def test_custom_capacity_is_respected(case: tuple[np.ndarray, int, int], extra: int) -> None:
    X, k, seed = case
    capacity = math.ceil(X.shape[0] / k) + extra
    fit = balanced_spherical_kmeans(X, k, seed=seed, max_iter=10, capacity=capacity)
    assert fit.sizes.max() <= capacity


@settings(max_examples=40, deadline=None)
@given(kmeans_inputs())
def test_result_shapes_and_unit_centroids(case: tuple[np.ndarray, int, int]) -> None:
    X, k, seed = case
    fit = balanced_spherical_kmeans(X, k, seed=seed, max_iter=10)
    assert fit.centroids.shape == (k, X.shape[1])
    assert fit.centroids.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(fit.centroids, axis=1), 1.0, atol=1e-5)
    assert fit.labels.shape == (X.shape[0],)
    assert fit.labels.dtype == np.int32
    assert set(np.unique(fit.labels)) <= set(range(k))
    assert fit.prices.shape == (k,)
    assert fit.prices.min() == 0.0
    assert 1 <= fit.iterations <= 10


@settings(max_examples=40, deadline=None)
@given(kmeans_inputs())
def test_inertia_is_sum_of_one_minus_cosine(case: tuple[np.ndarray, int, int]) -> None:
    X, k, seed = case
    fit = balanced_spherical_kmeans(X, k, seed=seed, max_iter=10)
    cos = np.sum(X * fit.centroids[fit.labels], axis=1, dtype=np.float64)
    assert fit.inertia == pytest.approx(float(np.sum(1.0 - cos)), abs=1e-3)


def test_n_not_divisible_by_k() -> None:
    X, _ = separated_clusters(k=3, per_cluster=33, dim=12, seed=1)
    fit = balanced_spherical_kmeans(X[:97], 7, seed=0)
    assert fit.capacity == 14
    assert fit.sizes.max() <= 14
    assert fit.sizes.sum() == 97


def test_k_equal_one_puts_everything_together() -> None:
    X, _ = separated_clusters(k=3, per_cluster=10, dim=12, seed=2)
    fit = balanced_spherical_kmeans(X, 1, seed=0)
    assert fit.sizes.tolist() == [30]
    expected = unit_rows(X.sum(axis=0, keepdims=True))
    np.testing.assert_allclose(fit.centroids, expected, atol=1e-5)


def test_k_equal_n_gives_singletons_on_their_points() -> None:
    X, _ = separated_clusters(k=4, per_cluster=3, dim=16, seed=3)
    fit = balanced_spherical_kmeans(X, 12, seed=0)
    assert fit.sizes.tolist() == [1] * 12
    np.testing.assert_allclose(fit.centroids[fit.labels], X, atol=1e-5)
    assert fit.inertia == pytest.approx(0.0, abs=1e-4)


def test_recovers_equal_size_separated_clusters() -> None:
    X, truth = separated_clusters(k=6, per_cluster=40, dim=30, seed=4)
    fit = balanced_spherical_kmeans(X, 6, seed=0)
    assert fit.sizes.tolist() == [40] * 6
    assert is_one_to_one(fit.labels, truth, 6)


def test_recovers_clusters_through_the_projection() -> None:
    X, truth = separated_clusters(k=5, per_cluster=30, dim=300, seed=5)
    fit = balanced_spherical_kmeans(X, 5, seed=0, reduce_dim=16)
    assert fit.reduce_dim_used == 16
    assert fit.centroids.shape == (5, 300)  # back in the original dimension
    assert is_one_to_one(fit.labels, truth, 5)


def test_no_projection_when_dimension_is_small_or_disabled() -> None:
    X, _ = separated_clusters(k=3, per_cluster=10, dim=40, seed=6)
    assert balanced_spherical_kmeans(X, 3, seed=0, reduce_dim=64).reduce_dim_used is None
    assert balanced_spherical_kmeans(X, 3, seed=0, reduce_dim=None).reduce_dim_used is None
    assert balanced_spherical_kmeans(X, 3, seed=0, reduce_dim=0).reduce_dim_used is None


def test_deterministic_for_a_seed() -> None:
    rng = np.random.default_rng(7)
    X = unit_rows(rng.exponential(size=(400, 200)) ** 2).astype(np.float32)
    a = balanced_spherical_kmeans(X, 8, seed=11, reduce_dim=32)
    b = balanced_spherical_kmeans(X, 8, seed=11, reduce_dim=32)
    assert np.array_equal(a.labels, b.labels)
    assert np.array_equal(a.centroids, b.centroids)
    assert np.array_equal(a.prices, b.prices)


def test_different_seeds_can_differ() -> None:
    rng = np.random.default_rng(8)
    X = unit_rows(rng.exponential(size=(300, 20)) ** 2).astype(np.float32)
    fits = [balanced_spherical_kmeans(X, 6, seed=s) for s in range(4)]
    assert any(not np.array_equal(fits[0].labels, f.labels) for f in fits[1:])


def test_rows_are_treated_as_directions() -> None:
    X, _ = separated_clusters(k=4, per_cluster=10, dim=16, seed=9)
    scaled = X * np.random.default_rng(0).uniform(0.1, 10.0, size=(40, 1)).astype(np.float32)
    a = balanced_spherical_kmeans(X, 4, seed=3)
    b = balanced_spherical_kmeans(scaled.astype(np.float64), 4, seed=3)
    assert np.array_equal(a.labels, b.labels)
    np.testing.assert_allclose(a.inertia, b.inertia, atol=1e-4)


def test_unconstrained_reference() -> None:
    X, truth = separated_clusters(k=4, per_cluster=25, dim=24, seed=10)
    fit = spherical_kmeans(X, 4, seed=0)
    assert fit.capacity is None
    assert not fit.prices.any()
    assert is_one_to_one(fit.labels, truth, 4)


def test_balance_costs_inertia_on_skewed_data() -> None:
    # One large natural cluster and two small ones: the cap must split the large one.
    X, truth = separated_clusters(k=3, per_cluster=60, dim=30, seed=12)
    skewed = np.concatenate([X[truth == 0], X[truth == 1][:10], X[truth == 2][:10]])
    free = spherical_kmeans(skewed, 3, seed=0)
    balanced = balanced_spherical_kmeans(skewed, 3, seed=0)
    assert balanced.sizes.max() <= 27
    assert free.sizes.max() == 60
    assert balanced.inertia > free.inertia


@pytest.mark.parametrize(
    ("X", "k", "message"),
    [
        (np.ones((5, 3)), 6, r"k must be in \[1, N\]"),
        (np.ones((5, 3)), 0, r"k must be in \[1, N\]"),
        (np.ones(5), 1, "2-D"),
        (np.ones((2, 3, 4)), 1, "2-D"),
        (np.array([[1.0, np.nan], [1.0, 2.0]]), 1, "NaN or infinite"),
        (np.array([[1.0, np.inf], [1.0, 2.0]]), 1, "NaN or infinite"),
        (np.array([[0.0, 0.0], [1.0, 2.0]]), 1, "all-zero rows"),
        (np.zeros((0, 3)), 1, "at least one row"),
        (np.array([["a"]]), 1, "real numbers"),
    ],
)
def test_invalid_input_raises(X: np.ndarray, k: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        balanced_spherical_kmeans(X, k, seed=0)


def test_capacity_too_small_raises() -> None:
    with pytest.raises(ValueError, match="cannot hold"):
        balanced_spherical_kmeans(np.ones((10, 2)), 3, seed=0, capacity=3)


def test_non_integer_k_raises() -> None:
    with pytest.raises(ValueError, match="k must be an integer"):
        balanced_spherical_kmeans(np.ones((10, 2)), 2.0, seed=0)  # type: ignore[arg-type]


# --- capacitated_assignment ------------------------------------------------------------


@st.composite
def assignment_problems(draw: st.DrawFn) -> tuple[np.ndarray, int, np.ndarray | None]:
    n = draw(st.integers(1, 30))
    k = draw(st.integers(1, 6))
    capacity = math.ceil(n / k) + draw(st.integers(0, 2))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    kind = draw(st.sampled_from(["uniform", "ties", "skewed"]))
    if kind == "uniform":
        sims = rng.random((n, k))
    elif kind == "ties":
        sims = rng.integers(0, 3, size=(n, k)) / 2.0
    else:
        sims = rng.random((n, k))
        sims[:, : max(1, k // 2)] += 0.7
    warm = rng.random(k) if draw(st.booleans()) else None
    return sims.astype(np.float32), capacity, warm


@settings(max_examples=150, deadline=None)
@given(assignment_problems(), st.sampled_from([0, 1, 1000]))
def test_capacitated_assignment_is_near_optimal(
    problem: tuple[np.ndarray, int, np.ndarray | None], auction_steps: int
) -> None:
    sims, capacity, warm = problem
    n, k = sims.shape
    eps = 1e-3
    labels, _ = capacitated_assignment(
        sims, capacity, prices=warm, eps=eps, auction_steps=auction_steps
    )
    assert np.bincount(labels, minlength=k).max() <= capacity
    # Optimum by expanding every column into `capacity` slots.
    slots = np.repeat(sims.astype(np.float64), capacity, axis=1)
    rows, cols = linear_sum_assignment(slots, maximize=True)
    optimum = slots[rows, cols].sum()
    total = sims[np.arange(n), labels].astype(np.float64).sum()
    assert total >= optimum - n * eps - 1e-6


@settings(max_examples=150, deadline=None)
@given(assignment_problems(), st.sampled_from([0, 1, 1000]))
def test_capacitated_assignment_prices_certify_it(
    problem: tuple[np.ndarray, int, np.ndarray | None], auction_steps: int
) -> None:
    sims, capacity, warm = problem
    n, k = sims.shape
    eps = 1e-3
    labels, prices = capacitated_assignment(
        sims, capacity, prices=warm, eps=eps, auction_steps=auction_steps
    )
    value = sims.astype(np.float64) - prices
    regret = value.max(axis=1) - value[np.arange(n), labels]
    assert regret.max() <= eps + 1e-5
    counts = np.bincount(labels, minlength=k)
    assert np.all(prices[counts < capacity] <= 1e-9)
    assert prices.min() == 0.0


def test_capacitated_assignment_rejects_impossible_capacity() -> None:
    with pytest.raises(ValueError, match="cannot hold"):
        capacitated_assignment(np.zeros((10, 3), dtype=np.float32), 3)


def test_capacitated_assignment_rejects_bad_prices() -> None:
    with pytest.raises(ValueError, match="prices"):
        capacitated_assignment(np.zeros((4, 2), dtype=np.float32), 2, prices=np.zeros(3))


# --- align_centroids -------------------------------------------------------------------


def test_align_recovers_a_known_permutation() -> None:
    rng = np.random.default_rng(13)
    old = unit_rows(rng.random((20, 50)) ** 4)
    perm = rng.permutation(20)
    new = unit_rows(old[perm] + 0.01 * rng.random((20, 50)))
    got = align_centroids(new, old)
    # new[got[i]] must be the noisy copy of old[i]: new[j] copies old[perm[j]].
    assert np.array_equal(perm[got], np.arange(20))
    assert unmatched_new(got, 20).size == 0


def test_align_with_more_new_centroids_leaves_extras_unmatched() -> None:
    rng = np.random.default_rng(14)
    old = unit_rows(rng.random((4, 30)) ** 4)
    extra = unit_rows(rng.random((2, 30)) ** 4)
    new = np.concatenate([extra[:1], old[::-1], extra[1:]])  # old i is at new 4 - i
    got = align_centroids(new, old)
    assert got.tolist() == [4, 3, 2, 1]
    assert unmatched_new(got, 6).tolist() == [0, 5]


def test_align_with_fewer_new_centroids_marks_slots_without_one() -> None:
    rng = np.random.default_rng(15)
    old = unit_rows(rng.random((5, 30)) ** 4)
    new = old[[3, 0]]
    got = align_centroids(new, old)
    assert got.tolist() == [1, -1, -1, 0, -1]


def test_align_rejects_dimension_mismatch() -> None:
    with pytest.raises(ValueError, match="differ in dimension"):
        align_centroids(np.ones((3, 4)), np.ones((3, 5)))


def test_align_rejects_zero_rows() -> None:
    with pytest.raises(ValueError, match="zero rows"):
        align_centroids(np.array([[0.0, 0.0]]), np.ones((1, 2)))


def test_a_checkpoint_that_raises_stops_the_fit_early() -> None:
    # The trainer's time limit and cancellation: the fit calls back often and stops when
    # the callback raises (seeding alone makes k / 32 calls).
    X = np.random.default_rng(0).random((600, 16)).astype(np.float32) + 0.01
    calls: list[int] = []

    class StopFitError(Exception):
        pass

    def checkpoint() -> None:
        calls.append(1)
        if len(calls) == 5:
            raise StopFitError

    with pytest.raises(StopFitError):
        balanced_spherical_kmeans(X, 300, seed=0, reduce_dim=None, checkpoint=checkpoint)
    assert len(calls) == 5
    counted: list[int] = []
    balanced_spherical_kmeans(X, 300, seed=0, reduce_dim=None, checkpoint=lambda: counted.append(1))
    assert len(counted) >= 300 // 32
