"""Evaluation arrivals that keep copies of one request apart, and the copies a run still had.

Shared by `eldr bench` (simulated arrivals) and by `eldr demo` / `eldr compare-live` (the
live stack's evaluation passes), so that both replay traffic drawn the same way.

A trace-driven benchmark replays a pool of recorded requests as arrivals. Drawn with
replacement from a pool smaller than the load, several copies of one request are in flight
at once; a locality router sends them to the same worker, where they share every expert of
every step, which flatters its expert-union cut (issue 17: `eldr_cost` put 84.5% of requests
next to an exact copy). Real traffic rarely repeats a prompt while its twin is decoding.

`draw_apart` chooses the request of each arrival, given the arrival times: uniformly among
the pool's requests that are not *held*, where a drawn request is held for its estimated
decode time (decode tokens x the caller's estimated step time; the callers estimate the
step from the union of uniformly routed tokens, `eldr.core.workload.sizing.expected_step_s`,
which is larger than the real, skewed one, so the estimate errs long). When every request is
held (the pool is too small for the load), it draws uniformly among those with the fewest
copies held, so that copies spread evenly over the pool, and marks the arrival `forced`:
such a run cannot be free of in-flight copies, and says so. (Taking the request whose hold
ends first instead makes the arrivals nearly periodic, which round-robin then aligns with.)

The estimate only steers the draw; `copy_overlap` measures, per policy, from the simulated
(or, live, the measured) times, which requests really had a copy in flight beside them,
anywhere or on their worker. `draw_with_replacement` is the old draw, kept to show what
copies do to a comparison.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ArrivalDraw:
    """Which request arrives at each arrival instant, and how far the pool allowed it."""

    requests: np.ndarray
    """int64 [arrivals]: index into the request list."""
    arrival_s: np.ndarray
    """float [arrivals]: arrival times, ascending."""
    forced: np.ndarray
    """bool [arrivals]: drawn while every request of the pool was still held."""
    pool_size: int
    expected_in_flight: float
    """Mean requests in flight the estimate implies (arrival rate x mean hold)."""
    method: str = "apart"
    """"apart" (`draw_apart`) or "with replacement"."""

    @property
    def forced_share(self) -> float:
        return float(self.forced.mean()) if self.forced.size else 0.0

    @property
    def apart(self) -> bool:
        """Whether copies were kept apart for every arrival (the pool was large enough)."""
        return self.method == "apart" and not bool(self.forced.any())

    def describe(self) -> dict[str, object]:
        """JSON-ready: the method, the pool against the load, and whether copies stayed apart."""
        return {
            "method": self.method,
            "pool_requests": self.pool_size,
            "expected_in_flight": self.expected_in_flight,
            "apart": self.apart,
            "forced_share": round(self.forced_share, 4),
        }


def draw_apart(
    pool: np.ndarray, hold_s: np.ndarray, arrival_s: np.ndarray, rng: np.random.Generator
) -> ArrivalDraw:
    """The request of each arrival: uniformly among the pool's requests with the fewest
    copies held at that instant (none held, while the pool allows it).

    pool: indices of the requests to draw from; hold_s: float [all requests], how long a drawn
    request is held; arrival_s: ascending arrival times.
    """
    pool = np.asarray(pool, dtype=np.int64)
    if pool.size == 0:
        raise ValueError("the pool of requests is empty")
    copies = np.zeros(pool.size, dtype=np.int64)  # held copies per pool position
    held: list[tuple[float, int]] = []  # (release time, pool position)
    out = np.empty(arrival_s.size, dtype=np.int64)
    forced = np.zeros(arrival_s.size, dtype=bool)
    for i, t in enumerate(arrival_s):
        while held and held[0][0] <= t:
            copies[heapq.heappop(held)[1]] -= 1
        fewest = int(copies.min())
        candidates = np.flatnonzero(copies == fewest)
        j = int(candidates[rng.integers(candidates.size)])
        forced[i] = fewest > 0
        copies[j] += 1
        r = int(pool[j])
        out[i] = r
        heapq.heappush(held, (float(t) + float(hold_s[r]), j))
    expected = _expected_in_flight(pool, hold_s, arrival_s)
    return ArrivalDraw(out, np.asarray(arrival_s), forced, int(pool.size), expected)


def draw_with_replacement(
    pool: np.ndarray, hold_s: np.ndarray, arrival_s: np.ndarray, rng: np.random.Generator
) -> ArrivalDraw:
    """The request of each arrival drawn uniformly from the pool, copies in flight or not
    (`hold_s` only sizes `expected_in_flight`)."""
    pool = np.asarray(pool, dtype=np.int64)
    if pool.size == 0:
        raise ValueError("the pool of requests is empty")
    return ArrivalDraw(
        requests=pool[rng.integers(pool.size, size=arrival_s.size)],
        arrival_s=np.asarray(arrival_s),
        forced=np.zeros(arrival_s.size, dtype=bool),
        pool_size=int(pool.size),
        expected_in_flight=_expected_in_flight(pool, hold_s, arrival_s),
        method="with replacement",
    )


def _expected_in_flight(pool: np.ndarray, hold_s: np.ndarray, arrival_s: np.ndarray) -> float:
    """Little's law on the draw: the arrivals' rate x the pool's mean hold."""
    span_s = float(arrival_s[-1] - arrival_s[0]) if arrival_s.size > 1 else 0.0
    rate = (arrival_s.size - 1) / span_s if span_s > 0 else 0.0
    return round(rate * float(np.mean(hold_s[pool])), 1)


