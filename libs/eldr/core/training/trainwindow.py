"""The trainer's rolling training window and its view of the live decode workers.

Training data arrives on two streams: each routing decision carries the request's prefill
expert counts (the signature input), and each finished request's decode summary carries
its decode expert counts. `TrainingWindow` joins the two by request id and keeps the most
recent samples: at most `max_samples`, none older than `max_age_s`. A profile can arrive
before its decision (the two streams are replayed independently at start), so profiles
without a decision wait in a bounded side table until their decision arrives or they age
out. A third input, the gateway's finish event, marks a sample finished whether or not a
profile ever comes: `finished_without_summary` counts the requests that ended with no
decode summary (on real vLLM, decode instances without the capture plugin), so a window
whose decode loop is open shows as such instead of looking merely young.

`LiveWorkers` tracks which decode workers reported recently; those are the workers a
refit gives clusters to. `pick_workers` chooses k of them when a refit asks for fewer.

Counts are held sparse (flat indices and values, as they travel on the wire) and only
densified, for one model and geometry, when a refit takes a `TrainingSet`. Times are
seconds passed in by the caller; nothing here reads a clock.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np

from eldr.core.limits import DEFAULT_MAX_WORKERS
from eldr.core.signature.sparse import SparseRow


@dataclass(frozen=True)
class Sample:
    """One training request: its routing decision joined with its decode summary (if any)."""

    request_id: str
    model: str
    worker_id: str
    ts_s: float
    prefill: SparseRow
    decode: SparseRow | None = None
    finished: bool = False
    """A finish event for the request was seen (its decode ended)."""


@dataclass(frozen=True)
class TrainingSet:
    """Dense training matrices of one model and geometry (float32 [N, L * E] each).

    `decode` rows of requests without a decode summary are zero (`has_summary` says which);
    `decode` is None when no request in the set has one.
    """

    model: str
    num_moe_layers: int
    num_experts: int
    request_ids: tuple[str, ...]
    prefill: np.ndarray
    decode: np.ndarray | None
    has_summary: np.ndarray

    @property
    def n(self) -> int:
        return len(self.request_ids)

    @property
    def n_with_summary(self) -> int:
        return int(self.has_summary.sum())


@dataclass(frozen=True)
class WindowSnapshot:
    """The samples of one model and geometry at one moment; densify off the event loop."""

    model: str
    shape: tuple[int, int]
    samples: tuple[Sample, ...]

    def __len__(self) -> int:
        return len(self.samples)

    def training_set(self) -> TrainingSet:
        L, E = self.shape
        n = len(self.samples)
        prefill = np.zeros((n, L * E), dtype=np.float32)
        has_summary = np.zeros(n, dtype=bool)
        for i, s in enumerate(self.samples):
            s.prefill.add_to(prefill[i])
            has_summary[i] = s.decode is not None
        decode: np.ndarray | None = None
        if has_summary.any():
            decode = np.zeros((n, L * E), dtype=np.float32)
            for i, s in enumerate(self.samples):
                if s.decode is not None:
                    s.decode.add_to(decode[i])
        return TrainingSet(
            model=self.model,
            num_moe_layers=L,
            num_experts=E,
            request_ids=tuple(s.request_id for s in self.samples),
            prefill=prefill,
            decode=decode,
            has_summary=has_summary,
        )


DecisionOutcome = Literal["added", "duplicate", "empty"]
DecodeOutcome = Literal["joined", "waiting", "duplicate", "shape_mismatch"]
FinishOutcome = Literal["finished", "waiting", "duplicate"]


@dataclass
class WindowStats:
    """What left the window other than by a caller's choice (counts since creation)."""

    evicted_by_size: int = 0
    evicted_by_age: int = 0
    orphans_dropped: int = 0
    """Profiles whose decision never arrived (aged out, or pushed out by newer ones)."""


