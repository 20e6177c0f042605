"""The trainer's refit as a pure plan: which requests, which fit, which shadow, which verdict.

One refit is two pure steps, called in this order by the trainer service
(`eldr.training.trainer`, around its database, bus and metrics) and by the online benchmark
(`eldr.bench.online_bench`, in simulated time), so that the benchmark measures the refit
that ships:

1. `TrainerState.select` (`select_training`): the window's requests a fit may use. A
   scheduled refit of an unchanged window, no live workers, a k above them or too few
   requests raise `RefitSkipped`. After a promoted drift refit the traffic from before the
   drift is cut (it is what drifted away), and a drift refit fits on the last
   `drift_fit_max_age_s` only, in both cases when enough requests are left.
2. `plan_refit`: the workers (`pick_workers`, the active version's kept first), whether
   the refit is gated (`ungated_because`: no active version, the workers changed, the gate
   off, an operator's request), the hold-out (`holdout_mask`, by a hash of the request id;
   none for an ungated refit), the fit (`fit_partition`, aligned to the active version,
   calling the caller's `checkpoint`), the shadow evaluation (`shadow_gate`: the only place
   that routes held-out requests for a verdict) and the verdict (`promotion_verdict`).
   The `RefitResult` says all of it; storing and announcing a promoted version is the
   caller's.

`TrainerState` holds what a trainer knows between refits: the training window, the active
version and its drift monitor, the live set's history and the schedule, the drift cut. It
changes only by the inputs and results handed to it.

Nothing here does I/O or reads a clock: times come in as arguments (`now_s`: the window's
clock, Unix seconds in the service; `mono_s`: the schedule's, monotonic), and so does a
`clock` callable when the caller wants the fit timed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from eldr.core.partition.partition import FitReport, Partition, fit_partition
from eldr.core.routing.profile import ProfileBase
from eldr.core.signature.sparse import SparseRow
from eldr.core.training.config import TrainerConfig
from eldr.core.training.online import (
    DriftBaseline,
    DriftMonitor,
    DriftStatus,
    DriftThresholds,
    ShadowResult,
    Verdict,
    holdout_mask,
    per_token_activation,
    prefill_activation,
    promotion_verdict,
    refit_trigger,
    shadow_evaluate,
)
from eldr.core.training.trainwindow import (
    DecisionOutcome,
    DecodeOutcome,
    FinishOutcome,
    TrainingSet,
    TrainingWindow,
    WindowSnapshot,
    pick_workers,
)
from eldr.core.workload.trace import ModelGeometry

__all__ = [
    "MIN_SHADOW_BATCH",
    "FitAborted",
    "FitFailed",
    "RefitResult",
    "RefitSkipped",
    "TrainerState",
    "TrainingSelection",
    "plan_refit",
    "select_training",
    "shadow_batch",
    "shadow_gate",
    "ungated_because",
]

MIN_SHADOW_BATCH = 8.0
"""Smallest per-worker batch a shadow evaluation models (see `shadow_batch`)."""


class RefitSkipped(Exception):  # noqa: N818 - an outcome, not an error
    """A refit's preconditions do not hold; the message says which."""


class FitAborted(Exception):  # noqa: N818 - a reason to stop, raised by the fit's checkpoint
    """The fit passed its time limit or was cancelled (the service is stopping)."""


class FitFailed(Exception):  # noqa: N818 - the fit stage's outcome, for the caller's metric
    """The fit raised (bad input) or its checkpoint stopped it; nothing was decided."""


# --- step 1: the requests ------------------------------------------------------------------


@dataclass(frozen=True)
class TrainingSelection:
    """The requests a refit fits on and judges with, and why these."""

    snapshot: WindowSnapshot
    """What the fit uses: the window's requests of one model and geometry, after the cut."""
    window_requests: int
    """The window's requests of that model and geometry before the cut."""
    since_s: float
    """Requests older than this were to be left out (-inf: none); a promoted drift refit
    makes it the cut for later fits."""
    drift_cut_s: float
    """The cut before this refit (what `since_s` started from)."""
    live: tuple[str, ...]
    k: int | None
    trigger: str
    added_total: int
    """The window's `added_total` when selected (a scheduled refit of an unchanged window
    is skipped)."""

    @property
    def cut(self) -> int:
        """Requests the cut left out (0: it kept the whole window, or there was none)."""
        return self.window_requests - len(self.snapshot)


