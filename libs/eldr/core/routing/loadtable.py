"""The fleet-wide load table a router routes on.

Two inputs keep it current:

- **load reports** from decode workers (periodic): running and waiting requests, KV tokens,
  and the ids of the requests the worker admitted recently;
- **assignments** seen on the decisions stream, from *every* router replica, including this
  one. An assignment is "pending" on its worker until a report lists it as admitted (from
  then on the report's own counts include it) or until `pending_ttl_s` passes (the request
  never arrived: the gateway failed or retried elsewhere).

A worker's load is therefore `running + waiting + pending`: the latest report plus what has
been sent its way since, whoever sent it, so N router replicas do not each see 1/N of the
load and a burst between two reports is not invisible. A worker whose last report is older
than `stale_after_s` leaves the table and gets no new requests until it reports again.

A third input, the gateway's **finish events**, retires a pending assignment at once when
the request ended (or moved to another worker) before any report admitted it, and is
remembered for a while so that a decision seen after its own finish (another replica's,
arriving late) is not counted.

The table holds at most `max_workers` workers: a report from a new worker beyond that is
refused (`admits` says so first, `refused_workers` counts), so that a flood of forged or
misconfigured workers can neither grow the router's memory nor make decisions (which list
every live worker) too large for their readers. A worker that goes stale frees its place.

Times are monotonic seconds passed in by the caller (no clock reads here).

A decision reads the live workers and their loads (`live_workers`, `loads`): the table
keeps both as it goes (the live tuple until a worker joins, leaves, drains or goes stale,
and two numpy arrays of in-flight requests and KV tokens updated on every report,
assignment and finish), so reading them costs the same at 16 workers as at 1,024.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from eldr.core.limits import DEFAULT_MAX_WORKERS

RECENT_ADMITTED_MAX = 4096
"""Per worker, how many recently admitted request ids are remembered, so that an assignment
seen after the report that already admitted it is not counted twice."""
RECENT_FINISHED_MAX = 65_536
"""At most this many finished request ids are remembered (a decision for one of them
arriving later is ignored); each for `pending_ttl_s` only (a decision echo comes within
milliseconds), so the memory is about the finish rate x `pending_ttl_s`."""


@dataclass
class WorkerState:
    worker_id: str
    incarnation: str
    seq: int
    running: int
    waiting: int
    kv_tokens: int
    kv_capacity_tokens: int
    draining: bool
    last_report_s: float
    pending: dict[str, tuple[float, int]] = field(default_factory=dict)
    pending_kv_tokens: int = 0
    recent_admitted: OrderedDict[str, None] = field(default_factory=OrderedDict)

    @property
    def in_flight(self) -> int:
        return self.running + self.waiting + len(self.pending)

    @property
    def kv_load(self) -> int:
        return self.kv_tokens + self.pending_kv_tokens

    def add_pending(self, request_id: str, now_s: float, kv_tokens: int) -> None:
        if request_id not in self.pending:
            self.pending[request_id] = (now_s, kv_tokens)
            self.pending_kv_tokens += kv_tokens

    def drop_pending(self, request_id: str) -> None:
        entry = self.pending.pop(request_id, None)
        if entry is not None:
            self.pending_kv_tokens -= entry[1]


@dataclass(frozen=True)
class Report:
    """The fields of a decode worker's load report the table uses."""

    worker_id: str
    incarnation: str
    seq: int
    running: int
    waiting: int
    kv_tokens: int
    kv_capacity_tokens: int = 0
    admitted: tuple[str, ...] = ()
    draining: bool = False