class TrainingWindow:
    """A bounded, time-limited join of decisions and decode summaries by request id."""

    def __init__(self, max_samples: int, max_age_s: float, max_orphans: int | None = None) -> None:
        if max_samples < 1:
            raise ValueError(f"max_samples must be >= 1, got {max_samples}")
        if max_age_s <= 0:
            raise ValueError(f"max_age_s must be positive, got {max_age_s}")
        self.max_samples = max_samples
        self.max_age_s = max_age_s
        self.max_orphans = max_samples if max_orphans is None else max_orphans
        # Insertion order is arrival order, which is (nearly) time order: eviction pops
        # from the front.
        self._samples: OrderedDict[str, Sample] = OrderedDict()
        self._orphans: OrderedDict[str, tuple[float, SparseRow]] = OrderedDict()
        self._early_finishes: OrderedDict[str, float] = OrderedDict()
        """Finish events whose decision has not arrived (bounded like the orphans)."""
        self._with_summary = 0
        self._finished_without_summary = 0
        self.added_total = 0
        """Samples ever added (a refit compares it to skip an unchanged window)."""
        self.stats = WindowStats()

    def __len__(self) -> int:
        return len(self._samples)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._samples

    @property
    def with_summary(self) -> int:
        return self._with_summary

    @property
    def orphan_summaries(self) -> int:
        return len(self._orphans)

    @property
    def finished_without_summary(self) -> int:
        """Samples whose request finished and has no decode summary (yet)."""
        return self._finished_without_summary

    def add_decision(
        self, request_id: str, model: str, worker_id: str, prefill: SparseRow, ts_s: float
    ) -> DecisionOutcome:
        """Take a decision's prefill counts (a waiting profile of the request joins it).

        "duplicate": the request is already in the window; "empty": no counts at all.
        """
        if request_id in self._samples:
            return "duplicate"
        if prefill.total <= 0:
            return "empty"
        decode: SparseRow | None = None
        orphan = self._orphans.pop(request_id, None)
        if orphan is not None and orphan[1].shape == prefill.shape:
            decode = orphan[1]
        finished = self._early_finishes.pop(request_id, None) is not None
        self._samples[request_id] = Sample(
            request_id, model, worker_id, ts_s, prefill, decode, finished
        )
        self._with_summary += decode is not None
        self._finished_without_summary += finished and decode is None
        self.added_total += 1
        while len(self._samples) > self.max_samples:
            self._drop_oldest()
            self.stats.evicted_by_size += 1
        return "added"

    def add_summary(self, request_id: str, decode: SparseRow, ts_s: float) -> DecodeOutcome:
        """Attach decode counts to the request's sample.

        "waiting": the decision has not arrived; the profile waits for it (bounded by
        `max_orphans`, oldest dropped first, and by `max_age_s`). A waiting profile whose
        geometry differs from its decision's is dropped when the decision arrives.
        """
        sample = self._samples.get(request_id)
        if sample is None:
            if request_id in self._orphans:
                return "duplicate"
            self._orphans[request_id] = (ts_s, decode)
            while len(self._orphans) > self.max_orphans:
                self._orphans.popitem(last=False)
                self.stats.orphans_dropped += 1
            return "waiting"
        if sample.decode is not None:
            return "duplicate"
        if decode.shape != sample.prefill.shape:
            return "shape_mismatch"
        self._samples[request_id] = replace(sample, decode=decode)
        self._with_summary += 1
        self._finished_without_summary -= sample.finished
        return "joined"

    def finish(self, request_id: str, ts_s: float) -> FinishOutcome:
        """The request's decode ended (a finish event): mark its sample finished. An event
        that overtook its decision waits for it (bounded, aged like the orphans)."""
        sample = self._samples.get(request_id)
        if sample is None:
            if request_id in self._early_finishes:
                return "duplicate"
            self._early_finishes[request_id] = ts_s
            while len(self._early_finishes) > self.max_orphans:
                self._early_finishes.popitem(last=False)
            return "waiting"
        if sample.finished:
            return "duplicate"
        self._samples[request_id] = replace(sample, finished=True)
        self._finished_without_summary += sample.decode is None
        return "finished"

    def expire(self, now_s: float) -> int:
        """Drop samples and waiting profiles older than `max_age_s`; returns samples dropped."""
        horizon = now_s - self.max_age_s
        dropped = 0
        while self._samples:
            oldest = next(iter(self._samples.values()))
            if oldest.ts_s >= horizon:
                break
            self._drop_oldest()
            dropped += 1
        self.stats.evicted_by_age += dropped
        while self._orphans:
            ts_s, _ = next(iter(self._orphans.values()))
            if ts_s >= horizon:
                break
            self._orphans.popitem(last=False)
            self.stats.orphans_dropped += 1
        while self._early_finishes and next(iter(self._early_finishes.values())) < horizon:
            self._early_finishes.popitem(last=False)
        return dropped

    def _drop_oldest(self) -> None:
        _, sample = self._samples.popitem(last=False)
        self._with_summary -= sample.decode is not None
        self._finished_without_summary -= sample.finished and sample.decode is None

    def groups(self) -> Counter[tuple[str, tuple[int, int]]]:
        """Samples per (model, [layers, experts])."""
        return Counter((s.model, s.prefill.shape) for s in self._samples.values())

    def snapshot(self, model: str | None = None) -> WindowSnapshot | None:
        """The samples of `model` (default: the model with most samples) in its most common
        geometry; None when the window has none."""
        groups = self.groups()
        candidates = [(n, key) for key, n in groups.items() if model is None or key[0] == model]
        if not candidates:
            return None
        # Most samples first; ties broken by name so the choice is deterministic.
        _, (chosen_model, shape) = max(candidates, key=lambda c: (c[0], c[1][0], c[1][1]))
        samples = tuple(
            s
            for s in self._samples.values()
            if s.model == chosen_model and s.prefill.shape == shape
        )
        return WindowSnapshot(chosen_model, shape, samples)