@dataclass(frozen=True)
class CopyOverlap:
    """Shares of the measured arrivals whose decode overlapped a copy of the same request."""

    in_flight_share: float
    """A copy was decoding at the same time, on any worker."""
    same_worker_share: float
    """A copy was decoding at the same time on the same worker (sharing its experts)."""


def copy_overlap(
    requests: np.ndarray,
    worker_of: np.ndarray,
    start_s: np.ndarray,
    end_s: np.ndarray,
    measured_from: int,
) -> CopyOverlap:
    """Which arrivals overlapped in time with another arrival of the same request.

    All arrays are per arrival (warm-up included, so that a measured request's copy from the
    warm-up counts); shares are over arrivals `measured_from` onwards. Intervals are
    [start, end): a copy arriving at the instant another finishes does not overlap it.
    """
    n = int(requests.size)
    anywhere = _overlapping(requests, start_s, end_s)
    key = requests.astype(np.int64) * (int(worker_of.max()) + 1 if n else 1) + worker_of
    same = _overlapping(key, start_s, end_s)
    measured = slice(measured_from, n)
    if measured_from >= n:
        return CopyOverlap(0.0, 0.0)
    return CopyOverlap(
        in_flight_share=round(float(anywhere[measured].mean()), 4),
        same_worker_share=round(float(same[measured].mean()), 4),
    )


def _overlapping(key: np.ndarray, start_s: np.ndarray, end_s: np.ndarray) -> np.ndarray:
    """bool per element: another element with the same key has an overlapping interval.

    In start order within a key, an interval overlaps another iff an earlier one ends after
    it starts, or the next one starts before it ends.
    """
    order = np.lexsort((start_s, key))
    hit = np.zeros(key.size, dtype=bool)
    reach_s = -np.inf  # latest end among the key's earlier intervals
    for pos, i in enumerate(order):
        if pos == 0 or key[order[pos - 1]] != key[i]:
            reach_s = -np.inf
        nxt = order[pos + 1] if pos + 1 < order.size else -1
        later = nxt >= 0 and key[nxt] == key[i] and start_s[nxt] < end_s[i]
        hit[i] = bool(reach_s > start_s[i] or later)
        reach_s = max(reach_s, float(end_s[i]))
    return hit