def select_training(
    snapshot: WindowSnapshot | None,
    *,
    live: tuple[str, ...],
    k: int | None,
    trigger: str,
    now_s: float,
    drift_cut_s: float,
    window_changed: bool,
    added_total: int,
    config: TrainerConfig,
) -> TrainingSelection:
    """The requests of `snapshot` a refit uses, or `RefitSkipped` saying why there is none.

    Traffic before `drift_cut_s` (what a promoted drift refit drifted away from) is left
    out, and a drift refit keeps the last `drift_fit_max_age_s` only; if fewer than a fit
    needs would be left, the whole snapshot is used.
    """
    if trigger == "schedule" and not window_changed:
        raise RefitSkipped("no new requests in the window since the last fit")
    n = 0 if snapshot is None else len(snapshot)
    if not live:
        raise RefitSkipped(
            f"no live decode workers (none reported within {config.worker_ttl_s:g} s)"
        )
    if k is not None and k > len(live):
        raise RefitSkipped(f"k={k} but only {len(live)} live decode worker(s)")
    needed = max(config.min_samples, k or len(live))
    if n < needed:
        what = "" if config.model is None else f" of model {config.model}"
        raise RefitSkipped(f"{n} request(s){what} in the window, a refit needs {needed}")
    assert snapshot is not None
    since_s = drift_cut_s
    if trigger == "drift":
        since_s = max(since_s, now_s - config.drift_fit_max_age_s)
    used = snapshot
    if since_s > -math.inf:
        recent = tuple(x for x in snapshot.samples if x.ts_s >= since_s)
        if len(recent) >= needed:
            used = WindowSnapshot(snapshot.model, snapshot.shape, recent)
    return TrainingSelection(used, n, since_s, drift_cut_s, live, k, trigger, added_total)


# --- step 2: fit, shadow, verdict -----------------------------------------------------------


@dataclass(frozen=True)
class RefitResult:
    """What one refit decided: the candidate, how it was judged, and whether it is promoted."""

    selection: TrainingSelection
    workers: tuple[str, ...]
    """The workers the candidate gives clusters to."""
    previous_version: int | None
    ungated: str
    """Why the candidate is promoted without a shadow gate ("": it was gated)."""
    n_requests: int
    n_with_summary: int
    n_held_out: int
    partition: Partition
    report: FitReport
    fit_s: float
    """The fit's duration on the caller's `clock` (0 without one)."""
    shadow: ShadowResult | None
    verdict: Verdict
    drift_cut_s: float
    """The cut later fits use once this result is applied (`TrainerState.apply`)."""

    @property
    def promote(self) -> bool:
        return self.verdict.promote


def ungated_because(
    previous: Partition | None,
    workers: tuple[str, ...],
    trigger: str,
    config: TrainerConfig,
) -> str:
    """Why this refit is promoted without a shadow gate ("" when it is gated)."""
    if previous is None:
        return "no active version"
    if set(previous.workers) != set(workers):
        joined = sorted(set(workers) - set(previous.workers))
        left = sorted(set(previous.workers) - set(workers))
        return (
            f"the workers differ from version {previous.version}'s "
            f"(joined: {','.join(joined) or '-'}; left: {','.join(left) or '-'})"
        )
    if not config.shadow_gate:
        return "the shadow gate is off"
    if trigger == "request" and not config.shadow_gate_requests:
        return "an operator asked for it"
    return ""


def shadow_batch(setting: float, in_flight: Mapping[str, int], workers: Sequence[str]) -> float:
    """The per-worker batch a shadow evaluation models: `setting` when positive, else the
    workers' mean in-flight requests (their last load reports), at least MIN_SHADOW_BATCH
    (a quiet fleet, or one whose load reports the trainer does not read, would make every
    partition look alike)."""
    if setting > 0:
        return setting
    loads = [in_flight.get(w, 0) for w in workers]
    return max(MIN_SHADOW_BATCH, float(np.mean(loads)) if loads else 0.0)


def shadow_gate(
    active: Partition,
    candidate: Partition,
    training: TrainingSet,
    held: np.ndarray,
    workers: tuple[str, ...],
    *,
    min_requests: int,
    batch: float,
    profile: ProfileBase,
) -> tuple[ShadowResult | None, str]:
    """Route the held-out requests under both partitions and model their unions
    (`shadow_evaluate`), or say why there are too few to judge by. The held-out requests'
    decode summaries give what they activate; with fewer than `min_requests` profiled, their
    prefill counts stand in ("prefill proxy"). `profile`: the routers' routing profile, which
    the requests are routed with (`shadow_evaluate`, through the routers' own decision). The
    only place a refit's verdict routes requests."""
    num_moe_layers = training.num_moe_layers
    profiled = held & training.has_summary
    if training.decode is not None and int(profiled.sum()) >= min_requests:
        rows = profiled
        activation = per_token_activation(training.decode[rows], num_moe_layers)
        source = "decode summaries"
    elif int(held.sum()) >= min_requests:
        rows = held
        activation = prefill_activation(training.prefill[rows], num_moe_layers)
        source = f"prefill proxy: {int(profiled.sum())} with decode summaries"
    else:
        return None, (
            f"{int(held.sum())} held-out request(s), a shadow evaluation needs {min_requests}"
        )
    result = shadow_evaluate(
        active,
        candidate,
        training.prefill[rows],
        activation,
        workers,
        batch=batch,
        num_moe_layers=num_moe_layers,
        profile=profile,
        source=source,
    )
    return result, ""


