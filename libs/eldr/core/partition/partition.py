"""Partitions of signature space: one (or more) centroids per decode worker.

`fit_partition` is the trainer's pure step: calibrate signatures, fit a balanced spherical
K-means with one cluster per decode worker, and give each cluster to a worker so that a
refit moves as little traffic as possible (a Hungarian matching on how many training
requests each new cluster shares with each worker's old cluster). Persisting and
announcing a fit are separate steps (`eldr.partitions.codec`, the trainer service).

`Partition` is what a router holds: it turns a request's prefill counts into a signature
and scores it against each worker's centroids.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import linear_sum_assignment

from eldr.core.limits import GeometryLimits
from eldr.core.partition.index import CentroidIndex
from eldr.core.partition.kmeans import balanced_spherical_kmeans
from eldr.core.signature.signature import (
    Calibration,
    CalibrationReport,
    compute_idf,
    fit_calibration,
)
from eldr.core.workload.trace import ModelGeometry


@dataclass(eq=False)
class _Slotted:
    """The last candidate tuple a partition slotted (`Partition.slots_of`): a router asks
    about the same live workers decision after decision, and only a change of them costs a
    pass over them."""

    candidates: object = None
    slots: np.ndarray | None = None
    inverse: np.ndarray | None = None


@dataclass(frozen=True, eq=False)
class Partition:
    """A partition version: calibration, centroids, and which worker owns each centroid.

    centroids: float32 [M, d] unit rows in the calibration's signature space; owners[m] is
    the index into `workers` of centroid m's worker (M >= len(workers) with sub-centroids).
    """

    version: int
    model: str
    calibration: Calibration
    centroids: np.ndarray
    owners: np.ndarray
    workers: tuple[str, ...]
    metrics: dict[str, float] = field(default_factory=dict)
    index_method: str = "auto"
    _index: CentroidIndex = field(init=False, repr=False)
    _slot: dict[str, int] = field(init=False, repr=False)
    _slotted: _Slotted = field(init=False, repr=False)

    def __post_init__(self) -> None:
        centroids = np.ascontiguousarray(self.centroids, dtype=np.float32)
        owners = np.asarray(self.owners, dtype=np.int64)
        if centroids.ndim != 2 or centroids.shape[1] != self.calibration.dim:
            raise ValueError(
                f"centroids shaped {centroids.shape} do not match signature dim "
                f"{self.calibration.dim}"
            )
        if owners.shape != (centroids.shape[0],):
            raise ValueError(f"{owners.shape[0]} owners for {centroids.shape[0]} centroids")
        if not self.workers:
            raise ValueError("a partition needs at least one worker")
        if len(set(self.workers)) != len(self.workers):
            raise ValueError("worker ids in a partition must be unique")
        if owners.min() < 0 or owners.max() >= len(self.workers):
            raise ValueError("an owner index is outside the worker list")
        object.__setattr__(self, "centroids", centroids)
        object.__setattr__(self, "owners", owners)
        object.__setattr__(
            self,
            "_index",
            CentroidIndex(
                centroids, owners, num_workers=len(self.workers), method=self.index_method
            ),
        )
        object.__setattr__(self, "_slot", {w: i for i, w in enumerate(self.workers)})
        object.__setattr__(self, "_slotted", _Slotted())

    @property
    def k(self) -> int:
        return len(self.workers)

    def owns(self, worker_id: str) -> bool:
        """Whether `worker_id` owns a centroid of this partition."""
        return worker_id in self._slot

    def signature(self, counts: np.ndarray) -> np.ndarray:
        """Unit signature of a request's prefill counts ([L, E] or [L * E])."""
        return self.calibration.apply(np.asarray(counts, dtype=np.float32))

    def worker_scores(self, counts: np.ndarray, tau: float | None = None) -> np.ndarray:
        """Cosine similarity of the request to each worker (best of its centroids).

        A zero signature (no counts) scores -inf everywhere. `tau`, when given, lets an
        approximate index return -inf for workers certainly outside the band.
        """
        sig = self.signature(counts)
        if not np.any(sig):
            return np.full(self.k, -np.inf, dtype=np.float32)
        return self._index.scores(sig, tau=tau)

    @property
    def index(self) -> CentroidIndex:
        """The centroid index the router searches."""
        return self._index

    def slots_of(self, candidates: Sequence[str]) -> np.ndarray:
        """int64 [len(candidates)]: each candidate's worker slot in this partition, -1 for
        workers it has no centroid for. Cached for the last tuple asked about (by identity),
        so a router that keeps its live-worker tuple pays the lookup once per change."""
        cached = self._slotted
        if cached.candidates is candidates and cached.slots is not None:
            return cached.slots
        slots = np.fromiter(
            (self._slot.get(w, -1) for w in candidates), dtype=np.int64, count=len(candidates)
        )
        if isinstance(candidates, tuple):
            cached.candidates, cached.slots, cached.inverse = candidates, slots, None
        return slots

    def scores_for(
        self, counts: np.ndarray, candidates: Sequence[str], tau: float | None = None
    ) -> np.ndarray:
        """Scores of `candidates` (live workers); -inf for workers not in this partition."""
        scores = self.worker_scores(counts, tau=tau)
        slots = self.slots_of(candidates)
        owned = slots >= 0
        out = np.full(len(candidates), -np.inf, dtype=np.float32)
        out[owned] = scores[slots[owned]]
        return out

    def exact_scores_for(self, counts: np.ndarray, candidates: Sequence[str]) -> np.ndarray:
        """Exact scores of `candidates` (every centroid scored, whatever the index does on
        the request path); -inf for workers not in this partition or a zero signature."""
        out = np.full(len(candidates), -np.inf, dtype=np.float32)
        sig = self.signature(counts)
        if not np.any(sig):
            return out
        scores = self._index.exact_scores(sig)
        slots = self.slots_of(candidates)
        owned = slots >= 0
        out[owned] = scores[slots[owned]]
        return out

    def nearest_for(
        self,
        counts: np.ndarray,
        candidates: Sequence[str],
        k: int,
        cells: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> np.ndarray:
        """Scores of `candidates` (live workers) for the owners of the `k` centroids nearest
        the request (`CentroidIndex.nearest`), -inf for every other worker: the work grows
        with k, not with the partition or the fleet (one pass over the candidate slots in
        numpy aside). A zero signature scores -inf everywhere. `cells`: the request's
        non-zero cells (flat indices, counts), if the caller has them (`apply_cells`)."""
        out = np.full(len(candidates), -np.inf, dtype=np.float32)
        if cells is None:
            sig = self.signature(counts)
        else:
            sig = self.calibration.apply_cells(*cells)
        if not np.any(sig):
            return out
        slots, sims = self._index.nearest_workers(sig, k)
        inverse = self._inverse(candidates)
        at = inverse[slots]
        live = at >= 0
        out[at[live]] = sims[live]
        return out

    def _inverse(self, candidates: Sequence[str]) -> np.ndarray:
        """int64 [k workers]: the position of each partition worker among `candidates`
        (-1: not there); cached with `slots_of`."""
        slots = self.slots_of(candidates)
        cached = self._slotted
        if cached.slots is slots and cached.inverse is not None:
            return cached.inverse
        inverse = np.full(self.k, -1, dtype=np.int64)
        owned = slots >= 0
        inverse[slots[owned]] = np.flatnonzero(owned)
        if cached.slots is slots:
            cached.inverse = inverse
        return inverse


BEST_SIMILARITY_METRIC = "drift_best_similarity"
OCCUPANCY_SKEW_METRIC = "drift_occupancy_skew"
BASELINE_HELD_OUT_METRIC = "drift_baseline_held_out"
"""Keys of a fit's drift baseline in `Partition.metrics` (`eldr.core.training.online`); the last is
1 when the baseline was measured on held-out requests, 0 on the training requests."""


def geometry_problem(
    active: Partition | None,
    limits: GeometryLimits,
    model: str | None,
    n_layers: int,
    n_experts: int,
) -> str | None:
    """Why counts of `model` shaped `n_layers` x `n_experts` must not be used, or None.

    The active partition's geometry rules for its own model (counts of another shape
    cannot be scored against it); any other model, or a message naming none, is held to
    the configured `limits`. The router and the trainer both check with this, from the
    geometry an event declares, before allocating anything of that shape.
    """
    if active is not None and model is not None and active.model == model:
        cal = active.calibration
        if (n_layers, n_experts) != (cal.num_moe_layers, cal.num_experts):
            return (
                f"partition version {active.version} of {model!r} is "
                f"{cal.num_moe_layers} x {cal.num_experts}, the message says "
                f"{n_layers} x {n_experts}"
            )
        return None
    return limits.problem(model, n_layers, n_experts)


def nearest_workers(partition: Partition, signatures: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(best cosine similarity, index of the best worker) per signature row [N, d].

    Rows of zeros score 0 with worker -1. Exact search (this is off the request path).
    """
    sigs = np.asarray(signatures, dtype=np.float32)
    sims = sigs @ partition.centroids.T
    best = np.full((sims.shape[0], partition.k), -np.inf, dtype=np.float32)
    for m, owner in enumerate(partition.owners):
        np.maximum(best[:, owner], sims[:, m], out=best[:, owner])
    worker = best.argmax(axis=1).astype(np.int64)
    sim = best.max(axis=1).astype(np.float64)
    zero = ~np.any(sigs != 0, axis=1)
    worker[zero] = -1
    sim[zero] = 0.0
    return sim, worker


def occupancy_skew(workers: np.ndarray, k: int) -> float:
    """Total-variation distance of the nearest-worker occupancy from uniform, in [0, 1).

    0: every worker is nearest for the same share of requests; near 1: all on one.
    Entries of -1 (no signature) are ignored.
    """
    valid = workers[workers >= 0]
    if valid.size == 0 or k <= 0:
        return 0.0
    share = np.bincount(valid, minlength=k) / valid.size
    return float(0.5 * np.abs(share - 1.0 / k).sum())


@dataclass(frozen=True)
class FitReport:
    n_train: int
    kept_layers: int
    of_layers: int
    spearman: float | None
    inertia: float
    cluster_size_max: int
    cluster_size_min: int
    iterations: int
    converged: bool
    moved_share: float | None
    """Share of training requests whose best-scoring worker differs from the previous
    partition's best-scoring worker for them (None without a previous partition)."""
    notes: tuple[str, ...] = ()
    best_similarity: float | None = None
    """Mean cosine of a training request to its nearest centroid (the drift baseline)."""
    occupancy_skew: float | None = None
    """How unevenly training requests spread over nearest workers (the drift baseline)."""
    baseline_held_out: bool = False
    """Whether the drift baseline was measured on held-out requests."""

    def metrics(self) -> dict[str, float]:
        out = {
            "n_train": float(self.n_train),
            "kept_layers": float(self.kept_layers),
            "inertia": self.inertia,
            "cluster_size_max": float(self.cluster_size_max),
            "cluster_size_min": float(self.cluster_size_min),
            "iterations": float(self.iterations),
            "converged": float(self.converged),
        }
        if self.spearman is not None:
            out["spearman"] = self.spearman
        if self.moved_share is not None:
            out["moved_share"] = self.moved_share
        if self.best_similarity is not None:
            out[BEST_SIMILARITY_METRIC] = self.best_similarity
        if self.occupancy_skew is not None:
            out[OCCUPANCY_SKEW_METRIC] = self.occupancy_skew
            out[BASELINE_HELD_OUT_METRIC] = float(self.baseline_held_out)
        return out


def assign_clusters_to_workers(
    labels: np.ndarray,
    k: int,
    workers: Sequence[str],
    previous_choice: Sequence[str | None] | None,
    *,
    checkpoint: Callable[[], None] | None = None,
) -> np.ndarray:
    """Worker index for each new cluster, keeping traffic where it was.

    previous_choice[i] is the worker the previous partition sent training request i to
    (None if unknown). The matching maximises the number of requests that stay on their
    worker; without a previous partition clusters map to workers in order. Needs
    k <= len(workers) (each cluster gets a distinct worker).
    """
    if k > len(workers):
        raise ValueError(f"{k} clusters for {len(workers)} workers")
    if previous_choice is None:
        return np.arange(k, dtype=np.int64)
    slot = {w: i for i, w in enumerate(workers)}
    prev_slot = np.array(
        [-1 if prev is None else slot.get(prev, -1) for prev in previous_choice], dtype=np.int64
    )
    labels = np.asarray(labels, dtype=np.int64)
    if prev_slot.shape != labels.shape:
        raise ValueError(f"{labels.shape[0]} labels but {prev_slot.shape[0]} previous choices")
    known = prev_slot >= 0
    overlap = np.zeros((k, len(workers)), dtype=np.float64)
    np.add.at(overlap, (labels[known], prev_slot[known]), 1.0)
    # One solve that no checkpoint interrupts, so the checkpoint comes before it. Measured
    # on the 2-core machine with a 20,000-request window: 6-18 ms at 1,024 workers (the
    # default cap), 0.2-2.6 s at 4,096 (worst when no traffic stays put); the hand-written
    # augmenting-path solver this replaced checked between paths but was up to 5x slower
    # (4.7 s at 4,096). Ties (equal overlaps) may go another way than it did: the same
    # number of requests stays on its worker.
    if checkpoint is not None:
        checkpoint()
    rows, cols = linear_sum_assignment(overlap, maximize=True)
    mapping = np.full(k, -1, dtype=np.int64)
    mapping[rows] = cols
    return mapping


def previous_choices(previous: Partition, prefill_counts: np.ndarray) -> list[str | None]:
    """The worker `previous` scores best for each row of counts [N, L*E] (exact search).

    None for rows whose signature under the previous calibration is zero.
    """
    signatures = previous.calibration.apply(np.asarray(prefill_counts, dtype=np.float32))
    sims = signatures @ previous.centroids.T
    best = np.full((sims.shape[0], previous.k), -np.inf, dtype=np.float32)
    for m, owner in enumerate(previous.owners):
        np.maximum(best[:, owner], sims[:, m], out=best[:, owner])
    choice = best.argmax(axis=1)
    usable = np.any(signatures != 0, axis=1)
    return [previous.workers[int(c)] if ok else None for c, ok in zip(choice, usable, strict=True)]


def _no_checkpoint() -> None:
    return None


def fit_partition(
    prefill_counts: np.ndarray,
    decode_counts: np.ndarray | None,
    geometry: ModelGeometry,
    workers: Sequence[str],
    *,
    version: int,
    model: str,
    seed: int,
    previous: Partition | None = None,
    transform: str = "idf",
    layer_selection: str = "greedy",
    reduce_dim: int | None = 128,
    min_profiled: int = 2,
    holdout_prefill: np.ndarray | None = None,
    checkpoint: Callable[[], None] | None = None,
) -> tuple[Partition, FitReport]:
    """Fit a new partition for `workers` on N training requests (pure).

    holdout_prefill: prefill counts [M, L*E] of recent requests kept out of the fit; the
    drift baseline (`FitReport.best_similarity`, `occupancy_skew`) is measured on them when
    given (training requests sit closer to centroids fitted on them than new traffic
    will), else on the training requests.

    prefill_counts / decode_counts: float32 [N, L*E]. Requests whose prefill counts are all
    zero, or whose signature is zero after calibration (only experts every request uses,
    or only layers the mask drops), are ignored. A decode row of zeros means "no decode
    profile": the layer mask is selected on the requests that have one (when at least
    `min_profiled` do; otherwise every layer is kept), the IDF on all requests. Needs at
    least len(workers) usable requests. A `previous` partition of another geometry is
    ignored (with a note). `checkpoint` is called between the fit's stages and inside its
    loops (`balanced_spherical_kmeans`, the alignment's assignment); whatever it raises
    ends the fit (the trainer's time limit and cancellation: the fit runs in a thread,
    which cannot be stopped from outside).
    """
    tick = checkpoint or _no_checkpoint
    if not workers:
        raise ValueError("fit_partition needs at least one worker")
    prefill = np.asarray(prefill_counts, dtype=np.float32)
    if prefill.ndim != 2 or prefill.shape[1] != geometry.signature_dim:
        raise ValueError(
            f"prefill_counts must be [N, {geometry.signature_dim}], got {prefill.shape}"
        )
    decode = None if decode_counts is None else np.asarray(decode_counts, dtype=np.float32)
    if decode is not None and decode.shape != prefill.shape:
        raise ValueError(f"decode_counts {decode.shape} do not match prefill {prefill.shape}")
    usable = prefill.sum(axis=1) > 0
    prefill = prefill[usable]
    decode = None if decode is None else decode[usable]
    k = len(workers)
    if prefill.shape[0] < k:
        raise ValueError(f"{prefill.shape[0]} usable training requests for {k} workers")
    notes: list[str] = []
    calibration, report = _calibrate(
        prefill, decode, geometry, transform, layer_selection, seed, min_profiled, notes
    )
    tick()
    signatures = calibration.apply(prefill)
    nonzero = np.any(signatures != 0, axis=1)
    if not nonzero.all():
        notes.append(f"{int((~nonzero).sum())} request(s) with a zero signature ignored")
        signatures = signatures[nonzero]
        prefill = prefill[nonzero]
    if signatures.shape[0] < k:
        raise ValueError(f"{signatures.shape[0]} requests with a signature for {k} workers")
    fit = balanced_spherical_kmeans(
        signatures, k, seed=seed, reduce_dim=reduce_dim, checkpoint=checkpoint
    )
    tick()
    if previous is not None and (
        previous.calibration.num_moe_layers != geometry.num_moe_layers
        or previous.calibration.num_experts != geometry.num_experts
    ):
        notes.append(
            f"previous version {previous.version} has another geometry "
            f"({previous.calibration.num_moe_layers}x{previous.calibration.num_experts}): "
            "not aligned to it"
        )
        previous = None
    previous_choice = None if previous is None else previous_choices(previous, prefill)
    # Routers send a request to (near) its best-scoring worker, so churn is measured and
    # minimised on each request's nearest centroid, not on its capacity-constrained label.
    nearest = np.argmax(signatures @ fit.centroids.T, axis=1)
    mapping = assign_clusters_to_workers(
        nearest, k, workers, previous_choice, checkpoint=checkpoint
    )
    tick()
    moved = None
    if previous_choice is not None:
        new_choice = [workers[int(c)] for c in mapping[nearest]]
        moved = float(np.mean([a != b for a, b in zip(new_choice, previous_choice, strict=True)]))
    spearman = report.peak_correlation if np.isfinite(report.peak_correlation) else None
    partition = Partition(
        version=version,
        model=model,
        calibration=calibration,
        centroids=fit.centroids,
        owners=mapping,
        workers=tuple(workers),
        metrics={},
    )
    tick()
    baseline_sigs = signatures
    if holdout_prefill is not None:
        held = calibration.apply(np.asarray(holdout_prefill, dtype=np.float32))
        held = held[np.any(held != 0, axis=1)]
        if held.shape[0]:
            baseline_sigs = held
            notes.append(f"drift baseline measured on {held.shape[0]} held-out request(s)")
    best_sim, near = nearest_workers(partition, baseline_sigs)
    fit_report = FitReport(
        n_train=int(signatures.shape[0]),
        kept_layers=len(calibration.kept_layers),
        of_layers=geometry.num_moe_layers,
        spearman=spearman,
        inertia=float(fit.inertia),
        cluster_size_max=int(fit.sizes.max()),
        cluster_size_min=int(fit.sizes.min()),
        iterations=int(fit.iterations),
        converged=bool(fit.converged),
        moved_share=moved,
        notes=(*report.notes, *notes),
        best_similarity=float(best_sim[near >= 0].mean()) if (near >= 0).any() else None,
        occupancy_skew=occupancy_skew(near, k),
        baseline_held_out=baseline_sigs is not signatures,
    )
    object.__setattr__(partition, "metrics", fit_report.metrics())
    return partition, fit_report


def _calibrate(
    prefill: np.ndarray,
    decode: np.ndarray | None,
    geometry: ModelGeometry,
    transform: str,
    layer_selection: str,
    seed: int,
    min_profiled: int,
    notes: list[str],
) -> tuple[Calibration, CalibrationReport]:
    """IDF on every request; the layer mask on the requests with a decode summary."""
    rng = np.random.default_rng([seed, 11])
    if decode is None:
        return fit_calibration(
            prefill, None, geometry, transform=transform, layer_selection=layer_selection, rng=rng
        )
    profiled = decode.sum(axis=1) > 0
    if profiled.all():
        return fit_calibration(
            prefill, decode, geometry, transform=transform, layer_selection=layer_selection, rng=rng
        )
    n_profiled = int(profiled.sum())
    if n_profiled < max(min_profiled, 2):
        notes.append(f"{n_profiled} request(s) with a decode summary: every layer kept")
        return fit_calibration(
            prefill, None, geometry, transform=transform, layer_selection="all", rng=rng
        )
    notes.append(f"layer mask selected on the {n_profiled} request(s) with a decode summary")
    subset, report = fit_calibration(
        prefill[profiled],
        decode[profiled],
        geometry,
        transform=transform,
        layer_selection=layer_selection,
        rng=rng,
    )
    idf = compute_idf(prefill) if transform == "idf" else None
    calibration = Calibration(
        geometry.num_moe_layers, geometry.num_experts, transform, idf, subset.layer_mask
    )
    return calibration, report
