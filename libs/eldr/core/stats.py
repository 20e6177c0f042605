"""Rank statistics and small numeric helpers shared by calibration, benchmarks and reports.

Correlations return NaN when either input has zero variance (a correlation is undefined
there); callers that rank candidates treat NaN as "no information".
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

ArrayLike = npt.ArrayLike


def _as_1d(x: ArrayLike, name: str) -> np.ndarray:
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} contains NaN or infinite values")
    return arr


def dot(a: np.ndarray, b: np.ndarray) -> float:
    """Dot product of two 1-D float arrays.

    einsum rather than np.dot: np.dot goes through the threaded BLAS, which on a small,
    shared machine spends far longer starting threads than computing (measured 0.8 ms vs
    0.04 ms for 30,000 elements on 2 busy cores).
    """
    return float(np.einsum("i,i->", a, b))


def rankdata(x: ArrayLike) -> np.ndarray:
    """Ranks 1..n of a 1-D array; tied values share the average of their ranks (float64)."""
    return rank_unchecked(_as_1d(x, "x"))


def rank_unchecked(arr: np.ndarray) -> np.ndarray:
    """`rankdata` without input validation, for hot loops over known-finite 1-D arrays."""
    n = arr.shape[0]
    ranks = np.empty(n, dtype=np.float64)
    if n == 0:
        return ranks
    # Tied values get their run's average rank whatever their order, so an unstable
    # (faster) sort is enough.
    order = np.argsort(arr, kind="quicksort")
    sorted_vals = arr[order]
    # Start index of each run of equal values in sorted order.
    run_start = np.flatnonzero(np.r_[True, sorted_vals[1:] != sorted_vals[:-1]])
    run_end = np.r_[run_start[1:], n]
    # Positions i..j-1 (0-based) get the average 1-based rank (i + 1 + j) / 2.
    avg = (run_start + 1 + run_end) / 2.0
    ranks[order] = np.repeat(avg, run_end - run_start)
    return ranks


def pearson(a: ArrayLike, b: ArrayLike) -> float:
    """Pearson correlation of two equally long 1-D arrays; NaN if either is constant."""
    x = _as_1d(a, "a")
    y = _as_1d(b, "b")
    if x.shape != y.shape:
        raise ValueError(f"a and b must have the same length, got {x.shape[0]} and {y.shape[0]}")
    if x.shape[0] < 2:
        return float("nan")
    xc = x - x.mean()
    yc = y - y.mean()
    denom = float(np.sqrt(dot(xc, xc) * dot(yc, yc)))
    if denom == 0.0:
        return float("nan")
    # Rounding can push |r| a hair above 1; the true value cannot be.
    return float(np.clip(dot(xc, yc) / denom, -1.0, 1.0))


def spearman(a: ArrayLike, b: ArrayLike) -> float:
    """Spearman rank correlation (Pearson of average ranks); NaN if either is constant."""
    return pearson(rankdata(a), rankdata(b))


def percentile(x: ArrayLike, q: float | Sequence[float]) -> float | np.ndarray:
    """Percentile(s) q in [0, 100] of the finite values x, linear interpolation between ranks.

    Returns a float for a scalar q, a float64 array for a sequence of q.
    """
    arr = _as_1d(np.ravel(np.asarray(x, dtype=np.float64)), "x")
    if arr.shape[0] == 0:
        raise ValueError("percentile of an empty array is undefined")
    qs = np.asarray(q, dtype=np.float64)
    if np.any(~np.isfinite(qs)) or np.any(qs < 0.0) or np.any(qs > 100.0):
        raise ValueError(f"percentiles must lie in [0, 100], got {q!r}")
    sorted_vals = np.sort(arr)
    pos = qs / 100.0 * (arr.shape[0] - 1)
    lo = np.floor(pos).astype(np.int64)
    hi = np.minimum(lo + 1, arr.shape[0] - 1)
    frac = pos - lo
    result = sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * frac
    if qs.ndim == 0:
        return float(result)
    return np.asarray(result, dtype=np.float64)
