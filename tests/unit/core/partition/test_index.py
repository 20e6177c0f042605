"""Centroid index: exact and hnswlib paths agree, owners, the band fallback, input checks."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eldr.core.partition.index import CentroidIndex


def unit(a: np.ndarray) -> np.ndarray:
    rows: np.ndarray = (a / np.linalg.norm(a, axis=-1, keepdims=True)).astype(np.float32)
    return rows


def random_unit(rows: int, dim: int, seed: int) -> np.ndarray:
    return unit(np.random.default_rng(seed).normal(size=(rows, dim)))


def band(scores: np.ndarray, tau: float) -> np.ndarray:
    members: np.ndarray = scores >= scores.max(axis=-1, keepdims=True) - tau
    return members


@pytest.mark.parametrize("num_centroids", [16, 64, 600])
@pytest.mark.parametrize("tau", [0.0, 0.1, 0.2])
def test_hnsw_and_exact_agree(num_centroids: int, tau: float) -> None:
    centroids = random_unit(num_centroids, 32, seed=num_centroids)
    queries = random_unit(300, 32, seed=1000 + num_centroids)
    exact = CentroidIndex(centroids, method="exact").scores_batch(queries, tau=tau)
    approx = CentroidIndex(centroids, method="hnsw").scores_batch(queries, tau=tau)
    assert np.array_equal(exact.argmax(axis=1), approx.argmax(axis=1))
    assert np.array_equal(band(exact, tau), band(approx, tau))
    # Band members carry their exact scores.
    in_band = band(exact, tau)
    np.testing.assert_allclose(approx[in_band], exact[in_band], atol=1e-5)


def test_exact_scores_are_cosines() -> None:
    centroids = np.array([[2.0, 0.0], [0.0, 3.0], [1.0, 1.0]])
    scores = CentroidIndex(centroids, method="exact").scores(np.array([5.0, 0.0]))
    np.testing.assert_allclose(scores, [1.0, 0.0, np.sqrt(0.5)], atol=1e-6)
    assert scores.dtype == np.float32


@pytest.mark.parametrize("method", ["exact", "hnsw"])
def test_worker_score_is_best_of_its_sub_centroids(method: str) -> None:
    centroids = random_unit(30, 8, seed=1)
    owners = np.repeat(np.arange(10), 3)
    index = CentroidIndex(centroids, owners, num_workers=12, method=method, k_retrieve=30)
    query = random_unit(1, 8, seed=2)[0]
    expected = (centroids @ query).reshape(10, 3).max(axis=1)
    scores = index.scores(query)
    assert scores.shape == (12,)
    np.testing.assert_allclose(scores[:10], expected, atol=1e-5)
    assert np.all(scores[10:] == -np.inf)  # workers without a centroid


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 40), st.integers(1, 12), st.integers(0, 2**16))
def test_owner_mapping_matches_a_direct_maximum(
    num_centroids: int, num_workers: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    centroids = random_unit(num_centroids, 6, seed=seed)
    owners = rng.integers(0, num_workers, size=num_centroids)
    query = random_unit(1, 6, seed=seed + 1)[0]
    scores = CentroidIndex(centroids, owners, num_workers=num_workers).scores(query)
    sims = centroids @ query
    for worker in range(num_workers):
        mine = sims[owners == worker]
        expected = mine.max() if mine.size else -np.inf
        assert scores[worker] == pytest.approx(expected, abs=1e-5)


def test_hnsw_without_tau_scores_only_retrieved_workers() -> None:
    index = CentroidIndex(random_unit(64, 16, seed=3), method="hnsw", k_retrieve=4)
    scores = index.scores(random_unit(1, 16, seed=4)[0])
    assert np.isfinite(scores).sum() == 4


def test_band_cut_short_by_retrieval_falls_back_to_exact() -> None:
    centroids = random_unit(64, 16, seed=5)
    query = random_unit(1, 16, seed=6)[0]
    index = CentroidIndex(centroids, method="hnsw", k_retrieve=4)
    # With tau = 2 every centroid is in the band, so 4 retrieved cannot be the whole band.
    scores = index.scores(query, tau=2.0)
    np.testing.assert_allclose(scores, centroids @ query, atol=1e-5)


def test_method_auto_uses_the_threshold() -> None:
    assert CentroidIndex(random_unit(255, 8, seed=7)).method == "exact"
    assert CentroidIndex(random_unit(256, 8, seed=7)).method == "hnsw"
    assert CentroidIndex(random_unit(10, 8, seed=7), exact_threshold=5).method == "hnsw"


def test_top_workers_orders_by_score_then_slot() -> None:
    centroids = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    index = CentroidIndex(centroids, method="exact")
    assert index.top_workers(np.array([1.0, 0.0]), 3).tolist() == [0, 2, 3]


def test_top_workers_counts_workers_not_centroids() -> None:
    centroids = random_unit(40, 8, seed=8)
    owners = np.repeat(np.arange(4), 10)
    index = CentroidIndex(centroids, owners, method="hnsw", k_retrieve=5)
    query = centroids[0]
    top = index.top_workers(query, 3)
    exact = CentroidIndex(centroids, owners, method="exact").scores(query)
    assert top.tolist() == np.argsort(-exact, kind="stable")[:3].tolist()


def test_top_workers_returns_at_most_the_workers_with_centroids() -> None:
    index = CentroidIndex(random_unit(2, 4, seed=9), np.array([0, 2]), num_workers=5)
    assert sorted(index.top_workers(random_unit(1, 4, seed=10)[0], 10).tolist()) == [0, 2]


def test_hnsw_build_is_reproducible() -> None:
    centroids = random_unit(400, 24, seed=11)
    queries = random_unit(50, 24, seed=12)
    a = CentroidIndex(centroids, method="hnsw", k_retrieve=8).scores_batch(queries)
    b = CentroidIndex(centroids, method="hnsw", k_retrieve=8).scores_batch(queries)
    assert np.array_equal(a, b)


def test_index_copies_its_centroids() -> None:
    centroids = random_unit(5, 4, seed=13)
    index = CentroidIndex(centroids, method="exact")
    query = centroids[1].copy()
    before = index.scores(query)
    centroids[:] = 0.0
    assert np.array_equal(index.scores(query), before)


@pytest.mark.parametrize("method", ["exact", "hnsw"])
def test_query_dimension_mismatch_raises(method: str) -> None:
    index = CentroidIndex(random_unit(8, 4, seed=14), method=method)
    with pytest.raises(ValueError, match="does not match the index dimension"):
        index.scores(np.ones(5))
    with pytest.raises(ValueError, match="does not match the index dimension"):
        index.scores_batch(np.ones((2, 3)))


def test_zero_query_raises() -> None:
    with pytest.raises(ValueError, match="zero vector"):
        CentroidIndex(random_unit(3, 4, seed=15)).scores(np.zeros(4))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"centroids": np.ones(3)}, r"\[M, d\]"),
        ({"centroids": np.array([[1.0, np.nan]])}, "NaN or infinite"),
        ({"centroids": np.array([[0.0, 0.0]])}, "zero rows"),
        ({"centroids": np.ones((3, 2)), "owners": np.array([0, 1])}, "one per centroid"),
        ({"centroids": np.ones((2, 2)), "owners": np.array([0, -1])}, "non-negative"),
        ({"centroids": np.ones((2, 2)), "owners": np.array([0, 3]), "num_workers": 3}, "small"),
        ({"centroids": np.ones((2, 2)), "method": "faiss"}, "method must be"),
    ],
)
def test_invalid_construction_raises(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CentroidIndex(**kwargs)  # type: ignore[arg-type]


def test_negative_tau_raises() -> None:
    with pytest.raises(ValueError, match="tau"):
        CentroidIndex(random_unit(3, 4, seed=16)).scores(np.ones(4), tau=-0.1)


@pytest.mark.parametrize(
    ("num_centroids", "method", "recall"),
    [(16, "exact", 1.0), (200, "exact", 0.95), (600, "hnsw", 0.8)],
)
def test_nearest_scores_exactly_what_its_reduced_search_retrieves(
    num_centroids: int, method: str, recall: float
) -> None:
    """`nearest` searches a reduced space (64 coordinates here), then scores exactly. On
    clustered centroids in 96 dimensions with isotropic noise (harder for a reduced space
    than signatures, whose centroids share their leading directions: docs/BENCHMARKS.md)
    it finds the best centroid in at least 99% of queries and the given share of the top
    k; the scores it returns are exact."""
    rng = np.random.default_rng(num_centroids)
    dim, k = 96, 16
    topics = random_unit(12, dim, seed=7)
    noise = 0.35 * rng.normal(size=(num_centroids, dim))
    centroids = unit(topics[rng.integers(12, size=num_centroids)] + noise)
    queries = unit(topics[rng.integers(12, size=300)] + 0.5 * rng.normal(size=(300, dim)))
    index = CentroidIndex(centroids, method=method, reduced_dims=64)
    best = found = 0
    for q in queries:
        ids, sims = index.nearest(q, k)
        exact = index.exact_scores(q)
        top = np.argsort(-exact, kind="stable")[:k]
        np.testing.assert_allclose(sims, exact[ids], atol=1e-5)
        best += int(ids[0] == top[0])
        found += len(set(ids.tolist()) & set(top.tolist()))
    assert best >= 0.99 * len(queries)
    assert found >= recall * k * len(queries)


def test_with_fewer_centroids_than_reduced_coordinates_nearest_is_exact() -> None:
    centroids = random_unit(20, 64, seed=21)
    index = CentroidIndex(centroids, reduced_dims=32)
    assert index.reduced_dims == 20
    for q in random_unit(50, 64, seed=22):
        ids, _ = index.nearest(q, 5)
        exact = index.exact_scores(q)
        assert ids.tolist() == np.argsort(-exact, kind="stable")[:5].tolist()
