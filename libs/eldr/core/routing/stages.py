"""The routing pipeline's stages as small pure functions over index arrays.

Every function takes and returns ascending int64 indices into the decision's fleet view
(`eldr.core.routing.pipeline.FleetView`) and reads only the arrays it is given; the ones
that draw take the decision's seeded generator. The pipeline (`eldr.core.routing.pipeline`)
runs them in the order a profile lists them (`eldr.core.routing.profile.Pipeline`):
candidates -> filters -> weighted scorers -> picker. Keeping indices ascending keeps
tie-breaks the same whichever way a set was built, so a replay draws the same worker.

Pure: numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

EMPTY = np.empty(0, dtype=np.int64)


# --- candidates -------------------------------------------------------------------------------


def nearest(
    scores: np.ndarray, has_centroid: np.ndarray | None, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """(candidates, newcomers): the `k` best-scoring workers (finite scores; ties: lower
    index first) plus the workers without a centroid, ascending; and those newcomers.

    `scores` holds -inf wherever no score was computed (the live router fills in only the
    workers its centroid index retrieved), so this reads the whole array once in numpy
    and nothing else of the fleet."""
    finite = np.flatnonzero(np.isfinite(scores))
    if finite.size > k:
        # Best k by score, then index: a stable sort of the negated scores keeps index order.
        order = np.argsort(-scores[finite], kind="stable")[:k]
        finite = np.sort(finite[order])
    newcomers = EMPTY if has_centroid is None else np.flatnonzero(~has_centroid)
    if newcomers.size == 0:
        return finite.astype(np.int64, copy=False), EMPTY
    return np.union1d(finite, newcomers).astype(np.int64), newcomers.astype(np.int64)


def cycle_next(workers: tuple[str, ...], next_id: str | None, cursor: int) -> tuple[int, int, str]:
    """Round-robin: (index chosen, the cursor after it, the worker id that comes next).

    Cycles by worker id, so that workers joining or leaving do not reset the cycle."""
    n = len(workers)
    idx = workers.index(next_id) if next_id is not None and next_id in workers else cursor % n
    return idx, idx + 1, workers[(idx + 1) % n]


# --- filters ----------------------------------------------------------------------------------


def ceiling_bound(mean_load: float, slack: float) -> float:
    """The load a worker may carry to stay a candidate: (1 + slack) x the fleet's mean + 1."""
    return (1.0 + slack) * mean_load + 1.0


def under_ceiling(
    cand: np.ndarray, loads: np.ndarray, bound: float, scores: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray] | None:
    """(the candidates at most `bound`, the scored ones above it); None when the ceiling
    would leave no candidate with a finite score (nothing left to be local to: the filter
    is skipped) or none at all."""
    eligible = loads[cand] <= bound
    kept = cand[eligible]
    if kept.size == 0:
        return None
    if scores is None:
        return kept, EMPTY
    if not np.isfinite(scores[kept]).any():
        return None
    over = cand[~eligible & np.isfinite(scores[cand])]
    return kept, over


@dataclass(frozen=True)
class BandTrace:
    """How the band filter built a decision's band (indices into the fleet view)."""

    best: int
    """The best-scoring eligible worker."""
    best_score: float
    tau: float
    within: tuple[int, ...]
    """The scored workers within tau of the best (the band before widening)."""
    widened_to: int
    """Members the band was widened to (0: it was not widened)."""
    newcomers: tuple[int, ...] = ()
    """Members without a centroid, in the band for being less loaded than all of it."""
    bound: float | None = None
    """The load ceiling a worker had to be under to be eligible (None: no ceiling)."""
    over_bound: tuple[int, ...] = ()
    """The scored workers above the ceiling (not eligible)."""


def band(
    scores: np.ndarray, cand: np.ndarray, tau: float, widen_to: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """The ELDR band among `cand`: (band, the members within tau before widening, the best
    member); all empty (best -1) when no candidate has a finite score.

    band = {i : scores[i] >= best - tau}; when tau > 0 and it has a single member it widens
    to the `widen_to` best scores (a single dominant centroid cannot pin all of its traffic
    on one worker)."""
    if tau < 0:
        raise ValueError(f"tau must be non-negative, got {tau}")
    sub = scores[cand]
    finite = np.isfinite(sub)
    if not finite.any():
        return EMPTY, EMPTY, -1
    best = sub[finite].max()
    within_pos = np.flatnonzero(finite & (sub >= best - tau))
    band_pos = within_pos
    if tau > 0 and band_pos.size == 1 and widen_to > 1:
        order = np.argsort(-np.where(finite, sub, -np.inf), kind="stable")
        band_pos = np.sort(order[: min(widen_to, int(finite.sum()))])
    best_pos = int(within_pos[np.argmax(sub[within_pos])])
    return cand[band_pos], cand[within_pos], int(cand[best_pos])


def with_newcomers(
    members: np.ndarray, cand: np.ndarray, has_centroid: np.ndarray | None, loads: np.ndarray
) -> np.ndarray:
    """The band plus the candidates without a centroid that are less loaded than all of it.

    A worker that joined after the partition was fitted has no centroid, so no request
    would ever score it into a band; letting it in while it is the least loaded choice
    fills it up to the band's load level until a refit gives it a centroid."""
    if has_centroid is None or members.size == 0:
        return members
    lacking = cand[~has_centroid[cand]]
    if lacking.size == 0:
        return members
    joining = lacking[loads[lacking] < loads[members].min()]
    if joining.size == 0:
        return members
    return np.union1d(members, joining).astype(np.int64)


# --- picker -----------------------------------------------------------------------------------


def cheapest(
    cost: np.ndarray, scored: np.ndarray, tolerance: float, rng: np.random.Generator
) -> tuple[int, np.ndarray]:
    """(the index of least cost among `scored`, the tied indices): costs within `tolerance`
    x max(1, |least|) of the least tie (0: exactly equal), and one of several is drawn."""
    best = float(cost.min())
    if tolerance > 0:
        ties = scored[cost <= best + tolerance * max(1.0, abs(best))]
    else:
        ties = scored[cost == best]
    if ties.size == 1:
        return int(ties[0]), ties
    return int(ties[rng.integers(ties.size)]), ties
