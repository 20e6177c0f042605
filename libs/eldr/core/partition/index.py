"""Centroid index: per-worker similarity scores for one request signature.

The router scores every decode worker by the cosine similarity between the request's
signature and the worker's centroid(s); a worker may own several sub-centroids, and its
score is the best of them. With few centroids an exact product `C @ q` is fastest; from
a few hundred on, an hnswlib inner-product graph retrieves the nearest `k_retrieve`
centroids faster (measured here: numpy wins below about 256-512 centroids, hnswlib from
about 512).

The routing band rule keeps every worker whose score is within `tau` of the best. A
top-k' search can cut that band short, so `scores(q, tau=...)` checks whether the k'-th
retrieved similarity is still inside the band and, if it is, answers exactly instead.

`nearest(q, k)` is the default routing profile's candidate stage: the k centroids most
similar to q with their exact similarities, at a cost that does not grow with the number
of centroids. The search runs in a reduced space (`reduced_dims` coordinates of an
orthonormal basis of the centroids' span, their leading principal directions when there
are more centroids than coordinates; lossless when there are fewer): hnswlib from
`exact_threshold` centroids on, an exact product below it, retrieving 2k; the retrieved
centroids are then scored exactly in the full space and the best k kept. With at most
`reduced_dims` centroids the reduced space holds them exactly, so the search finds the
true nearest; with more it can miss a near one (measured in
tests/unit/core/partition/test_index.py).

An index is immutable once built: build a new one off the request path and swap the
reference; queries on the old one stay valid meanwhile.
"""

from __future__ import annotations

from typing import Literal

import hnswlib
import numpy as np

__all__ = ["CentroidIndex"]


