"""An offline reference for the expert union: the best balanced assignment a search finds.

A routing policy decides online, from the prefill alone. This module asks what an
assignment of the *same arrivals* to the same workers could reach with everything known in
advance (every request's whole decode trace, every later arrival), under a load-balance
ceiling: how low the expert union can go without piling requests on a worker. `eldr bench`
reports each policy's union cut as a share of this reference's.

The model is the simulator's without its timing detail: workers step in lockstep, every step
lasting `step_s`; a request arriving at t runs from step ceil(t / step_s) for its decode
tokens, one token per step, on the worker it is assigned; a worker's step loads the distinct
(MoE layer, expert) pairs of the tokens it runs. The objective is the total of those loads
over all steps and workers, the expert union summed over steps (the arrivals' decode tokens
are fixed, so this is also the union per decode token). The ceiling: at every step no
worker runs more requests than `cap[step]` (`eldr bench` takes, step by step, the largest
batch any of its starts runs at that step, so every start meets it and the search can only
improve on each).

The search sweeps the arrivals in time order once from each start assignment (`eldr bench`:
the default's, the paper rule's, the decode-signature rule's and a random balanced one, all
within the ceiling), and goes on sweeping from the one with the fewest loads after that
first sweep. A sweep moves each request to the worker where it adds the fewest loads net
of what it frees, if that lowers the total and the ceiling holds on every step the request
runs; where the ceiling blocks the best move, it tries that move as a swap with the request
of the target worker that is best moved back. Sweeps repeat until one gains less than
`min_gain` of the total, at most `max_passes` in all. A sweep keeps only the steps a
request can touch (twice the longest decode) in a ring buffer, workers innermost, so memory
does not grow with the run and each evaluation reads contiguous bytes.

This is a local search, so its union is what one assignment reaches, not a proof that none
does better: a policy's share of its reduction can only overstate the policy's share of the
true optimum's. It is called a reference, not a bound: `eldr bench` reports which policies,
if any, get below it.
(A greedy start built in arrival order was tried: it broke the ceiling in the drain and
was worse than the default's assignment before any search.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MAX_PASSES = 6
MIN_GAIN = 0.001
"""Stop when a sweep lowers the total by less than this share of it."""


@dataclass(frozen=True)
class SearchResult:
    """The best assignment found and what the lockstep model says of it."""

    assignment: np.ndarray
    """int64 [arrivals]: worker of each arrival."""
    loads: int
    """Total expert loads (distinct (layer, expert) pairs summed over steps and workers)."""
    start: str
    """Which start it came from ("start 0", ...)."""
    passes: int
    moves: int
    start_loads: dict[str, int]
    """Total loads of each start before the search."""


class LockstepModel:
    """The arrivals of one run on `num_workers` workers stepping together every `step_s`."""

    def __init__(
        self,
        decode_ids: Sequence[np.ndarray],
        arrival_requests: np.ndarray,
        arrival_s: np.ndarray,
        step_s: float,
        num_workers: int,
        union_slots: int,
    ) -> None:
        if step_s <= 0 or not math.isfinite(step_s):
            raise ValueError(f"step_s must be positive, got {step_s}")
        self.num_workers = int(num_workers)
        self.slots = int(union_slots)
        self.requests = np.asarray(arrival_requests, dtype=np.int64)
        self.first_step = np.ceil(np.asarray(arrival_s) / step_s).astype(np.int64)
        tokens = np.array([decode_ids[r].shape[0] for r in range(len(decode_ids))])
        self.tokens = tokens[self.requests]
        self.end_step = self.first_step + self.tokens
        self.num_steps = int(self.end_step.max()) if self.requests.size else 0
        # Per distinct request: its distinct (relative step, id) pairs, in step order.
        self._steps: dict[int, np.ndarray] = {}
        self._ids: dict[int, np.ndarray] = {}
        for r in np.unique(self.requests):
            ids = decode_ids[int(r)].astype(np.int64)
            steps = np.arange(ids.shape[0], dtype=np.int64)[:, None]
            flat = np.unique(steps * self.slots + ids)
            self._steps[int(r)] = flat // self.slots
            self._ids[int(r)] = flat % self.slots
        self._max_tokens = int(self.tokens.max(initial=1))
        # A sweep at step s holds arrivals starting before s + 2 x max_tokens (those a move at
        # s can touch, swap partners included), so their steps lie in [s, s + 3 x max_tokens).
        self._ring_steps = 3 * self._max_tokens + 1
        self._rings: dict[int, np.ndarray] = {}
        self._order = [int(a) for a in np.argsort(self.first_step, kind="stable")]
        """Arrivals in the order a sweep visits them (by first step)."""

    def _pairs(self, arrival: int) -> tuple[np.ndarray, np.ndarray]:
        """The arrival's distinct (absolute step, id) pairs."""
        r = int(self.requests[arrival])
        return int(self.first_step[arrival]) + self._steps[r], self._ids[r]

    def _ring_index(self, arrival: int) -> np.ndarray:
        """The arrival's rows in a sweep's ring (kept: every pass and start asks again)."""
        out = self._rings.get(arrival)
        if out is None:
            steps, ids = self._pairs(arrival)
            out = (steps % self._ring_steps) * self.slots + ids
            self._rings[arrival] = out
        return out

    def batches(self, assignment: np.ndarray) -> np.ndarray:
        """int32 [workers, steps]: requests each worker runs at each step."""
        out = np.zeros((self.num_workers, self.num_steps + 1), dtype=np.int64)
        np.add.at(out, (assignment, self.first_step), 1)
        np.add.at(out, (assignment, self.end_step), -1)
        return np.cumsum(out, axis=1)[:, : self.num_steps].astype(np.int32)

    def loads(self, assignment: np.ndarray) -> int:
        """Total expert loads of an assignment."""
        total = 0
        seen = np.zeros(self.num_steps * self.slots, dtype=bool)
        for w in range(self.num_workers):
            arrivals = np.flatnonzero(assignment == w)
            if arrivals.size:
                flat = [s * self.slots + i for s, i in map(self._pairs, (int(a) for a in arrivals))]
                idx = np.concatenate(flat)
                seen[idx] = True
                total += int(np.count_nonzero(seen))
                seen[idx] = False
        return total

    def search(
        self,
        starts: Sequence[np.ndarray],
        cap: np.ndarray,
        *,
        max_passes: int = MAX_PASSES,
        min_gain: float = MIN_GAIN,
    ) -> SearchResult:
        """The best assignment the local search reaches from `starts`.

        cap: int [steps], the most requests any worker may run at each step; every start must
        respect it.
        """
        cap = np.asarray(cap, dtype=np.int32)
        if cap.shape != (self.num_steps,):
            raise ValueError(f"cap has shape {cap.shape}, expected ({self.num_steps},)")
        if not starts:
            raise ValueError("the search needs at least one start assignment")
        named = [(f"start {i}", np.asarray(s, dtype=np.int64).copy()) for i, s in enumerate(starts)]
        for name, asg in named:
            if (self.batches(asg) > cap[None, :]).any():
                raise ValueError(f"{name} exceeds the cap")
        dtype: type = np.uint8 if int(cap.max(initial=0)) < 255 else np.uint16
        # One sweep from every start; the one with the fewest loads after it goes on
        # (a sweep costs the same from any start, and the first gains the most).
        first: list[tuple[int, str, np.ndarray, np.ndarray, int, int]] = []
        start_loads: dict[str, int] = {}
        for name, asg in named:
            loads0 = self.loads(asg)
            start_loads[name] = loads0
            batch = self.batches(asg)
            loads, moves = self._sweep(asg, batch, loads0, cap, dtype)
            first.append((loads, name, asg, batch, moves, loads0))
        loads, name, asg, batch, moves, loads0 = min(first, key=lambda f: (f[0], f[1]))
        passes = 1
        if loads0 - loads >= min_gain * loads0:
            while passes < max_passes:
                before = loads
                loads, moved = self._sweep(asg, batch, loads, cap, dtype)
                passes += 1
                moves += moved
                if before - loads < min_gain * before:
                    break
        return SearchResult(asg, loads, name, passes, moves, start_loads)

    def _sweep(
        self, asg: np.ndarray, batch: np.ndarray, loads: int, cap: np.ndarray, dtype: type
    ) -> tuple[int, int]:
        """One sweep in arrival order, in place: (loads after, requests moved)."""
        sweep = _Sweep(self, asg, batch, cap, dtype)
        moves = 0
        for a in self._order:
            gain, moved = sweep.visit(a)
            loads += gain
            moves += moved
        return loads, moves


