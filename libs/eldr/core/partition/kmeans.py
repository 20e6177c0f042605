"""Balanced spherical K-means: the partition of signature space into decode workers.

One cluster per decode worker. Similar signatures should share a worker (expert locality),
but no worker may take more than its share, so every cluster is capped at `capacity`
points (default ceil(N/k)), a hard guarantee. Rows are compared by cosine similarity;
centroids are unit vectors.

How the fit works:

* Rows are treated as directions (each is scaled to unit length; zero rows are rejected).
* Above `reduce_dim` dimensions the iterations run on a projection onto the top right
  singular vectors of the (row-normalised) data, estimated by a randomised SVD of a row
  subsample. No centring: the projection then preserves inner products, which is what the
  cosine objective uses. The projected rows are not renormalised, so a projected inner
  product approximates the original cosine.
* k-means++ seeding (greedy: the best of 2 + ln k sampled candidates per step).
* Assignment under the cap is a transportation problem, solved by an auction on
  per-cluster prices (`capacitated_assignment`): every point takes its best
  `similarity - price`, and the price of an over-full cluster rises until exactly
  `capacity` points still want it. An exact shortest-path step moves whatever the
  auction leaves over, so the cap always holds, and the result is optimal to within
  `eps` (1e-3) cosine per point. Prices carry over between iterations (warm start).
* Centroids are the renormalised means of their points, every iteration.
* The final centroids are recomputed in the original dimension as the normalised means of
  the assigned original rows, so they can score full-dimension signatures directly.

`inertia` is the sum over points of 1 - cos(x, centroid of x's cluster), computed in the
original dimension with the final centroids (0 is perfect, at most 2 per point).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linear_sum_assignment

__all__ = [
    "KMeansResult",
    "align_centroids",
    "balanced_spherical_kmeans",
    "capacitated_assignment",
    "spherical_kmeans",
    "unmatched_new",
]

# Rows per block when streaming over the input; bounds temporary memory to
# _CHUNK_ROWS * d * 4 bytes (100 MB at d = 6,144).
_CHUNK_ROWS = 4096
# Rows sampled to estimate the projection; the estimate of a 128-dimensional subspace
# from this many rows is as good as from all of them for K-means purposes.
_PCA_SAMPLE_ROWS = 8192
_PCA_OVERSAMPLE = 10
_PCA_POWER_ITERATIONS = 2
# Auction price increment: the assignment is optimal to within this much similarity per
# point; smaller values mean more auction steps.
_AUCTION_EPS = 1e-3


@dataclass(frozen=True)
class KMeansResult:
    """Result of a spherical K-means fit.

    centroids: float32 [k, d] unit rows in the input's (original) dimension.
    labels: int32 [N], cluster of each row.
    sizes: int64 [k], points per cluster.
    prices: float32 [k], final per-cluster prices of the capacity auction, on the cosine
        scale (of the projection when one was used), smallest 0; all zero for
        unconstrained fits. Subtracting them from routing scores steers traffic the way
        the balanced fit did.
    inertia: sum over points of 1 - cos(x, its centroid), original dimension, final
        centroids.
    iterations: assignment steps run.
    converged: True when the largest centroid move (1 - cos between successive
        centroids) fell below `tol` before `max_iter`.
    reduce_dim_used: dimension of the projection the iterations ran in (at most
        `reduce_dim`; fewer when the data has fewer independent directions), None if
        the iterations ran in the original dimension.
    capacity: cluster size cap (None for unconstrained fits).
    """

    centroids: np.ndarray
    labels: np.ndarray
    sizes: np.ndarray
    prices: np.ndarray
    inertia: float
    iterations: int
    converged: bool
    reduce_dim_used: int | None
    capacity: int | None


def balanced_spherical_kmeans(
    X: np.ndarray,
    k: int,
    *,
    seed: int,
    max_iter: int = 50,
    capacity: int | None = None,
    reduce_dim: int | None = 128,
    tol: float = 1e-4,
    on_iteration: Callable[[int], None] | None = None,
    checkpoint: Callable[[], None] | None = None,
) -> KMeansResult:
    """Spherical K-means with every cluster holding at most `capacity` rows.

    X: real matrix [N, d] (float32 avoids any full copy; rows need not be unit length but
    must be non-zero and finite). k: 1 <= k <= N. capacity: defaults to ceil(N / k); must
    satisfy k * capacity >= N. A cluster can end up empty only when
    (k - 1) * capacity >= N. reduce_dim: run the iterations in a projection to this many
    dimensions when d is larger (None or 0: never). on_iteration: called with the iteration
    number after each iteration (progress reporting). checkpoint: called often (between
    seeding steps, assignment rounds and iterations, at least every few hundred ms of work
    at K = 4,200); it may raise to abandon the fit (a deadline, a cancellation).
    Deterministic for a given seed.
    """
    n = _check_input(X, k)
    if capacity is None:
        capacity = math.ceil(n / k)
    if capacity < 1 or capacity * k < n:
        raise ValueError(
            f"capacity {capacity} cannot hold {n} rows in {k} clusters "
            f"(need capacity >= {math.ceil(n / k)})"
        )
    return _fit(
        X,
        k,
        seed=seed,
        max_iter=max_iter,
        capacity=capacity,
        reduce_dim=reduce_dim,
        tol=tol,
        on_iteration=on_iteration,
        checkpoint=checkpoint,
    )


def spherical_kmeans(
    X: np.ndarray,
    k: int,
    *,
    seed: int,
    max_iter: int = 50,
    reduce_dim: int | None = 128,
    tol: float = 1e-4,
    on_iteration: Callable[[int], None] | None = None,
) -> KMeansResult:
    """Unconstrained spherical K-means, the reference for what balance costs.

    Same input rules, projection and seeding as `balanced_spherical_kmeans` (the same
    seed gives the same initial centroids); a cluster that empties is reseeded with the
    point farthest from its centroid.
    """
    _check_input(X, k)
    return _fit(
        X,
        k,
        seed=seed,
        max_iter=max_iter,
        capacity=None,
        reduce_dim=reduce_dim,
        tol=tol,
        on_iteration=on_iteration,
    )


def capacitated_assignment(
    sims: np.ndarray,
    capacity: int,
    *,
    prices: np.ndarray | None = None,
    eps: float = _AUCTION_EPS,
    eps_start: float = 1e-2,
    auction_steps: int | None = None,
    checkpoint: Callable[[], None] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Assign each row of `sims` [N, K] to a column, at most `capacity` rows per column,
    maximising total similarity.

    Returns `(labels, prices)`: int64 labels [N] and float64 prices [K], smallest 0.
    Every column holds at most `capacity` rows, always. Every row's column maximises
    `sims[i] - prices` to within `eps`, and columns with room left have price 0. These
    are the optimality conditions of the problem's linear program relaxed by `eps`, so
    the total is within N * eps of the optimum. `prices` warm-starts the auction (e.g.
    with the previous K-means iteration's prices); any warm start gives the same result
    guarantees.

    How:

    1. Warm-start prices of columns that would have room are lowered, each to the level
       at which it would be full (or 0).
    2. Forward auction with eps-scaling (increments `eps_start`, then 10 times smaller
       down to `eps`): prices only rise; an over-full column's price rises to the level
       at which exactly `capacity` of its rows still prefer it. Between phases, rows
       that lose more than the next increment by staying move to their best column.
    3. The auction is fast at moving many rows but slow in its endgame, when rows that
       are nearly indifferent between full columns are traded back and forth in eps
       steps; so each phase gets a budget of `auction_steps` price moves (default
       10 * K + 500). Any overflow left is then moved exactly, one row at a time along
       the cheapest chain of moves into a column with room (`_MoveGraph`), and chains
       that still gain similarity by filling a column with room are applied. The cap
       therefore always holds.
    4. When step 3 ran or a column with room kept a positive price, prices are
       recomputed from the final assignment as shortest-path potentials of the move
       graph, so they again certify the assignment.

    `checkpoint`, if given, is called every 64 price moves (it may raise to abandon).
    """
    sims = np.asarray(sims)
    if sims.ndim != 2 or sims.shape[0] < 1 or sims.shape[1] < 1:
        raise ValueError(f"sims must be a non-empty 2-D matrix, got shape {sims.shape}")
    n, k = sims.shape
    if capacity < 1 or capacity * k < n:
        raise ValueError(f"capacity {capacity} x {k} columns cannot hold {n} rows")
    if not eps > 0.0:
        raise ValueError(f"eps must be positive, got {eps}")
    if auction_steps is None:
        auction_steps = 10 * k + 500
    if prices is None:
        price = np.zeros(k)
        labels = sims.argmax(axis=1)
    else:
        price = np.array(prices, dtype=np.float64).reshape(-1)
        if price.shape != (k,) or not np.isfinite(price).all():
            raise ValueError(f"prices must be {k} finite numbers")
        price -= price.min()
        labels = _lower_stale_prices(sims, capacity, price, checkpoint)
    counts = np.bincount(labels, minlength=k)

    phase_eps = max(eps, eps_start)
    while True:
        if checkpoint is not None:
            checkpoint()
        steps = 0
        while steps < auction_steps:
            over = np.flatnonzero(counts > capacity)
            if over.size == 0:
                break
            for col in over[np.argsort(-counts[over], kind="stable")]:
                if counts[col] > capacity and steps < auction_steps:
                    _shed(sims, int(col), capacity, price, labels, counts, phase_eps)
                    steps += 1
                    if checkpoint is not None and steps % 64 == 0:
                        checkpoint()
        if phase_eps <= eps:
            break
        phase_eps = max(eps, phase_eps / 10.0)
        value = sims - price.astype(sims.dtype)
        best = value.argmax(axis=1)
        rows = np.arange(n)
        moving = value[rows, best] - value[rows, labels] > phase_eps
        labels[moving] = best[moving]
        counts = np.bincount(labels, minlength=k)

    price -= price.min()
    if (counts > capacity).any() or ((counts < capacity) & (price > 0.0)).any():
        moves = _MoveGraph(sims, labels, eps, checkpoint)
        moves.drain_overflow(capacity, counts)
        moves.fill_room(capacity, counts)
        price = moves.potentials(capacity, counts)
        price -= price.min()
    return labels, price