def plan_refit(
    selection: TrainingSelection,
    previous: Partition | None,
    *,
    config: TrainerConfig,
    in_flight: Mapping[str, int],
    checkpoint: Callable[[], None] | None = None,
    clock: Callable[[], float] | None = None,
) -> RefitResult:
    """Fit a candidate on `selection`, aligned to `previous` (the active version), judge it
    and decide whether to promote it (module docstring, step 2).

    in_flight: requests in flight per worker (load reports; `shadow_batch`); the shadow gate
    routes with the routers' profile (`config.routing_profile`). `checkpoint` is called
    inside the fit's loops, before the shadow evaluation and before returning; whatever
    `FitAborted` it raises ends the refit as `FitFailed` (so does a fit that cannot run),
    before anything is decided.
    `clock` (seconds) times the fit and an abandoned one's message.
    """
    now = clock or _no_clock

    def check() -> None:
        if checkpoint is None:
            return
        try:
            checkpoint()
        except FitAborted as exc:
            raise FitFailed(f"fit abandoned after {now() - started:.1f} s: {exc}") from exc

    snapshot = selection.snapshot
    workers = pick_workers(
        selection.live, selection.k, () if previous is None else previous.workers
    )
    training = snapshot.training_set()
    L, E = snapshot.shape
    # A window knows a model's MoE geometry only, and a count per (token, layer) is one
    # expert (top_k 1: what a signature is made of).
    geometry = ModelGeometry.of_moe(L, E, top_k=1)
    ungated = ungated_because(previous, workers, selection.trigger, config)
    held = (
        np.zeros(training.n, dtype=bool)
        if ungated
        else holdout_mask(training.request_ids, config.shadow_holdout_fraction)
    )
    train = ~held
    started = now()
    try:
        partition, report = fit_partition(
            training.prefill[train],
            None if training.decode is None else training.decode[train],
            geometry,
            workers,
            version=1 if previous is None else previous.version + 1,
            model=snapshot.model,
            seed=config.seed,
            previous=previous,
            transform=config.transform,
            layer_selection=config.layer_selection,
            reduce_dim=config.reduce_dim or None,
            min_profiled=config.min_profiled,
            holdout_prefill=training.prefill[held] if held.any() else None,
            checkpoint=checkpoint,
        )
    except ValueError as exc:
        raise FitFailed(f"fit failed: {exc}") from exc
    except FitAborted as exc:
        raise FitFailed(
            f"fit abandoned after {now() - started:.1f} s "
            f"({training.n} requests, {len(workers)} workers): {exc}"
        ) from exc
    fit_s = now() - started
    shadow: ShadowResult | None = None
    missing = ""
    if not ungated:
        assert previous is not None
        check()
        shadow, missing = shadow_gate(
            previous,
            partition,
            training,
            held,
            workers,
            min_requests=config.shadow_min_requests,
            batch=shadow_batch(config.shadow_batch, in_flight, workers),
            profile=config.routing_profile,
        )
    check()  # nothing is decided (and so nothing stored) after the time limit
    verdict = promotion_verdict(shadow, config.shadow_min_gain, forced=ungated, missing=missing)
    drift_cut_s = _drift_cut_after(selection, verdict)
    return RefitResult(
        selection=selection,
        workers=workers,
        previous_version=None if previous is None else previous.version,
        ungated=ungated,
        n_requests=training.n,
        n_with_summary=training.n_with_summary,
        n_held_out=int(held.sum()),
        partition=partition,
        report=report,
        fit_s=fit_s,
        shadow=shadow,
        verdict=verdict,
        drift_cut_s=drift_cut_s,
    )


def _drift_cut_after(selection: TrainingSelection, verdict: Verdict) -> float:
    """A promoted drift refit moves the cut to where its own requests began; nothing else
    moves it."""
    if verdict.promote and selection.trigger == "drift":
        return selection.since_s
    return selection.drift_cut_s


def _no_clock() -> float:
    return 0.0


# --- between refits -------------------------------------------------------------------------