class _Sweep:
    """One time-ordered sweep: the ring buffer of per-(step, id, worker) token counts.

    When arrival `a` (starting at step s) is visited, the ring holds every arrival that starts
    before s + 2 x max_tokens, so every arrival running at any step a move or swap at s can
    touch (up to the end of a swap partner, which starts before a ends); steps before s are
    cleared, since no arrival visited later runs there.
    """

    def __init__(
        self,
        model: LockstepModel,
        asg: np.ndarray,
        batch: np.ndarray,
        cap: np.ndarray,
        dtype: type,
    ) -> None:
        self.m = model
        self.asg = asg
        self.batch = batch
        self.cap = cap
        self.ring: np.ndarray = np.zeros(
            (model._ring_steps * model.slots, model.num_workers), dtype=dtype
        )
        self.flat = self.ring.reshape(-1)  # the same memory, for single-worker updates
        self.ones = np.ones(int(model.tokens.max(initial=1)) * model.slots, dtype=np.float32)
        self.by_start = np.argsort(model.first_step, kind="stable")
        self.added = 0  # arrivals of by_start already in the ring
        self.cleared_to = 0  # steps below this are zero in the ring

    def _advance(self, s: int) -> None:
        m, ring = self.m, self.ring
        if s > self.cleared_to:
            if s - self.cleared_to >= m._ring_steps:
                ring[:] = 0
            else:
                lo, hi = self.cleared_to % m._ring_steps, s % m._ring_steps
                if lo < hi:
                    ring[lo * m.slots : hi * m.slots] = 0
                else:  # the cleared steps wrap around the ring's end
                    ring[lo * m.slots :] = 0
                    ring[: hi * m.slots] = 0
            self.cleared_to = s
        horizon = s + 2 * m._max_tokens
        while self.added < self.by_start.size:
            q = int(self.by_start[self.added])
            if m.first_step[q] >= horizon:
                break
            self.flat[m._ring_index(q) * m.num_workers + self.asg[q]] += 1
            self.added += 1

    def _move(self, a: int, idx: np.ndarray, src: int, dst: int) -> None:
        s, e = int(self.m.first_step[a]), int(self.m.end_step[a])
        workers = self.m.num_workers
        self.flat[idx * workers + src] -= 1
        self.flat[idx * workers + dst] += 1
        self.batch[src, s:e] -= 1
        self.batch[dst, s:e] += 1
        self.asg[a] = dst

    def visit(self, a: int) -> tuple[int, int]:
        """Improve arrival `a`'s worker: (change in loads, requests moved)."""
        m = self.m
        s, e = int(m.first_step[a]), int(m.end_step[a])
        self._advance(s)
        cur = int(self.asg[a])
        idx = m._ring_index(a)
        g = np.take(self.ring, idx, axis=0)  # [pairs, workers]
        freed = int(np.count_nonzero(g[:, cur] == 1))
        # Loads a worker would add: the pairs it has no token on (a float32 product is the
        # fastest column count numpy has for this shape).
        added = self.ones[: idx.size] @ (g == 0).astype(np.float32)
        delta = np.rint(added).astype(np.int64) - freed
        delta[cur] = 0
        room: np.ndarray = np.all(self.batch[:, s:e] < self.cap[s:e], axis=1)
        w = int(np.argmin(np.where(room, delta, 0)))
        if delta[w] < 0 and room[w]:
            self._move(a, idx, cur, w)
            return int(delta[w]), 1
        # The best move is blocked by the ceiling: try it as a swap with a request of the
        # target that starts no earlier (its steps are all in the ring) and covers the steps
        # where the target would break the ceiling, moving that one to our worker.
        b = int(np.argmin(np.where(room, 0, delta)))
        if delta[b] >= 0:
            return 0, 0
        self._move(a, idx, cur, b)
        over = np.flatnonzero(self.batch[b, s:e] > self.cap[s:e]) + s
        lo, hi = int(over[0]), int(over[-1]) + 1
        candidates = np.flatnonzero(
            (self.asg == b) & (m.first_step >= s) & (m.first_step <= lo) & (m.end_step >= hi)
        )
        best_q, best_delta, best_idx = -1, 0, idx
        for q in (int(x) for x in candidates):
            if q == a:
                continue
            qs, qe = int(m.first_step[q]), int(m.end_step[q])
            if not (self.batch[cur, qs:qe] < self.cap[qs:qe]).all():
                continue
            qidx = m._ring_index(q)
            gq = np.take(self.ring, qidx, axis=0)
            dq = int(np.count_nonzero(gq[:, cur] == 0)) - int(np.count_nonzero(gq[:, b] == 1))
            if best_q < 0 or dq < best_delta:
                best_q, best_delta, best_idx = q, dq, qidx
        if best_q >= 0 and int(delta[b]) + best_delta < 0:
            self._move(best_q, best_idx, b, cur)
            return int(delta[b]) + best_delta, 2
        self._move(a, idx, b, cur)
        return 0, 0