class LoadTable:
    def __init__(
        self,
        stale_after_s: float = 3.0,
        pending_ttl_s: float = 10.0,
        max_workers: int = DEFAULT_MAX_WORKERS,
    ) -> None:
        if stale_after_s <= 0 or pending_ttl_s <= 0:
            raise ValueError("stale_after_s and pending_ttl_s must be positive")
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.stale_after_s = stale_after_s
        self.pending_ttl_s = pending_ttl_s
        self.max_workers = max_workers
        self.refused_workers = 0
        """Reports refused because they would have added a worker beyond `max_workers`."""
        self._workers: dict[str, WorkerState] = {}
        self._pending_on: dict[str, str] = {}
        """request id -> the worker it is pending on."""
        self._finished: OrderedDict[str, float] = OrderedDict()
        """finished request id -> when its finish event came (monotonic s)."""
        self._fresh: OrderedDict[str, None] = OrderedDict()
        """Workers not (yet) seen stale, oldest report first."""
        self._live: tuple[str, ...] | None = None
        """The live workers (sorted), kept until one joins, leaves, drains or goes stale."""
        self._live_at = -np.inf
        """The latest time `live_workers` was asked about."""
        self._pos: dict[str, int] = {}
        self._in_flight = np.zeros(0, dtype=np.int64)
        self._kv = np.zeros(0, dtype=np.int64)

    def __len__(self) -> int:
        return len(self._workers)

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self._workers

    def get(self, worker_id: str) -> WorkerState | None:
        return self._workers.get(worker_id)

    def admits(self, worker_id: str) -> bool:
        """Whether a report from `worker_id` would be taken: it is in the table, or the
        table has room for one more worker."""
        return worker_id in self._workers or len(self._workers) < self.max_workers

    def on_report(self, report: Report, now_s: float) -> bool:
        """Apply a load report; returns False for a stale (out-of-order) one, and for a
        new worker when the table is full (counted in `refused_workers`).

        A new incarnation (the worker restarted) replaces the old state: whatever was
        pending on the old process is gone with it.
        """
        if not self.admits(report.worker_id):
            self.refused_workers += 1
            return False
        state = self._workers.get(report.worker_id)
        if (
            state is not None
            and state.incarnation == report.incarnation
            and report.seq <= state.seq
        ):
            return False
        if state is None or state.incarnation != report.incarnation:
            self.remove(report.worker_id)
            state = WorkerState(
                worker_id=report.worker_id,
                incarnation=report.incarnation,
                seq=report.seq,
                running=0,
                waiting=0,
                kv_tokens=0,
                kv_capacity_tokens=0,
                draining=False,
                last_report_s=now_s,
            )
            self._workers[report.worker_id] = state
        state.seq = report.seq
        state.running = report.running
        state.waiting = report.waiting
        state.kv_tokens = report.kv_tokens
        state.kv_capacity_tokens = report.kv_capacity_tokens
        if state.draining != report.draining:
            self._live = None
        state.draining = report.draining
        state.last_report_s = now_s
        if report.worker_id not in self._fresh:
            self._live = None  # new, or back from stale
        self._fresh[report.worker_id] = None
        self._fresh.move_to_end(report.worker_id)
        for rid in report.admitted:
            self._drop_pending(state, rid)
            state.recent_admitted[rid] = None
            state.recent_admitted.move_to_end(rid)
        while len(state.recent_admitted) > RECENT_ADMITTED_MAX:
            state.recent_admitted.popitem(last=False)
        self._sync(state)
        return True

    def on_assignment(self, worker_id: str, request_id: str, kv_tokens: int, now_s: float) -> None:
        """Count a decision (from any router replica) against its worker until admitted."""
        state = self._workers.get(worker_id)
        if state is None or request_id in state.recent_admitted or request_id in self._finished:
            return
        if self._pending_on.get(request_id, worker_id) != worker_id:
            return  # already pending elsewhere (it moved): the later placement wins
        state.add_pending(request_id, now_s, kv_tokens)
        self._pending_on[request_id] = worker_id
        self._sync(state)

    def cancel_assignment(self, worker_id: str, request_id: str) -> bool:
        """Take back a pending assignment of `request_id` to `worker_id` (its decision was
        not committed); True if it was pending there."""
        state = self._workers.get(worker_id)
        if state is None or self._pending_on.get(request_id) != worker_id:
            return False
        self._drop_pending(state, request_id)
        return True

    def _drop_pending(self, state: WorkerState, request_id: str) -> None:
        if request_id in state.pending:
            state.drop_pending(request_id)
            self._pending_on.pop(request_id, None)
            self._sync(state)

    def _sync(self, state: WorkerState) -> None:
        """Carry `state`'s loads into the live arrays (if it is live there)."""
        pos = self._pos.get(state.worker_id)
        if pos is not None and self._live is not None:
            self._in_flight[pos] = state.in_flight
            self._kv[pos] = state.kv_load

    def was_finished(self, request_id: str) -> bool:
        """Whether a finish event for the request was seen (recently)."""
        return request_id in self._finished

    def on_finished(self, request_id: str, now_s: float) -> bool:
        """The request left its decode worker (a finish event): it stops counting as
        pending and later assignments of it are ignored. True if it was pending."""
        self._finished[request_id] = now_s
        self._finished.move_to_end(request_id)
        while len(self._finished) > RECENT_FINISHED_MAX:
            self._finished.popitem(last=False)
        worker_id = self._pending_on.pop(request_id, None)
        if worker_id is None:
            return False
        state = self._workers.get(worker_id)
        if state is not None:
            state.drop_pending(request_id)
            self._sync(state)
        return True

    def on_moved(self, request_id: str, to_worker: str, now_s: float) -> None:
        """The request was sent to `to_worker` instead of where it was pending (a retry
        before it started): it is pending there now, with the same KV tokens."""
        kv_tokens = 0
        worker_id = self._pending_on.pop(request_id, None)
        if worker_id is not None and (state := self._workers.get(worker_id)) is not None:
            kv_tokens = state.pending.get(request_id, (0.0, 0))[1]
            state.drop_pending(request_id)
            self._sync(state)
        self.on_assignment(to_worker, request_id, kv_tokens, now_s)

    def in_flight(self, worker_id: str) -> int | None:
        """Running + waiting + pending of a worker in the table, else None."""
        state = self._workers.get(worker_id)
        return None if state is None else state.in_flight

    def expire(self, now_s: float) -> list[str]:
        """Drop stale workers and timed-out pending assignments; returns removed workers."""
        removed = [
            wid for wid, s in self._workers.items() if now_s - s.last_report_s > self.stale_after_s
        ]
        for wid in removed:
            self.remove(wid)
        cutoff = now_s - self.pending_ttl_s
        while self._finished and next(iter(self._finished.values())) < cutoff:
            self._finished.popitem(last=False)
        for s in self._workers.values():
            if s.pending:
                # insertion order is assignment order: expired entries are a prefix
                expired = []
                for rid, (t, _) in s.pending.items():
                    if t >= cutoff:
                        break
                    expired.append(rid)
                for rid in expired:
                    self._drop_pending(s, rid)
        return removed

    def remove(self, worker_id: str) -> None:
        state = self._workers.pop(worker_id, None)
        if state is not None:
            for rid in state.pending:
                self._pending_on.pop(rid, None)
        if self._fresh.pop(worker_id, 0) is None:
            self._live = None

    def live_workers(self, now_s: float) -> tuple[str, ...]:
        """Workers that reported within stale_after_s and are not draining, sorted by id.

        The same tuple object until the set changes (a report from a new or stale worker,
        a removal, a draining flag, a worker going stale), so callers may cache what they
        derive from it by identity."""
        if now_s < self._live_at:
            # Asked about an earlier time than before (tests do): start over.
            self._fresh = OrderedDict(
                (wid, None)
                for wid, _ in sorted(self._workers.items(), key=lambda kv: kv[1].last_report_s)
            )
            self._live = None
        self._live_at = now_s
        fresh = self._fresh
        while fresh:
            oldest = next(iter(fresh))
            if now_s - self._workers[oldest].last_report_s <= self.stale_after_s:
                break
            del fresh[oldest]
            self._live = None
        if self._live is None:
            live = tuple(sorted(w for w in fresh if not self._workers[w].draining))
            self._live = live
            self._pos = {w: i for i, w in enumerate(live)}
            states = [self._workers[w] for w in live]
            self._in_flight = np.array([s.in_flight for s in states], dtype=np.int64)
            self._kv = np.array([s.kv_load for s in states], dtype=np.int64)
        return self._live

    def loads(self, workers: Iterable[str]) -> tuple[np.ndarray, np.ndarray]:
        """(in-flight requests, KV tokens) per worker, in the order given (new arrays)."""
        if workers is self._live and self._live is not None:
            return self._in_flight.copy(), self._kv.copy()
        states = [self._workers[w] for w in workers]
        in_flight = np.array([s.in_flight for s in states], dtype=np.int64)
        kv = np.array([s.kv_load for s in states], dtype=np.int64)
        return in_flight, kv