@dataclass
class LiveWorkers:
    """Decode workers that reported within `ttl_s`; a draining worker is not live. At most
    `max_workers` are held: a report from a new worker beyond that is refused (`refused`
    counts them) until one goes silent, so a forged fleet cannot grow a refit past it."""

    ttl_s: float
    max_workers: int = DEFAULT_MAX_WORKERS
    refused: int = 0
    _last_s: dict[str, float] = field(default_factory=dict)
    _draining: set[str] = field(default_factory=set)
    _pruned_s: float = -np.inf

    def __post_init__(self) -> None:
        if self.ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {self.ttl_s}")
        if self.max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {self.max_workers}")

    def on_report(self, worker_id: str, ts_s: float, *, draining: bool = False) -> bool:
        """Take a report; False when it is older than the last one or refused (full)."""
        last = self._last_s.get(worker_id)
        if last is None and len(self._last_s) >= self.max_workers:
            if ts_s - self._pruned_s >= 1.0:  # at most once a second: a flood is cheap
                self._pruned_s = ts_s
                self.live(ts_s)  # forget the silent ones first
            if len(self._last_s) >= self.max_workers:
                self.refused += 1
                return False
        if last is not None and ts_s < last:
            return False  # an older report (replay overlapping live delivery)
        self._last_s[worker_id] = ts_s
        if draining:
            self._draining.add(worker_id)
        else:
            self._draining.discard(worker_id)
        return True

    def live(self, now_s: float) -> tuple[str, ...]:
        """Live worker ids, sorted; forgets workers silent for more than `ttl_s`."""
        horizon = now_s - self.ttl_s
        for wid in [w for w, t in self._last_s.items() if t < horizon]:
            del self._last_s[wid]
            self._draining.discard(wid)
        return tuple(sorted(w for w in self._last_s if w not in self._draining))


def pick_workers(
    live: Sequence[str], k: int | None, keep_first: Iterable[str] = ()
) -> tuple[str, ...]:
    """The workers a fit gives clusters to: all of `live` when k is None, else k of them.

    When fewer than all are wanted, workers in `keep_first` (the previous partition's) are
    preferred, so that a smaller refit moves less traffic; the rest by id. The result is
    in id order. Raises ValueError when k exceeds the live workers.
    """
    ordered = sorted(set(live))
    if k is None:
        return tuple(ordered)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if k > len(ordered):
        raise ValueError(f"k={k} but only {len(ordered)} live decode worker(s)")
    preferred = set(keep_first)
    ranked = sorted(ordered, key=lambda w: (w not in preferred, w))
    return tuple(sorted(ranked[:k]))