class TrainerState:
    """What a trainer knows between refits (module docstring). The trainer service holds one
    and adds its I/O (the bus feeds it, the database stores what it promotes, metrics
    observe it); the online benchmark holds one in simulated time."""

    def __init__(self, config: TrainerConfig, *, mono_s: float) -> None:
        self.config = config
        self.window = TrainingWindow(config.window_max_samples, config.window_max_age_s)
        self.active: Partition | None = None
        """The active version as this trainer last stored or found it (drift, churn)."""
        self.monitor: DriftMonitor | None = None
        self.drift_cut_s = -math.inf
        """Requests before this (window clock) are what drifted away: no later fit uses
        them."""
        self.last_fit_mono_s: float | None = None
        self.added_at_last_fit: int | None = None
        self.live: tuple[str, ...] = ()
        self.live_since_mono_s = mono_s

    # --- inputs ----------------------------------------------------------------------------

    def add_decision(
        self, request_id: str, model: str, worker_id: str, prefill: SparseRow, ts_s: float
    ) -> DecisionOutcome:
        """A routed request's prefill counts into the window (and the drift monitor)."""
        outcome = self.window.add_decision(request_id, model, worker_id, prefill, ts_s)
        monitor = self.monitor
        if outcome == "added" and monitor is not None and model == monitor.model:
            dense = np.zeros(prefill.shape[0] * prefill.shape[1], dtype=np.float32)
            prefill.add_to(dense)
            monitor.observe(dense)
        return outcome

    def add_summary(self, request_id: str, decode: SparseRow, ts_s: float) -> DecodeOutcome:
        """A finished request's decode counts, joined to its request."""
        return self.window.add_summary(request_id, decode, ts_s)

    def finish(self, request_id: str, ts_s: float) -> FinishOutcome:
        """A request's decode ended (whether or not its profile comes)."""
        return self.window.finish(request_id, ts_s)

    def set_active(self, partition: Partition) -> DriftBaseline | None:
        """Track the active version: the drift monitor measures against it. Returns the
        monitor's baseline (None: none yet, or no monitoring)."""
        self.active = partition
        c = self.config
        if not c.drift_detection:
            self.monitor = None
            return None
        self.monitor = DriftMonitor(
            partition,
            DriftBaseline.from_metrics(partition.metrics),
            window=max(c.drift_window, c.drift_min_samples),
            thresholds=DriftThresholds(
                max_similarity_drop=c.drift_max_similarity_drop,
                max_skew_rise=c.drift_max_skew_rise,
                min_samples=c.drift_min_samples,
            ),
        )
        return self.monitor.baseline

    # --- when ------------------------------------------------------------------------------

    def restart_schedule(self, mono_s: float) -> None:
        """Count the schedule from `mono_s` (a refit started then, or the loop did)."""
        self.last_fit_mono_s = mono_s

    def drift_status(self) -> DriftStatus | None:
        """The monitor's verdict now (None without an active version or monitoring)."""
        return None if self.monitor is None else self.monitor.status()

    def due(
        self, *, now_s: float, mono_s: float, live: tuple[str, ...], drift: DriftStatus | None
    ) -> tuple[str, str] | None:
        """Age the window, then (trigger, reason) if a refit is due now (`refit_trigger`),
        else None. `live`: the workers a refit would use, sorted; `drift`:
        `drift_status()`."""
        self.window.expire(now_s)
        c = self.config
        if live != self.live:
            self.live = live
            self.live_since_mono_s = mono_s
        active = self.active
        trigger = refit_trigger(
            now_s=mono_s,
            last_fit_s=self.last_fit_mono_s,
            interval_s=c.refit_interval_s,
            live=live,
            active_workers=None if active is None or not c.churn_refit else active.workers,
            live_since_s=self.live_since_mono_s,
            churn_settle_s=c.churn_settle_s,
            drift=drift,
            min_gap_s=c.drift_min_gap_s,
        )
        if trigger is None:
            return None
        if trigger == "drift" and drift is not None:
            return trigger, f"drift: {drift.reason}"
        if trigger == "churn":
            workers = () if active is None else active.workers
            return trigger, (
                f"worker set changed: joined "
                f"{','.join(sorted(set(live) - set(workers))) or '-'}, left "
                f"{','.join(sorted(set(workers) - set(live))) or '-'}"
            )
        return trigger, {"schedule": "scheduled"}.get(trigger, trigger)

    # --- a refit ---------------------------------------------------------------------------

    def select(
        self, *, now_s: float, live: tuple[str, ...], k: int | None, trigger: str
    ) -> TrainingSelection:
        """Step 1 on the window now (`select_training`); ages the window first."""
        self.window.expire(now_s)
        return select_training(
            self.window.snapshot(self.config.model),
            live=live,
            k=k,
            trigger=trigger,
            now_s=now_s,
            drift_cut_s=self.drift_cut_s,
            window_changed=self.added_at_last_fit != self.window.added_total,
            added_total=self.window.added_total,
            config=self.config,
        )

    def apply(self, result: RefitResult) -> DriftBaseline | None:
        """A refit's result is final (the caller stored it): a promoted candidate becomes
        the active version (returns its drift baseline, as `set_active`) and the drift cut
        moves as the result says."""
        self.added_at_last_fit = result.selection.added_total
        if not result.promote:
            return None
        self.drift_cut_s = result.drift_cut_s
        return self.set_active(result.partition)