class CentroidIndex:
    """Similarity index over M unit (sub-)centroids, each owned by a worker slot.

    centroids: [M, d] real matrix; rows are normalised to unit length here (zero rows
        are rejected). owners: int [M], the worker slot of each centroid (default: one
        centroid per worker, centroid i owned by worker i). num_workers: number of
        worker slots (default max(owners) + 1); workers without a centroid always score
        -inf.
    method: "exact" (C @ q), "hnsw" (hnswlib, space "ip"), or "auto": exact below
        `exact_threshold` centroids, hnsw from there on.
    k_retrieve: centroids an hnsw query retrieves (k'), at most M.
    ef_search: hnswlib's query-time candidate list (raised to k_retrieve if smaller);
        128 kept the hnsw bands identical to exact ones in tests on random vectors,
        where 64 missed about 1% of band members at 600 centroids.
    hnsw_m: hnswlib's graph degree M (memory and build time grow with it).
    ef_construction: hnswlib's build-time candidate list.
    random_seed: hnswlib's level-assignment seed, fixed so builds are reproducible.
    num_threads: threads used to build the graph and answer batch queries; 1 keeps the
        build deterministic.
    """

    def __init__(
        self,
        centroids: np.ndarray,
        owners: np.ndarray | None = None,
        *,
        num_workers: int | None = None,
        method: str = "auto",
        exact_threshold: int = 256,
        k_retrieve: int = 32,
        ef_search: int = 128,
        hnsw_m: int = 16,
        ef_construction: int = 200,
        random_seed: int = 100,
        num_threads: int = 1,
        reduced_dims: int = 64,
    ) -> None:
        C = np.array(centroids, dtype=np.float32)
        if C.ndim != 2 or C.shape[0] < 1 or C.shape[1] < 1:
            raise ValueError(f"centroids must be a non-empty [M, d] matrix, got {C.shape}")
        if not np.isfinite(C).all():
            raise ValueError("centroids contain NaN or infinite values")
        norms = np.linalg.norm(C, axis=1)
        if (norms == 0.0).any():
            raise ValueError("centroids contain zero rows, which have no direction")
        C /= norms[:, None]
        m = C.shape[0]

        own = np.arange(m) if owners is None else np.asarray(owners)
        if own.shape != (m,) or not np.issubdtype(own.dtype, np.integer):
            raise ValueError(f"owners must be {m} integers (one per centroid), got {own.shape}")
        own = own.astype(np.int64)
        if (own < 0).any():
            raise ValueError("owners must be non-negative worker slots")
        workers = int(own.max()) + 1 if num_workers is None else int(num_workers)
        if workers <= int(own.max()):
            raise ValueError(f"num_workers {workers} is too small for owner {int(own.max())}")
        if method not in ("auto", "exact", "hnsw"):
            raise ValueError(f"method must be 'auto', 'exact' or 'hnsw', got {method!r}")
        if k_retrieve < 1 or ef_search < 1 or hnsw_m < 2 or ef_construction < 1:
            raise ValueError("k_retrieve, ef_search, ef_construction must be >= 1, hnsw_m >= 2")
        if reduced_dims < 1:
            raise ValueError(f"reduced_dims must be >= 1, got {reduced_dims}")

        self._centroids = C
        self._owners = own
        self._num_workers = workers
        use_exact = m < exact_threshold if method == "auto" else method == "exact"
        self._method: Literal["exact", "hnsw"] = "exact" if use_exact else "hnsw"
        self._k_retrieve = min(k_retrieve, m)
        self._num_threads = num_threads
        # Per-worker maximum by segments: centroids sorted by owner.
        self._identity = workers == m and bool(np.array_equal(own, np.arange(m)))
        self._order = np.argsort(own, kind="stable")
        owned = np.bincount(own, minlength=workers)
        self._owning_workers = np.flatnonzero(owned)
        self._segment_starts = (np.cumsum(owned) - owned)[self._owning_workers]

        self._basis = _span_basis(C, reduced_dims, random_seed)
        """float32 [d, r]: orthonormal columns spanning (or approximating) the centroids."""
        self._reduced = np.ascontiguousarray(C @ self._basis)
        """float32 [M, r]: the centroids in the reduced space."""
        self._ef_search = ef_search
        self._hnsw: hnswlib.Index | None = None
        if self._method == "hnsw":
            index = hnswlib.Index(space="ip", dim=self._reduced.shape[1])
            index.init_index(
                max_elements=m, ef_construction=ef_construction, M=hnsw_m, random_seed=random_seed
            )
            index.add_items(self._reduced, np.arange(m), num_threads=num_threads)
            index.set_ef(max(ef_search, self._k_retrieve))
            self._hnsw = index

    @property
    def method(self) -> Literal["exact", "hnsw"]:
        """The search actually used ("auto" resolved)."""
        return self._method

    @property
    def dim(self) -> int:
        return int(self._centroids.shape[1])

    @property
    def num_centroids(self) -> int:
        return int(self._centroids.shape[0])

    @property
    def num_workers(self) -> int:
        return self._num_workers

    @property
    def owners(self) -> np.ndarray:
        return self._owners.copy()

    def scores(self, q: np.ndarray, tau: float | None = None) -> np.ndarray:
        """float32 [num_workers]: each worker's best cosine similarity to q.

        Exact method: every worker with a centroid gets its exact score. HNSW: workers
        with no retrieved centroid get -inf, and a worker's score is its best retrieved
        sub-centroid. With `tau`, the scores are guaranteed (up to HNSW recall) to hold
        every worker whose score is >= max - tau, with its exact score: when the k'-th
        retrieved similarity is itself within tau of the best, the band may continue
        beyond what was retrieved and the exact scores are returned instead.
        """
        worker_scores: np.ndarray = self._scores(self._as_queries(q, single=True), tau)[0]
        return worker_scores

    def scores_batch(self, Q: np.ndarray, tau: float | None = None) -> np.ndarray:
        """float32 [B, num_workers]: `scores` for each row of Q [B, d]."""
        return self._scores(self._as_queries(Q, single=False), tau)

    @property
    def reduced_dims(self) -> int:
        """Coordinates of the reduced space the search runs in."""
        return int(self._basis.shape[1])

    def nearest(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(centroid ids, their exact cosine similarities to q): the k most similar
        centroids (all of them when there are at most k), best first, ties by id.

        Searched in the reduced space (2k retrieved: hnswlib from `exact_threshold`
        centroids, else an exact product), then scored exactly; the work grows with k and
        the reduced coordinates, not with the number of centroids."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        return self.nearest_unit(self._as_queries(q, single=True)[0], k)

    def nearest_unit(self, query: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """`nearest` for a query the caller already made a finite unit float32 [dim] vector
        (the router's signatures are), without checking it again."""
        m = self.num_centroids
        if m <= k:
            sims = self._centroids @ query
            order = np.argsort(-sims, kind="stable")  # ties: lower id first
            return order.astype(np.int64), sims[order].astype(np.float32)
        want = min(m, 2 * k)
        # Dense products: numpy gathers scattered cells far slower than it multiplies.
        reduced = query @ self._basis
        if self._hnsw is not None:
            # recall of the reduced search: tests/unit/core/partition/test_index.py
            self._hnsw.set_ef(2 * want)
            labels, _ = self._hnsw.knn_query(reduced[None, :], k=want, num_threads=1)
            ids = np.sort(labels[0].astype(np.int64))
        else:
            ids = np.sort(np.argpartition(-(self._reduced @ reduced), want - 1)[:want])
        sims = self._centroids.take(ids, axis=0) @ query  # exactly, the retrieved only
        order = np.argsort(-sims, kind="stable")[:k]
        return ids[order], sims[order].astype(np.float32)

    def nearest_workers(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(worker slots, their scores): the owners of the k centroids nearest the unit
        query q, each scored by its best retrieved centroid, best first."""
        ids, sims = self.nearest_unit(q, k)
        slots = self._owners[ids]
        if self._identity:
            return slots, sims
        # Keep each worker's first (best) centroid.
        _, first = np.unique(slots, return_index=True)
        first.sort()
        return slots[first], sims[first]

    def _scores(self, queries: np.ndarray, tau: float | None) -> np.ndarray:
        if tau is not None and not tau >= 0.0:
            raise ValueError(f"tau must be >= 0, got {tau}")
        if self._hnsw is None:
            return self._exact(queries)
        self._hnsw.set_ef(max(self._ef_search, self._k_retrieve))
        labels, _ = self._hnsw.knn_query(
            queries @ self._basis, k=self._k_retrieve, num_threads=self._num_threads
        )
        labels = labels.astype(np.int64)
        # Retrieved in the reduced space, scored exactly.
        sims = np.einsum("bd,bkd->bk", queries, self._centroids[labels]).astype(np.float32)
        out = np.full((queries.shape[0], self._num_workers), -np.inf, dtype=np.float32)
        rows = np.repeat(np.arange(queries.shape[0]), labels.shape[1])
        np.maximum.at(out, (rows, self._owners[labels.ravel()]), sims.ravel())
        if tau is not None and self._k_retrieve < self.num_centroids:
            cut_short = sims.min(axis=1) >= sims.max(axis=1) - tau
            if cut_short.any():
                out[cut_short] = self._exact(queries[cut_short])
        return out

    def top_workers(self, q: np.ndarray, n: int) -> np.ndarray:
        """int64: the n best-scoring workers for q, best first (ties: lower slot first).

        Only workers that own a centroid are ranked, so fewer than n come back when
        fewer own one. Falls back to exact scores when the retrieved centroids belong to
        fewer than n workers.
        """
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        query = self._as_queries(q, single=True)
        worker_scores: np.ndarray = self._scores(query, None)[0]
        wanted = min(n, self._owning_workers.size)
        if int(np.isfinite(worker_scores).sum()) < wanted:
            worker_scores = self._exact(query)[0]
        ranked = np.lexsort((np.arange(self._num_workers), -worker_scores))
        return ranked[:wanted].astype(np.int64)

    def _as_queries(self, Q: np.ndarray, *, single: bool) -> np.ndarray:
        queries = np.asarray(Q, dtype=np.float32)
        expected = 1 if single else 2
        if queries.ndim != expected:
            shape = "[d]" if single else "[B, d]"
            raise ValueError(f"query must be {shape}, got shape {queries.shape}")
        queries = queries.reshape(-1, queries.shape[-1])
        if queries.shape[1] != self.dim:
            raise ValueError(
                f"query dimension {queries.shape[1]} does not match the index dimension {self.dim}"
            )
        if not np.isfinite(queries).all():
            raise ValueError("query contains NaN or infinite values")
        norms = np.linalg.norm(queries, axis=1)
        if (norms == 0.0).any():
            raise ValueError("query is the zero vector, which has no cosine similarity")
        return np.ascontiguousarray(queries / norms[:, None])

    def exact_scores(self, q: np.ndarray) -> np.ndarray:
        """float32 [num_workers]: each worker's exact best cosine similarity to q (every
        centroid scored; what a replay checks recorded scores against)."""
        scores: np.ndarray = self._exact(self._as_queries(q, single=True))[0]
        return scores

    def _exact(self, queries: np.ndarray) -> np.ndarray:
        sims = queries @ self._centroids.T  # [B, M]
        if self._identity:
            return sims.astype(np.float32, copy=False)
        out = np.full((queries.shape[0], self._num_workers), -np.inf, dtype=np.float32)
        out[:, self._owning_workers] = np.maximum.reduceat(
            sims[:, self._order], self._segment_starts, axis=1
        )
        return out


def _span_basis(centroids: np.ndarray, dims: int, seed: int) -> np.ndarray:
    """float32 [d, r]: orthonormal columns spanning the rows of `centroids` [M, d] when
    r = min(M, d) <= dims (exact), else approximating their leading `dims` principal
    directions (a randomised range finder with two power iterations, seeded: the same
    centroids always give the same basis)."""
    m, d = centroids.shape
    C = centroids.astype(np.float64)
    if min(m, d) <= dims:
        q, _ = np.linalg.qr(C.T)
        return np.ascontiguousarray(q[:, : min(m, d)], dtype=np.float32)
    rng = np.random.default_rng(seed)
    sketch = C.T @ rng.standard_normal((m, dims + 8))
    for _ in range(2):
        sketch, _ = np.linalg.qr(sketch)
        sketch = C.T @ (C @ sketch)
    q, _ = np.linalg.qr(sketch)
    # Rotate onto the principal directions within the sketch and keep the leading `dims`.
    _, _, vt = np.linalg.svd(C @ q, full_matrices=False)
    return np.ascontiguousarray(q @ vt.T[:, :dims], dtype=np.float32)
