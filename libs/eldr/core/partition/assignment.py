"""Linear sum assignment (the assignment problem), used to align refitted centroids.

After a refit the trainer has K new centroids and K decode workers that each owned one of
the old centroids; matching new to old by maximum total similarity keeps each worker's
locality (and so its warm expert weights) across refits. K is at most about a thousand, so
an O(n^3) exact algorithm is fine.

The algorithm is the shortest augmenting path method (Jonker-Volgenant style): keep dual
potentials `u` (rows) and `v` (columns) with reduced costs `c[i, j] - u[i] - v[j] >= 0`
and every assigned pair tight, and add one row at a time by a Dijkstra search over reduced
costs from that row to the nearest free column. Each Dijkstra step relaxes, in one numpy
expression, the rows of every column reached at the current distance, so the Python loop
runs O(n^2) times in the worst case and usually far fewer, because a greedy start on row
minima already assigns most rows. Measured here: 512 x 512 uniform random costs about
0.1 s, 1,000 x 1,000 about 0.3 s; adversarial structured costs (c[i, j] = i * j) about
1.5 s at 512.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = ["linear_sum_assignment"]


def linear_sum_assignment(
    cost: np.ndarray, maximize: bool = False, *, checkpoint: Callable[[], None] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Assign rows to columns at minimum (or maximum) total cost.

    `cost` is a real 2-D matrix [rows, cols]; rectangular matrices assign
    min(rows, cols) pairs, each row and each column used at most once. Returns
    `(row_ind, col_ind)`, int64 arrays of equal length with `row_ind` ascending, such that
    `cost[row_ind, col_ind].sum()` is optimal. Raises ValueError for non-2-D input and for
    NaN or infinite entries. `checkpoint` is called before each augmenting path (it may
    raise to abandon the solve: a caller's deadline or cancellation).
    """
    matrix = np.asarray(cost)
    if matrix.ndim != 2:
        raise ValueError(f"cost must be a 2-D matrix, got shape {matrix.shape}")
    if matrix.dtype == np.bool_ or not (
        np.issubdtype(matrix.dtype, np.integer) or np.issubdtype(matrix.dtype, np.floating)
    ):
        raise ValueError(f"cost must hold real numbers, got dtype {matrix.dtype}")
    work = matrix.astype(np.float64, copy=True)
    if not np.isfinite(work).all():
        raise ValueError("cost contains NaN or infinite entries")
    n_rows, n_cols = work.shape
    if n_rows == 0 or n_cols == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty.copy()
    if maximize:
        work = -work
    transposed = n_rows > n_cols
    if transposed:
        work = np.ascontiguousarray(work.T)
    # Shifting all costs by a constant leaves the optimal assignment unchanged and keeps the
    # potentials small, which keeps the comparisons below well conditioned.
    work -= work.min()
    col_for_row = _solve_wide(work, checkpoint)
    rows = np.arange(work.shape[0], dtype=np.int64)
    if not transposed:
        return rows, col_for_row
    order = np.argsort(col_for_row, kind="stable")
    return col_for_row[order], rows[order]


def _solve_wide(cost: np.ndarray, checkpoint: Callable[[], None] | None = None) -> np.ndarray:
    """Optimal column for every row of a float64 matrix with rows <= cols."""
    n_rows, n_cols = cost.shape
    # Row potentials from row minima with zero column potentials are feasible duals; every
    # row whose minimum column is still free can be assigned to it at once (a tight pair).
    # Column potentials must stay <= 0 (they start at 0 and only decrease) so that free
    # columns of a rectangular problem keep potential 0, which makes the result optimal.
    u = cost.min(axis=1)
    v = np.zeros(n_cols)
    col_for_row = np.full(n_rows, -1, dtype=np.int64)
    row_for_col = np.full(n_cols, -1, dtype=np.int64)
    for i, j in enumerate(cost.argmin(axis=1)):
        if row_for_col[j] < 0:
            row_for_col[j] = i
            col_for_row[i] = j

    for start in np.flatnonzero(col_for_row < 0):
        if checkpoint is not None:
            checkpoint()
        _augment(cost, int(start), u, v, col_for_row, row_for_col)
    return col_for_row


def _augment(
    cost: np.ndarray,
    start: int,
    u: np.ndarray,
    v: np.ndarray,
    col_for_row: np.ndarray,
    row_for_col: np.ndarray,
) -> None:
    """Assign the free row `start` along a shortest augmenting path; update the duals."""
    n_cols = cost.shape[1]
    shortest = np.full(n_cols, np.inf)
    pred_row = np.full(n_cols, -1, dtype=np.int64)
    col_done = np.zeros(n_cols, dtype=bool)
    free_col = row_for_col < 0
    rows_seen = [start]
    cols_seen: list[int] = []
    dist = 0.0
    frontier = np.array([start], dtype=np.int64)
    all_cols = np.arange(n_cols)
    while True:
        # Relax from every row reached at the current distance at once: structured costs
        # (integers, repeated values) produce many ties, and scanning them together keeps
        # the number of Python-level steps small.
        if frontier.size == 1:
            row = int(frontier[0])
            best = dist + cost[row] - u[row] - v
            better = (best < shortest) & ~col_done
            pred_row[better] = row
        else:
            reduced = dist + cost[frontier] - u[frontier, None] - v
            best_row = reduced.argmin(axis=0)
            best = reduced[best_row, all_cols]
            better = (best < shortest) & ~col_done
            pred_row[better] = frontier[best_row[better]]
        shortest[better] = best[better]
        pending = np.where(col_done, np.inf, shortest)
        dist = float(pending.min())
        tied = np.flatnonzero(pending == dist)
        tied_free = tied[free_col[tied]]
        if tied_free.size:
            col = int(tied_free[0])
            col_done[col] = True
            cols_seen.append(col)
            break
        col_done[tied] = True
        cols_seen.extend(tied.tolist())
        frontier = row_for_col[tied]
        rows_seen.extend(frontier.tolist())

    # Dual update: afterwards every pair on the search tree and the path is tight.
    seen_rows = np.asarray(rows_seen[1:], dtype=np.int64)
    seen_cols = np.asarray(cols_seen, dtype=np.int64)
    u[start] += dist
    if seen_rows.size:
        u[seen_rows] += dist - shortest[col_for_row[seen_rows]]
    v[seen_cols] -= dist - shortest[seen_cols]

    # Flip the path from the free column back to the starting row.
    col = cols_seen[-1]
    while True:
        row = int(pred_row[col])
        row_for_col[col] = row
        col, col_for_row[row] = int(col_for_row[row]), col
        if row == start:
            break