def _no_tick() -> None:
    return None


_MOVE_BLOCK = 512
"""Rows of the move graph's K x K matrices one step of its loops touches (a checkpoint
between steps)."""


def _lower_stale_prices(
    sims: np.ndarray,
    capacity: int,
    price: np.ndarray,
    checkpoint: Callable[[], None] | None = None,
) -> np.ndarray:
    """Lower the price of every column that has room at the current prices to the level
    at which it would just fill (not below 0), each column on its own; returns the
    labels at the new prices. A forward auction cannot lower a price, and a column
    left too expensive makes it trade rows among the others in eps steps."""
    n, k = sims.shape
    value = sims - price.astype(sims.dtype)
    labels: np.ndarray = value.argmax(axis=1)
    counts = np.bincount(labels, minlength=k)
    stale = np.flatnonzero((counts < capacity) & (price > 0.0))
    if stale.size == 0:
        return labels
    current = value[np.arange(n), labels]
    stale_values = np.ascontiguousarray(value[:, stale].T)  # [stale, N]
    for j, col in enumerate(stale):
        if checkpoint is not None and j % 64 == 0:
            checkpoint()
        wanted = min(capacity - int(counts[col]), n - int(counts[col]))
        if wanted == 0:
            continue
        # What each row gives up by moving to this column at the current prices.
        loss = current - stale_values[j]
        loss[labels == col] = np.inf
        drop = float(np.partition(loss, wanted - 1)[wanted - 1])
        price[col] = max(price[col] - drop, 0.0)
    price -= price.min()
    relabelled: np.ndarray = (sims - price.astype(sims.dtype)).argmax(axis=1)
    return relabelled


def _shed(
    sims: np.ndarray,
    col: int,
    capacity: int,
    price: np.ndarray,
    labels: np.ndarray,
    counts: np.ndarray,
    eps: float,
) -> None:
    """Raise an over-full column's price until only `capacity` of its rows still prefer
    it (to within eps); the others move to their next best column."""
    members = np.flatnonzero(labels == col)
    # float32 is plenty: margins matter to within eps >= 1e-6, not to the last bit.
    value = sims[members] - price.astype(sims.dtype)
    own = value[:, col].copy()
    value[:, col] = -np.inf
    alt = value.argmax(axis=1)
    margin = own - value[np.arange(members.size), alt]
    # Keep the `capacity` rows that lose most by leaving; the rest leave.
    split = members.size - capacity
    leave = np.argpartition(margin, split - 1)[:split]
    price[col] += max(float(margin[leave].max()) + eps, 0.0)
    labels[members[leave]] = alt[leave]
    counts[col] = capacity
    counts += np.bincount(alt[leave], minlength=counts.size)


class _MoveGraph:
    """Columns as nodes; edge a -> b costs the least similarity lost by moving one row
    of column a to column b, plus `eps` (`cost[a, b]`; that row is `row[a, b]`).

    Moving one row along each edge of a chain a -> ... -> b moves one unit of load from
    a to b and loses the chain's cost minus eps per edge; a closed chain (a cycle)
    moves no load. The eps per edge makes every cycle non-negative for an assignment
    that an eps-auction produced, so shortest chains are well defined, and it makes
    only chains that gain more than eps per move worth applying.
    """

    def __init__(
        self,
        sims: np.ndarray,
        labels: np.ndarray,
        eps: float,
        checkpoint: Callable[[], None] | None = None,
    ) -> None:
        self.sims = sims
        self.labels = labels
        self.eps = eps
        # Called once per round of every loop below: at K = 4,096 a drain of the overflow
        # ran 5.8 s between two checkpoints of the auction before it had any (measured on
        # the 2-core machine, 4,300 rows), so a fit deadline overshot by that much.
        self.tick = checkpoint or _no_tick
        k = sims.shape[1]
        self.cost = np.full((k, k), np.inf)
        self.row = np.zeros((k, k), dtype=np.int64)
        for col in range(k):
            if col % 256 == 0:
                self.tick()
            self._refresh(col)

    def _refresh(self, col: int) -> None:
        members = np.flatnonzero(self.labels == col)
        if members.size == 0:
            self.cost[col] = np.inf
            return
        block = self.sims[members].astype(np.float64)
        loss = block[:, col : col + 1] - block
        best = loss.argmin(axis=0)
        self.cost[col] = loss[best, np.arange(loss.shape[1])] + self.eps
        self.row[col] = members[best]
        self.cost[col, col] = np.inf

    def _move_along(self, nodes: list[int]) -> None:
        """Move one row along each edge of the node sequence (a chain or a closed cycle)."""
        moving = [(int(self.row[a, b]), b) for a, b in itertools.pairwise(nodes)]
        for r, b in moving:
            self.labels[r] = b
        for col in set(nodes):
            self._refresh(col)

    def _shortest(self, dist: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Bellman-Ford from the nodes with finite `dist` (their start values); returns
        distances and predecessors (-1: a start node). Each round relaxes only the edges
        out of nodes whose distance changed in the round before."""
        k = dist.size
        dist = dist.copy()
        pred = np.full(k, -1, dtype=np.int64)
        frontier = np.flatnonzero(np.isfinite(dist))
        columns = np.arange(k)
        for _ in range(k):
            # In blocks of frontier rows: a round over every node at K = 4,096 is a
            # 128 MB temporary and over a second of work on a loaded machine. Earlier
            # blocks win ties, as one argmin over the whole frontier would.
            shorter = np.full(k, np.inf)
            via = np.zeros(k, dtype=np.int64)
            for start in range(0, frontier.size, _MOVE_BLOCK):
                self.tick()
                rows = frontier[start : start + _MOVE_BLOCK]
                through = dist[rows, None] + self.cost[rows]
                arg = through.argmin(axis=0)
                value = through[arg, columns]
                won = value < shorter
                shorter[won] = value[won]
                via[won] = rows[arg[won]]
            better = shorter < dist - 1e-12
            if not better.any():
                break
            dist[better] = shorter[better]
            pred[better] = via[better]
            frontier = np.flatnonzero(better)
        return dist, pred

    def _apply_chain_to(self, target: int, pred: np.ndarray) -> int | None:
        """Apply the chain that ends at `target` and return its start node. Should the
        predecessors loop (a cycle of negative cost, possible only through rounding),
        apply that cycle instead and return None."""
        chain = [target]
        while pred[chain[-1]] >= 0 and pred[chain[-1]] not in chain:
            chain.append(int(pred[chain[-1]]))
        if pred[chain[-1]] >= 0:
            start = int(pred[chain[-1]])
            cycle = chain[chain.index(start) :][::-1]
            self._move_along([*cycle, cycle[0]])
            return None
        chain.reverse()
        self._move_along(chain)
        return chain[0]

    def drain_overflow(self, capacity: int, counts: np.ndarray) -> None:
        """Move rows out of over-full columns along cheapest chains into columns with
        room, one row at a time (successive shortest paths)."""
        while (counts > capacity).any():
            dist, pred = self._shortest(np.where(counts > capacity, 0.0, np.inf))
            room = np.flatnonzero((counts < capacity) & np.isfinite(dist))
            target = int(room[dist[room].argmin()])
            source = self._apply_chain_to(target, pred)
            if source is not None:
                counts[source] -= 1
                counts[target] += 1

    def fill_room(self, capacity: int, counts: np.ndarray) -> None:
        """Apply chains of negative cost that end in a column with room, until none."""
        k = counts.size
        while True:
            room = np.flatnonzero(counts < capacity)
            if room.size == 0:
                return
            dist, pred = self._shortest(np.zeros(k))
            target = int(room[dist[room].argmin()])
            if dist[target] >= 0.0:
                return
            source = self._apply_chain_to(target, pred)
            if source is not None:
                counts[source] -= 1
                counts[target] += 1

    def potentials(self, capacity: int, counts: np.ndarray) -> np.ndarray:
        """Prices with price[a] <= price[b] + cost[a, b] on every edge, so that every row
        is within eps of its best column: the cheapest chain cost to a column with room
        (0 for those), or, when every column is full, minus the cheapest chain cost from
        anywhere."""
        k = counts.size
        room = counts < capacity
        if not room.any():
            dist, _ = self._shortest(np.zeros(k))
            return -dist
        price = np.where(room, 0.0, np.inf)
        for _ in range(k):
            reach = np.empty(k)
            for start in range(0, k, _MOVE_BLOCK):
                self.tick()
                stop = start + _MOVE_BLOCK
                reach[start:stop] = (self.cost[start:stop] + price[None, :]).min(axis=1)
            updated = np.minimum(price, reach)
            if np.array_equal(updated, price):
                break
            price = updated
        # A column that reaches no column with room has no rows, so any price is valid.
        return np.where(np.isfinite(price), price, 0.0)


def align_centroids(new: np.ndarray, old: np.ndarray) -> np.ndarray:
    """Match refitted centroids to existing worker slots by total cosine similarity.

    new: [k_new, d], old: [k_old, d] (rows need not be unit length; they are compared by
    cosine). Returns `perm`, int64 [k_old]: `perm[i]` is the index of the new centroid
    that takes over old slot i, or -1 when k_new < k_old and slot i gets none. When
    k_new == k_old it is a permutation and `new[perm]` lists the new centroids in slot
    order. When k_new > k_old, the new centroids left over (`unmatched_new(perm, k_new)`)
    are for slots beyond the old ones. The matching maximises the sum of cosine
    similarities over matched pairs (`linear_sum_assignment`).
    """
    new_m = _unit_rows(new, "new")
    old_m = _unit_rows(old, "old")
    if new_m.shape[1] != old_m.shape[1]:
        raise ValueError(
            f"new and old centroids differ in dimension: {new_m.shape[1]} != {old_m.shape[1]}"
        )
    perm = np.full(old_m.shape[0], -1, dtype=np.int64)
    if new_m.shape[0] == 0 or old_m.shape[0] == 0:
        return perm
    old_idx, new_idx = linear_sum_assignment(old_m @ new_m.T, maximize=True)
    perm[old_idx] = new_idx
    return perm


def unmatched_new(perm: np.ndarray, k_new: int) -> np.ndarray:
    """Indices of new centroids that `align_centroids` gave no old slot, ascending."""
    taken = np.zeros(k_new, dtype=bool)
    matched = perm[perm >= 0]
    taken[matched] = True
    return np.flatnonzero(~taken).astype(np.int64)


# --- internals ---------------------------------------------------------------------------


def _unit_rows(matrix: np.ndarray, name: str) -> np.ndarray:
    m = np.asarray(matrix, dtype=np.float64)
    if m.ndim != 2:
        raise ValueError(f"{name} must be a 2-D matrix, got shape {m.shape}")
    if not np.isfinite(m).all():
        raise ValueError(f"{name} contains NaN or infinite values")
    norms = np.linalg.norm(m, axis=1)
    if (norms == 0.0).any():
        raise ValueError(f"{name} has zero rows, which have no direction")
    unit: np.ndarray = m / norms[:, None]
    return unit


def _check_input(X: np.ndarray, k: int) -> int:
    if not isinstance(X, np.ndarray):
        raise ValueError(f"X must be a numpy array, got {type(X).__name__}")
    if X.ndim != 2:
        raise ValueError(f"X must be a 2-D matrix [N, d], got shape {X.shape}")
    if not (np.issubdtype(X.dtype, np.floating) or np.issubdtype(X.dtype, np.integer)):
        raise ValueError(f"X must hold real numbers, got dtype {X.dtype}")
    n, d = X.shape
    if n < 1 or d < 1:
        raise ValueError(f"X must have at least one row and one column, got shape {X.shape}")
    if isinstance(k, bool) or not isinstance(k, int | np.integer):
        raise ValueError(f"k must be an integer, got {k!r}")
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, N] = [1, {n}], got {k}")
    return int(n)


def _row_norms(X: np.ndarray) -> np.ndarray:
    """L2 norm of every row, float64, streamed; rejects non-finite and zero rows."""
    n = X.shape[0]
    norms = np.empty(n)
    for start in range(0, n, _CHUNK_ROWS):
        block = X[start : start + _CHUNK_ROWS]
        if block.dtype != np.float32:
            block = block.astype(np.float64)
        block_norms = np.sqrt(np.einsum("ij,ij->i", block, block))
        if not np.isfinite(block_norms).all():
            # NaN or inf in the data, or float32 squares overflowing: tell them apart.
            if not np.isfinite(block).all():
                raise ValueError("X contains NaN or infinite values")
            block64 = block.astype(np.float64)
            block_norms = np.sqrt(np.einsum("ij,ij->i", block64, block64))
        norms[start : start + block.shape[0]] = block_norms
    zero = np.flatnonzero(norms == 0.0)
    if zero.size:
        raise ValueError(f"X has {zero.size} all-zero rows (first: {zero[0]}); cosine is undefined")
    return norms


def _orthonormal_columns(M: np.ndarray) -> np.ndarray:
    """Orthonormal basis of the column space of M (float32), from the eigenvectors of the
    small Gram matrix in float64. LAPACK's QR of a tall float32 matrix is several times
    slower here, and the precision of this basis is not critical."""
    gram = M.T.astype(np.float64) @ M.astype(np.float64)
    eigval, eigvec = np.linalg.eigh(gram)
    keep = eigval > eigval[-1] * 1e-10
    scale = eigvec[:, keep] / np.sqrt(eigval[keep])
    basis: np.ndarray = (M @ scale.astype(np.float32)).astype(np.float32)
    return basis


def _projection(X: np.ndarray, norms: np.ndarray, dim: int, rng: np.random.Generator) -> np.ndarray:
    """Orthonormal basis float32 [d, dim] of the top right singular subspace of the
    row-normalised data, by a randomised SVD (range finder with power iterations) of a
    row subsample."""
    n, d = X.shape
    sample = min(n, _PCA_SAMPLE_ROWS)
    rows = np.sort(rng.choice(n, size=sample, replace=False)) if sample < n else np.arange(n)
    A = X[rows].astype(np.float32)
    A /= norms[rows].astype(np.float32)[:, None]
    width = min(dim + _PCA_OVERSAMPLE, sample, d)
    Q = _orthonormal_columns(A @ rng.standard_normal((d, width), dtype=np.float32))
    for _ in range(_PCA_POWER_ITERATIONS):
        Q = _orthonormal_columns(A @ _orthonormal_columns(A.T @ Q))
    # Right singular vectors of B = Q^T A from the eigenvectors of B B^T (small).
    B = (Q.T @ A).astype(np.float64)  # [width', d]
    eigval, eigvec = np.linalg.eigh(B @ B.T)
    order = np.argsort(eigval)[::-1][:dim]
    order = order[eigval[order] > eigval[order[0]] * 1e-10]
    # Fewer sampled rows (or independent directions) than `dim` give a narrower basis.
    basis = (B.T @ (eigvec[:, order] / np.sqrt(eigval[order]))).astype(np.float32)
    return np.ascontiguousarray(basis)


def _working_matrix(X: np.ndarray, norms: np.ndarray, basis: np.ndarray | None) -> np.ndarray:
    """float32 [N, r] rows to iterate on: projected unit rows, or the unit rows themselves."""
    n, d = X.shape
    if basis is None:
        unit_already = (
            X.dtype == np.float32
            and X.flags.c_contiguous
            and bool(np.all(np.abs(norms - 1.0) < 1e-4))
        )
        if unit_already:
            return X
        Z = np.empty((n, d), dtype=np.float32)
        for start in range(0, n, _CHUNK_ROWS):
            stop = min(n, start + _CHUNK_ROWS)
            Z[start:stop] = X[start:stop] / norms[start:stop, None]
        return Z
    Z = np.empty((n, basis.shape[1]), dtype=np.float32)
    for start in range(0, n, _CHUNK_ROWS):
        stop = min(n, start + _CHUNK_ROWS)
        block = X[start:stop].astype(np.float32, copy=False)
        np.matmul(block, basis, out=Z[start:stop])
        Z[start:stop] /= norms[start:stop, None].astype(np.float32)
    return Z


def _normalise(rows: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    return rows / np.where(norms > 0.0, norms, 1.0)


def _kmeans_pp(
    Z: np.ndarray,
    k: int,
    rng: np.random.Generator,
    checkpoint: Callable[[], None] | None = None,
) -> np.ndarray:
    """Greedy k-means++ seeding on cosine distance (1 - cos, proportional to the squared
    Euclidean distance of unit vectors); returns float32 [k, r] unit rows. `checkpoint` is
    called every 32 centres."""
    n = Z.shape[0]
    trials = 2 + int(math.log(k))
    chosen = [int(rng.integers(n))]
    centres = [_normalise(Z[chosen[0]][None, :])[0]]
    best_sim = Z @ centres[0]
    for step in range(1, k):
        if checkpoint is not None and step % 32 == 0:
            checkpoint()
        dist = np.clip(1.0 - best_sim.astype(np.float64), 0.0, None)
        dist[chosen] = 0.0
        total = float(dist.sum())
        if total <= 0.0:
            # Every point coincides with a chosen centre: pick any unchosen row.
            free = np.setdiff1d(np.arange(n), chosen)
            candidates = rng.choice(free, size=min(trials, free.size), replace=False)
        else:
            cumulative = np.cumsum(dist)
            draws = rng.random(trials) * cumulative[-1]
            candidates = np.minimum(np.searchsorted(cumulative, draws, side="right"), n - 1)
        cand_vecs = _normalise(Z[candidates])
        cand_sims = np.maximum(best_sim[None, :], cand_vecs @ Z.T)
        potential = np.clip(1.0 - cand_sims.astype(np.float64), 0.0, None).sum(axis=1)
        pick = int(potential.argmin())
        chosen.append(int(candidates[pick]))
        centres.append(cand_vecs[pick])
        best_sim = cand_sims[pick]
    return np.asarray(centres, dtype=np.float32)


def _cluster_sums(
    Z: np.ndarray, labels: np.ndarray, k: int, weights: np.ndarray | None = None
) -> np.ndarray:
    """float64 [k, r] sums of the rows of each cluster, each row times its weight.

    Gathers each cluster's rows, in blocks of at most _CHUNK_ROWS so that a large
    cluster never makes a large copy, and sums them: memory-bound, about two reads of Z.
    (A product with a [k, N] indicator matrix costs 2 k N r flops and, with BLAS threads
    competing for two busy cores, was several times slower.)
    """
    order = np.argsort(labels, kind="stable")
    ends = np.cumsum(np.bincount(labels, minlength=k))
    sums = np.zeros((k, Z.shape[1]))
    start = 0
    for col in range(k):
        stop = int(ends[col])
        for lo in range(start, stop, _CHUNK_ROWS):
            idx = order[lo : min(lo + _CHUNK_ROWS, stop)]
            block = Z[idx]
            if block.dtype != np.float32:
                block = block.astype(np.float32)
            if weights is None:
                sums[col] += block.sum(axis=0, dtype=np.float64)
            else:
                sums[col] += weights[idx] @ block
        start = stop
    return sums


def _original_sums(X: np.ndarray, norms: np.ndarray, labels: np.ndarray, k: int) -> np.ndarray:
    """float64 [k, d] sums of each cluster's unit rows in the original dimension."""
    return _cluster_sums(X, labels, k, (1.0 / norms).astype(np.float32))


def _fit(
    X: np.ndarray,
    k: int,
    *,
    seed: int,
    max_iter: int,
    capacity: int | None,
    reduce_dim: int | None,
    tol: float,
    on_iteration: Callable[[int], None] | None = None,
    checkpoint: Callable[[], None] | None = None,
) -> KMeansResult:
    if max_iter < 1:
        raise ValueError(f"max_iter must be >= 1, got {max_iter}")
    if reduce_dim is not None and reduce_dim < 0:
        raise ValueError(f"reduce_dim must be >= 0 or None, got {reduce_dim}")
    if not tol >= 0.0:
        raise ValueError(f"tol must be >= 0, got {tol}")
    n, d = X.shape
    rng = np.random.default_rng(seed)
    norms = _row_norms(X)
    basis = _projection(X, norms, reduce_dim, rng) if reduce_dim and d > reduce_dim else None
    Z = _working_matrix(X, norms, basis)

    centroids = _kmeans_pp(Z, k, rng, checkpoint)
    price = np.zeros(k)
    labels = np.zeros(n, dtype=np.int64)
    converged = False
    iterations = 0
    for iterations in range(1, max_iter + 1):
        if checkpoint is not None:
            checkpoint()
        sims = Z @ centroids.T
        if capacity is None:
            labels = sims.argmax(axis=1)
        else:
            labels, price = capacitated_assignment(
                sims, capacity, prices=price, checkpoint=checkpoint
            )
        sums = _cluster_sums(Z, labels, k)
        new_centroids = _normalise(sums).astype(np.float32)
        # Empty clusters (and, with signed data, clusters whose rows cancel out).
        empty = np.flatnonzero(np.linalg.norm(sums, axis=1) == 0.0)
        if empty.size:
            if capacity is None:
                # Reseed with the rows worst served by their centroid.
                served = sims[np.arange(n), labels]
                worst = np.argsort(served, kind="stable")[: empty.size]
                new_centroids[empty] = _normalise(Z[worst]).astype(np.float32)
            else:
                new_centroids[empty] = centroids[empty]
        shift = float(np.max(1.0 - np.sum(new_centroids * centroids, axis=1)))
        centroids = new_centroids
        if on_iteration is not None:
            on_iteration(iterations)
        if shift < tol:
            converged = True
            break

    labels32 = labels.astype(np.int32)
    sizes = np.bincount(labels, minlength=k).astype(np.int64)
    sums = _original_sums(X, norms, labels, k)
    sum_norms = np.linalg.norm(sums, axis=1)
    # sum_i cos(x_i, c) = <sum_i x_i/|x_i|, c> = |sum| for c = sum/|sum|.
    inertia = float(n - sum_norms.sum())
    final = _normalise(sums)
    empty = np.flatnonzero(sum_norms == 0.0)
    if empty.size:
        # An empty cluster keeps its working-space centroid, lifted back if projected.
        lifted = centroids[empty].astype(np.float64)
        if basis is not None:
            lifted = lifted @ basis.T.astype(np.float64)
        final[empty] = _normalise(lifted)
    return KMeansResult(
        centroids=final.astype(np.float32),
        labels=labels32,
        sizes=sizes,
        prices=price.astype(np.float32),
        inertia=max(inertia, 0.0),
        iterations=iterations,
        converged=converged,
        reduce_dim_used=int(basis.shape[1]) if basis is not None else None,
        capacity=capacity,
    )
