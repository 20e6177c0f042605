"""Trainer service: refits the partition from recent traffic and publishes new versions.

Inputs: every routing decision (`{ns}.decisions.*`, with the request's prefill counts),
decode profiles (`{ns}.profiles.*`) and decode workers' load reports (`{ns}.load.*`). At
start the training window (`eldr.core.trainwindow`) is rebuilt by replaying the last
`window_max_age_s` of DECISIONS and PROFILES (and the last `worker_ttl_s` of LOAD); the
same replays then deliver live messages.

A refit fits a partition with `eldr.core.partition.fit_partition` in a worker thread,
aligned to the active version so that traffic moves as little as possible. Triggers
(`eldr.core.online.refit_trigger`): a `RefitRequest` on `{ns}.trainer.refit` ("request"),
every `refit_interval_s` ("schedule"), the live decode workers differing from the active
version's once the set has settled ("churn": a worker joined or left), or the drift
monitor seeing recent requests sit worse against the active version than its baseline
("drift"; `eldr.core.online.DriftMonitor`).

Scheduled and drift refits are gated (`shadow_gate`): a share of the window's requests
(by a hash of the request id) is held out of the fit, and both the active version and
the candidate route those requests in a shadow evaluation modelled on the cost model
(`eldr.core.online.shadow_evaluate`); the candidate is promoted only if its modelled
expert union is lower. Churn refits, the first version and operator requests are promoted
without a gate (the reason says so). Then:

1. a promoted candidate is stored as a new, immutable version and activated, in one
   transaction under the partition write lock (`eldr.partition_writer`): the database
   numbers versions; a rejected one is stored with status "rejected" and the active
   version is untouched. Either way the version's note says why (the trigger, and the
   shadow evaluation's numbers or why there was none), and so do the `RefitReply`, the
   log and the metrics (`eldr_trainer_refits_total{outcome="rejected"}`,
   `eldr_trainer_shadow_union_per_layer`);
2. a promoted version's `PartitionBlob` goes to the object store bucket
   `{ns}-partitions` as `v{version}`;
3. and is announced on `{ns}.partition.active` (JetStream PARTITIONS).

Nothing is announced that is not stored. If the database is down the refit fails (logged,
counted) and the next one tries again; if a stored version could not be announced, the
next refit (or the next start) announces it first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from dataclasses import dataclass

import numpy as np
from prometheus_client import Counter, Gauge, Histogram
from sqlalchemy import Engine, make_url
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from eldr.bus import BusError, Delivery, build_topology
from eldr.bus.topology import DECISIONS, LOAD, PARTITIONS, PROFILES
from eldr.core.online import (
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
from eldr.core.partition import FitReport, Partition, fit_partition
from eldr.core.trace import ModelGeometry
from eldr.core.trainwindow import (
    LiveWorkers,
    SparseRow,
    TrainingSet,
    TrainingWindow,
    WindowSnapshot,
    pick_workers,
)
from eldr.partition_writer import (
    StoredVersion,
    WriteLockTimeoutError,
    blob_for_version,
    load_active,
    write_active_version,
    write_rejected_version,
)
from eldr.partitions import partition_from_record
from eldr.runtime import ServiceContext, service_main
from eldr.store import migrate, repo
from eldr.store.models import PartitionStatus
from eldr.wire import (
    Decision,
    DecodeProfile,
    LoadReport,
    PartitionAnnouncement,
    RefitReply,
    RefitRequest,
    SparseCounts,
)

from .settings import TrainerSettings

log = logging.getLogger(__name__)

TRAINER_QUEUE = "trainer"
"""Queue group on `{ns}.trainer.refit`: one trainer replica answers each request."""
FIT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TICK_S = 1.0
MIN_SHADOW_BATCH = 8.0
"""Smallest per-worker batch a shadow evaluation models (see `_shadow_batch`)."""
TRIGGERS = ("request", "schedule", "drift", "churn")
OUTCOMES = ("ok", "skipped", "error", "rejected")


class TrainerMetrics:
    def __init__(self, ctx: ServiceContext[TrainerSettings]) -> None:
        r = ctx.registry
        self.refits = Counter(
            "eldr_trainer_refits_total",
            "Refits by trigger (request, schedule, drift, churn) and outcome (ok: a version "
            "was promoted; rejected: the shadow evaluation kept the active version; "
            "skipped; error).",
            ["trigger", "outcome"],
            registry=r,
        )
        self.shadow_union = Gauge(
            "eldr_trainer_shadow_union_per_layer",
            "Last shadow evaluation: modelled distinct experts per MoE layer per step of the "
            "held-out requests under the active version and the candidate.",
            ["partition"],
            registry=r,
        )
        self.last_rejected_version = Gauge(
            "eldr_trainer_last_rejected_version",
            "The last version the shadow evaluation rejected (0: none).",
            registry=r,
        )
        self.drift_similarity = Gauge(
            "eldr_trainer_drift_best_similarity",
            "Mean cosine of recent requests to their nearest centroid of the active version "
            "(and, for baseline, the value the version was fitted with).",
            ["window"],
            registry=r,
        )
        self.drift_skew = Gauge(
            "eldr_trainer_drift_occupancy_skew",
            "Total-variation distance from uniform of recent requests' nearest-worker "
            "occupancy under the active version (and its baseline).",
            ["window"],
            registry=r,
        )
        self.drift_detected = Gauge(
            "eldr_trainer_drift_detected",
            "1 while the drift monitor says the active version no longer fits the traffic.",
            registry=r,
        )
        self.refit_errors = Counter(
            "eldr_trainer_refit_errors_total",
            "Failed refits by stage (database, lock, fit, publish, internal).",
            ["stage"],
            registry=r,
        )
        self.fit_seconds = Histogram(
            "eldr_trainer_fit_duration_seconds",
            "CPU time of one fit (calibration and balanced K-means), wall seconds.",
            buckets=FIT_BUCKETS,
            registry=r,
        )
        self.window_samples = Gauge(
            "eldr_trainer_window_samples",
            "Requests in the training window, with and without a decode profile.",
            ["profile"],
            registry=r,
        )
        self.inputs = Counter(
            "eldr_trainer_inputs_total",
            "Messages taken or ignored, by kind (decision, profile) and outcome.",
            ["kind", "outcome"],
            registry=r,
        )
        self.active_version = Gauge(
            "eldr_trainer_active_version",
            "Partition version this trainer last stored or found active (0: none).",
            registry=r,
        )
        self.live_workers = Gauge(
            "eldr_trainer_live_workers", "Decode workers a refit would use now.", registry=r
        )
        self.last_fit_inertia = Gauge(
            "eldr_trainer_last_fit_mean_inertia",
            "Mean 1 - cos(signature, its centroid) over the last fit's training requests.",
            registry=r,
        )
        self.last_fit_moved_share = Gauge(
            "eldr_trainer_last_fit_moved_share",
            "Share of the last fit's training requests whose worker changed from the "
            "previous version's choice (0 without a previous version).",
            registry=r,
        )
        self.last_fit_samples = Gauge(
            "eldr_trainer_last_fit_samples", "Training requests of the last fit.", registry=r
        )
        for trigger in TRIGGERS:
            for outcome in OUTCOMES:
                self.refits.labels(trigger, outcome)
        for which in ("active", "candidate"):
            self.shadow_union.labels(which)
        for window in ("recent", "baseline"):
            self.drift_similarity.labels(window)
            self.drift_skew.labels(window)
        for stage in ("database", "lock", "fit", "publish", "internal"):
            self.refit_errors.labels(stage)
        for profile in ("with", "without"):
            self.window_samples.labels(profile)


class RefitSkipped(Exception):  # noqa: N818 - an outcome, not an error
    """A refit's preconditions do not hold; the message says which."""


class RefitFailed(Exception):  # noqa: N818 - carries the failing stage for the metric
    def __init__(self, stage: str, message: str) -> None:
        super().__init__(message)
        self.stage = stage


@dataclass(frozen=True)
class FitOutcome:
    stored: StoredVersion
    report: FitReport
    fit_s: float
    workers: tuple[str, ...]
    n_window: int
    n_with_profile: int
    verdict: Verdict
    shadow: ShadowResult | None
    partition: Partition
    previous_version: int | None


class TrainerService:
    def __init__(self, ctx: ServiceContext[TrainerSettings]) -> None:
        self.ctx = ctx
        s = ctx.settings
        self.settings = s
        self.bus = ctx.bus
        self.subjects = ctx.bus.subjects
        self.topology = build_topology(s.namespace, s)
        self.metrics = TrainerMetrics(ctx)
        self.window = TrainingWindow(s.window_max_samples, s.window_max_age_s)
        self.live = LiveWorkers(s.worker_ttl_s)
        self._refit_lock = asyncio.Lock()
        self._engine: Engine | None = None
        self._sessions: sessionmaker[Session] | None = None
        self._migrated = not s.migrate_on_start
        self._unannounced: StoredVersion | None = None
        self._added_at_last_fit: int | None = None
        self.db_shown = make_url(s.database_url).render_as_string(hide_password=True)
        self.active: Partition | None = None
        """The active version as this trainer last stored or found it (drift, churn)."""
        self.monitor: DriftMonitor | None = None
        self.in_flight: dict[str, int] = {}
        """Per decode worker, running + waiting requests of its last load report."""
        self._last_fit_mono: float | None = None
        self._drift_cut_s = -math.inf
        """Requests before this (Unix s) are what drifted away: no later fit uses them."""
        self._live: tuple[str, ...] = ()
        self._live_since_mono = time.monotonic()

    # --- inputs ----------------------------------------------------------------------------

    async def on_decision(self, msg: Decision, delivery: Delivery) -> None:
        if msg.signature is None:
            outcome = "no_signature"
        elif self.settings.model is not None and msg.model != self.settings.model:
            outcome = "other_model"
        else:
            outcome = self.window.add_decision(
                msg.request_id,
                msg.model,
                msg.worker_id,
                _sparse_row(msg.signature),
                delivery.timestamp_s or time.time(),
            )
            monitor = self.monitor
            if outcome == "added" and monitor is not None and msg.model == monitor.model:
                monitor.observe(msg.signature.to_dense(np.float32))
        self.metrics.inputs.labels("decision", outcome).inc()
        self._window_gauges()

    async def on_profile(self, msg: DecodeProfile, delivery: Delivery) -> None:
        outcome = self.window.add_profile(
            msg.request_id, _sparse_row(msg.counts), delivery.timestamp_s or time.time()
        )
        self.metrics.inputs.labels("profile", outcome).inc()
        if outcome == "joined":
            self._window_gauges()

    async def on_load(self, msg: LoadReport, delivery: Delivery) -> None:
        self.live.on_report(
            msg.worker_id, delivery.timestamp_s or time.time(), draining=msg.draining
        )
        self.in_flight[msg.worker_id] = msg.running + msg.waiting

    def workers(self, now_s: float) -> tuple[str, ...]:
        """The decode workers a refit would use: the fixed list if set, else the live ones."""
        if self.settings.trainer_workers:
            return tuple(sorted(self.settings.trainer_workers))
        return self.live.live(now_s)

    def _window_gauges(self) -> None:
        with_profile = self.window.with_profile
        self.metrics.window_samples.labels("with").set(with_profile)
        self.metrics.window_samples.labels("without").set(len(self.window) - with_profile)

    # --- refits ----------------------------------------------------------------------------

    async def on_refit_request(self, msg: RefitRequest) -> RefitReply:
        log.info("refit requested: %s (k=%s)", msg.reason or "-", msg.k)
        return await self.refit(msg.reason or "requested", msg.k, trigger="request")

    async def refit(self, reason: str, k: int | None, *, trigger: str) -> RefitReply:
        async with self._refit_lock:
            try:
                reply = await self._refit(reason, k, trigger)
            except RefitSkipped as exc:
                log.info("refit (%s) skipped: %s", trigger, exc)
                reply = RefitReply(version=None, status="skipped", message=str(exc))
            except RefitFailed as exc:
                self.metrics.refit_errors.labels(exc.stage).inc()
                log.error("refit (%s) failed at %s: %s", trigger, exc.stage, exc)
                reply = RefitReply(version=None, status="error", message=str(exc))
            except Exception as exc:  # a bug: answer and count it, keep the service up
                self.metrics.refit_errors.labels("internal").inc()
                log.exception("refit (%s) failed unexpectedly", trigger)
                reply = RefitReply(
                    version=None, status="error", message=f"{type(exc).__name__}: {exc}"
                )
            self.metrics.refits.labels(trigger, reply.status).inc()
            return reply

    async def _refit(self, reason: str, k: int | None, trigger: str) -> RefitReply:
        self._last_fit_mono = time.monotonic()
        now_s = time.time()
        self.window.expire(now_s)
        self._window_gauges()
        if self._unannounced is not None:
            await self._announce(self._unannounced)
        live = self.workers(now_s)
        self.metrics.live_workers.set(len(live))
        if trigger == "schedule" and self._added_at_last_fit == self.window.added_total:
            raise RefitSkipped("no new requests in the window since the last fit")
        snapshot = self.window.snapshot(self.settings.model)
        self._check_preconditions(snapshot, live, k)
        assert snapshot is not None
        since_s = self._drift_cut_s
        if trigger == "drift":
            since_s = max(since_s, now_s - self.settings.drift_fit_max_age_s)
        if since_s > -math.inf:
            snapshot = self._recent(snapshot, since_s, live)
        added_total = self.window.added_total
        outcome = await asyncio.to_thread(self._fit_and_store, snapshot, live, k, reason, trigger)
        self._added_at_last_fit = added_total
        self._observe_fit(outcome)
        report = outcome.report
        moved = "n/a" if report.moved_share is None else f"{100 * report.moved_share:.1f}%"
        fitted = (
            f"{report.n_train} requests ({outcome.n_with_profile} with decode profiles), "
            f"{len(outcome.workers)} workers, {report.kept_layers}/{report.of_layers} layers, "
            f"moved {moved}, fit {outcome.fit_s:.3g} s"
        )
        if not outcome.verdict.promote:
            kept = outcome.previous_version
            message = (
                f"version {outcome.stored.version} ({snapshot.model}) {outcome.verdict.reason}; "
                f"version {kept} stays active ({fitted})"
            )
            log.warning("refit (%s, %s): %s", trigger, reason, message)
            return RefitReply(version=None, status="rejected", message=message)
        self._set_active(outcome.partition)
        if trigger == "drift":
            self._drift_cut_s = since_s
        await self._announce(outcome.stored)
        message = (
            f"version {outcome.stored.version} ({snapshot.model}): {fitted}; "
            f"{outcome.verdict.reason}"
        )
        log.info("refit (%s, %s): %s", trigger, reason, message)
        return RefitReply(version=outcome.stored.version, status="ok", message=message)

    def _recent(
        self, snapshot: WindowSnapshot, since_s: float, live: tuple[str, ...]
    ) -> WindowSnapshot:
        """The snapshot's requests newer than `since_s`, if there are enough for a fit."""
        recent = tuple(x for x in snapshot.samples if x.ts_s >= since_s)
        if len(recent) < max(self.settings.min_samples, len(live)):
            return snapshot
        return WindowSnapshot(snapshot.model, snapshot.shape, recent)

    def _set_active(self, partition: Partition) -> None:
        """Track the active version: the drift monitor measures against it."""
        self.active = partition
        s = self.settings
        if not s.drift_detection:
            self.monitor = None
            return
        baseline = DriftBaseline.from_metrics(partition.metrics)
        self.monitor = DriftMonitor(
            partition,
            baseline,
            window=max(s.drift_window, s.drift_min_samples),
            thresholds=DriftThresholds(
                max_similarity_drop=s.drift_max_similarity_drop,
                max_skew_rise=s.drift_max_skew_rise,
                min_samples=s.drift_min_samples,
            ),
        )
        if baseline is not None:
            self.metrics.drift_similarity.labels("baseline").set(baseline.best_similarity)
            self.metrics.drift_skew.labels("baseline").set(baseline.occupancy_skew)

    def drift_status(self) -> DriftStatus | None:
        """The monitor's verdict now (None without an active version or monitoring)."""
        if self.monitor is None:
            return None
        status = self.monitor.status()
        m = self.metrics
        if self.monitor.baseline is not None:
            m.drift_similarity.labels("baseline").set(self.monitor.baseline.best_similarity)
            m.drift_skew.labels("baseline").set(self.monitor.baseline.occupancy_skew)
        if status.samples and status.best_similarity == status.best_similarity:
            m.drift_similarity.labels("recent").set(status.best_similarity)
            m.drift_skew.labels("recent").set(status.occupancy_skew)
        m.drift_detected.set(1.0 if status.drifted else 0.0)
        return status

    def _check_preconditions(
        self, snapshot: WindowSnapshot | None, live: tuple[str, ...], k: int | None
    ) -> None:
        n = 0 if snapshot is None else len(snapshot)
        if not live:
            raise RefitSkipped(
                f"no live decode workers (none reported within {self.settings.worker_ttl_s:g} s)"
            )
        if k is not None and k > len(live):
            raise RefitSkipped(f"k={k} but only {len(live)} live decode worker(s)")
        needed = max(self.settings.min_samples, k or len(live))
        if n < needed:
            what = "" if self.settings.model is None else f" of model {self.settings.model}"
            raise RefitSkipped(f"{n} request(s){what} in the window, a refit needs {needed}")

    def _fit_and_store(
        self,
        snapshot: WindowSnapshot,
        live: tuple[str, ...],
        k: int | None,
        reason: str,
        trigger: str,
    ) -> FitOutcome:
        """Runs in a worker thread: read the active version, fit, gate, store."""
        sessions = self._database()
        try:
            previous = load_active(sessions, snapshot.model)
        except SQLAlchemyError as exc:
            raise RefitFailed("database", self._db_error(exc)) from exc
        except ValueError as exc:  # a corrupt stored version: fit without alignment
            log.error(
                "active version of %s unreadable, not aligning to it: %s", snapshot.model, exc
            )
            previous = None
        workers = pick_workers(live, k, () if previous is None else previous.workers)
        training = snapshot.training_set()
        L, E = snapshot.shape
        geometry = ModelGeometry(num_layers=L, moe_layers=tuple(range(L)), num_experts=E, top_k=1)
        s = self.settings
        forced = self._ungated_because(previous, workers, trigger)
        held = (
            np.zeros(training.n, dtype=bool)
            if forced
            else holdout_mask(training.request_ids, s.shadow_holdout_fraction)
        )
        train = ~held
        started = time.perf_counter()
        try:
            partition, report = fit_partition(
                training.prefill[train],
                None if training.decode is None else training.decode[train],
                geometry,
                workers,
                version=1 if previous is None else previous.version + 1,
                model=snapshot.model,
                seed=s.seed,
                previous=previous,
                transform=s.transform,
                layer_selection=s.layer_selection,
                reduce_dim=s.reduce_dim or None,
                min_profiled=s.min_profiled,
                holdout_prefill=training.prefill[held] if held.any() else None,
            )
        except ValueError as exc:
            raise RefitFailed("fit", f"fit failed: {exc}") from exc
        fit_s = time.perf_counter() - started
        self.metrics.fit_seconds.observe(fit_s)
        for note in report.notes:
            log.info("fit note: %s", note)
        shadow: ShadowResult | None = None
        missing = ""
        if not forced:
            assert previous is not None
            shadow, missing = self._shadow(previous, partition, training, held, workers, L)
        verdict = promotion_verdict(shadow, s.shadow_min_gain, forced=forced, missing=missing)
        note = f"{reason}: {verdict.reason}"[:500]
        write = write_active_version if verdict.promote else write_rejected_version
        try:
            stored = write(
                sessions,
                partition,
                seed=s.seed,
                n_train=report.n_train,
                parent_version=None if previous is None else previous.version,
                note=note,
                lock_timeout_s=s.write_lock_timeout_s,
            )
        except WriteLockTimeoutError as exc:
            raise RefitFailed("lock", str(exc)) from exc
        except SQLAlchemyError as exc:
            raise RefitFailed("database", self._db_error(exc)) from exc
        return FitOutcome(
            stored,
            report,
            fit_s,
            workers,
            training.n,
            training.n_with_profile,
            verdict,
            shadow,
            partition,
            None if previous is None else previous.version,
        )

    def _ungated_because(
        self, previous: Partition | None, workers: tuple[str, ...], trigger: str
    ) -> str:
        """Why this refit is promoted without a shadow gate ("" when it is gated)."""
        s = self.settings
        if previous is None:
            return "no active version"
        if set(previous.workers) != set(workers):
            joined = sorted(set(workers) - set(previous.workers))
            left = sorted(set(previous.workers) - set(workers))
            return (
                f"the workers differ from version {previous.version}'s "
                f"(joined: {','.join(joined) or '-'}; left: {','.join(left) or '-'})"
            )
        if not s.shadow_gate:
            return "the shadow gate is off"
        if trigger == "request" and not s.shadow_gate_requests:
            return "an operator asked for it"
        return ""

    def _shadow(
        self,
        previous: Partition,
        candidate: Partition,
        training: TrainingSet,
        held: np.ndarray,
        workers: tuple[str, ...],
        num_moe_layers: int,
    ) -> tuple[ShadowResult | None, str]:
        """Shadow-evaluate on the held-out requests, or say why it cannot."""
        s = self.settings
        profiled = held & training.has_profile
        if training.decode is not None and int(profiled.sum()) >= s.shadow_min_requests:
            rows = profiled
            activation = per_token_activation(training.decode[rows], num_moe_layers)
            source = "decode profiles"
        elif int(held.sum()) >= s.shadow_min_requests:
            rows = held
            activation = prefill_activation(training.prefill[rows], num_moe_layers)
            source = f"prefill proxy: {int(profiled.sum())} with decode profiles"
        else:
            return None, (
                f"{int(held.sum())} held-out request(s), a shadow evaluation needs "
                f"{s.shadow_min_requests}"
            )
        result = shadow_evaluate(
            previous,
            candidate,
            training.prefill[rows],
            activation,
            workers,
            batch=self._shadow_batch(workers),
            num_moe_layers=num_moe_layers,
            tau=s.shadow_tau,
            source=source,
        )
        self.metrics.shadow_union.labels("active").set(result.active_union)
        self.metrics.shadow_union.labels("candidate").set(result.candidate_union)
        return result, ""

    def _shadow_batch(self, workers: tuple[str, ...]) -> float:
        """The per-worker batch to model: the setting, else the fleet's mean in-flight
        requests (at least MIN_SHADOW_BATCH: a quiet fleet, or one whose load reports this
        trainer does not read, would make every partition look alike)."""
        if self.settings.shadow_batch > 0:
            return self.settings.shadow_batch
        loads = [self.in_flight.get(w, 0) for w in workers]
        return max(MIN_SHADOW_BATCH, float(np.mean(loads)) if loads else 0.0)

    def _observe_fit(self, outcome: FitOutcome) -> None:
        report = outcome.report
        if not outcome.verdict.promote:
            self.metrics.last_rejected_version.set(outcome.stored.version)
            return
        self.metrics.active_version.set(outcome.stored.version)
        self.metrics.last_fit_samples.set(report.n_train)
        self.metrics.last_fit_inertia.set(report.inertia / max(report.n_train, 1))
        self.metrics.last_fit_moved_share.set(report.moved_share or 0.0)

    async def _announce(self, stored: StoredVersion) -> None:
        """Put the blob in the object store, then announce it; remember it on failure."""
        blob = stored.blob
        name = f"v{stored.version}"
        try:
            ref = await self.bus.object_put(self.topology.partitions_bucket, name, blob)
            if ref.sha256 != stored.sha256:
                # Encoding is deterministic; a mismatch is a bug, and routers would refuse it.
                raise RefitFailed(
                    "publish",
                    f"object {name} hashes to {ref.sha256}, the database has {stored.sha256}",
                )
            await self.bus.js_publish(
                self.subjects.partition_active,
                PartitionAnnouncement(
                    version=stored.version,
                    model=blob.model,
                    object_name=name,
                    sha256=stored.sha256,
                    created_ts_s=time.time(),
                    k=len(blob.workers),
                    dim=blob.centroids.shape[1],
                    workers=list(blob.workers),
                ),
                msg_id=f"partition-v{stored.version}",
            )
        except BusError as exc:
            self._unannounced = stored
            raise RefitFailed(
                "publish",
                f"version {stored.version} is stored and active but could not be announced "
                f"({exc}); the next refit announces it",
            ) from exc
        except RefitFailed:
            self._unannounced = None  # retrying cannot help
            raise
        self._unannounced = None
        log.info(
            "announced partition version %d of %s (%d workers, sha256 %s)",
            stored.version,
            blob.model,
            len(blob.workers),
            stored.sha256[:12],
        )

    # --- database --------------------------------------------------------------------------

    def _database(self) -> sessionmaker[Session]:
        """Sessions on a reachable, migrated database (raises RefitFailed otherwise)."""
        s = self.settings
        try:
            if self._sessions is None:
                backend = make_url(s.database_url).get_backend_name()
                connect_args: dict[str, object] = {}
                if backend == "postgresql":
                    connect_args["connect_timeout"] = max(
                        1, math.ceil(s.database_connect_timeout_s)
                    )
                elif backend == "sqlite":
                    connect_args["timeout"] = s.write_lock_timeout_s
                self._engine = repo.make_engine(s.database_url, connect_args=connect_args)
                self._sessions = repo.make_session_factory(self._engine)
            if not self._migrated:
                # Connect through our engine first: it fails fast when the server is down.
                assert self._engine is not None
                with self._engine.connect():
                    pass
                migrate.upgrade(s.database_url)
                self._migrated = True
        except (SQLAlchemyError, OSError) as exc:
            raise RefitFailed("database", self._db_error(exc)) from exc
        return self._sessions

    def _db_error(self, exc: BaseException) -> str:
        detail = str(getattr(exc, "orig", None) or exc).strip().splitlines()
        return (
            f"database {self.db_shown} unavailable: {detail[0] if detail else type(exc).__name__}"
        )

    def startup_database(self) -> None:
        """Migrate (if configured) and find the active version; failures are only logged."""
        try:
            sessions = self._database()
            with sessions() as session:
                infos = [
                    i
                    for i in repo.list_versions(session, self.settings.model, limit=50)
                    if i.status is PartitionStatus.ACTIVE
                ]
            if infos:
                newest = max(infos, key=lambda i: i.version)
                self.metrics.active_version.set(newest.version)
                with sessions() as session:
                    record = repo.get(session, newest.version)
                self._set_active(partition_from_record(record, "exact"))
        except RefitFailed as exc:
            log.error("at start: %s; refits will retry", exc)
        except SQLAlchemyError as exc:
            log.error("at start: %s; refits will retry", self._db_error(exc))
        except ValueError as exc:  # an unreadable stored version: no drift baseline then
            log.error("at start: active version unreadable: %s", exc)

    async def reconcile_announcement(self) -> None:
        """Announce the newest active version if a crash left it stored but unannounced."""
        if self._sessions is None or not self._migrated:
            return
        try:
            last = await self.bus.get_last(
                self.topology.stream_name(PARTITIONS),
                self.subjects.partition_active,
                PartitionAnnouncement,
            )
        except (BusError, ValueError) as exc:
            log.error("could not read the last partition announcement: %s", exc)
            return
        announced = 0 if last is None else last.version
        try:
            stored = await asyncio.to_thread(self._newest_active_after, announced)
        except (SQLAlchemyError, ValueError) as exc:
            log.error("could not check for an unannounced version: %s", exc)
            return
        if stored is not None:
            log.warning(
                "version %d is active but was never announced: announcing it", stored.version
            )
            with contextlib.suppress(RefitFailed):
                await self._announce(stored)

    def _newest_active_after(self, announced: int) -> StoredVersion | None:
        assert self._sessions is not None
        with self._sessions() as session:
            infos = [
                i
                for i in repo.list_versions(session, self.settings.model, limit=50)
                if i.status is PartitionStatus.ACTIVE and i.version > announced
            ]
            if not infos:
                return None
            record = repo.get(session, max(infos, key=lambda i: i.version).version)
        assert record.version is not None
        blob, data, sha = blob_for_version(partition_from_record(record, "exact"), record.version)
        if sha != record.blob_sha256:
            raise ValueError(
                f"version {record.version}: rebuilt blob hashes to {sha}, "
                f"the database has {record.blob_sha256}"
            )
        return StoredVersion(record.version, None, blob, data, sha)

    def close(self) -> None:
        if self._engine is not None:
            self._engine.dispose()

    # --- schedule --------------------------------------------------------------------------

    async def housekeeping(self) -> None:
        """Age the window, refresh gauges, and refit when a trigger says so."""
        s = self.settings
        self._last_fit_mono = time.monotonic()
        while not self.ctx.stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.ctx.stopping.wait(), timeout=TICK_S)
            if self.ctx.stopping.is_set():
                return
            now_s = time.time()
            self.window.expire(now_s)
            self._window_gauges()
            live = self.workers(now_s)
            self.metrics.live_workers.set(len(live))
            trigger = self.trigger(live)
            if trigger is not None:
                reason = {"schedule": "scheduled", "churn": "worker set changed"}.get(
                    trigger, trigger
                )
                if trigger == "drift" and self.monitor is not None:
                    reason = f"drift: {self.monitor.status().reason}"
                if trigger == "churn":
                    active = () if self.active is None else self.active.workers
                    reason = (
                        f"worker set changed: joined "
                        f"{','.join(sorted(set(live) - set(active))) or '-'}, left "
                        f"{','.join(sorted(set(active) - set(live))) or '-'}"
                    )
                await self.refit(reason, None, trigger=trigger)
            elif s.refit_interval_s <= 0:
                continue

    def trigger(self, live: tuple[str, ...]) -> str | None:
        """Why to refit now (`eldr.core.online.refit_trigger`), or None."""
        s = self.settings
        mono = time.monotonic()
        if live != self._live:
            self._live = live
            self._live_since_mono = mono
        active = self.active
        drift = self.drift_status()
        return refit_trigger(
            now_s=mono,
            last_fit_s=self._last_fit_mono,
            interval_s=s.refit_interval_s,
            live=live,
            active_workers=None if active is None or not s.churn_refit else active.workers,
            live_since_s=self._live_since_mono,
            churn_settle_s=s.churn_settle_s,
            drift=drift,
            min_gap_s=s.drift_min_gap_s,
        )


def _sparse_row(counts: SparseCounts) -> SparseRow:
    layers, experts = counts.shape
    return SparseRow((layers, experts), counts.indices(), counts.values())


async def setup(ctx: ServiceContext[TrainerSettings]) -> None:
    svc = TrainerService(ctx)
    s, bus, subjects, topo = ctx.settings, ctx.bus, ctx.bus.subjects, svc.topology
    ctx.stack.callback(svc.close)
    await asyncio.to_thread(svc.startup_database)
    now_s = time.time()
    replays = [
        await bus.replay(
            topo.stream_name(PROFILES),
            subjects.profiles_all,
            DecodeProfile,
            svc.on_profile,
            start_time_s=now_s - s.window_max_age_s,
        ),
        await bus.replay(
            topo.stream_name(DECISIONS),
            subjects.decisions_all,
            Decision,
            svc.on_decision,
            start_time_s=now_s - s.window_max_age_s,
        ),
    ]
    if not s.trainer_workers:
        replays.append(
            await bus.replay(
                topo.stream_name(LOAD),
                subjects.load_all,
                LoadReport,
                svc.on_load,
                start_time_s=now_s - s.worker_ttl_s,
            )
        )
    try:
        await asyncio.gather(*(r.wait_caught_up(timeout_s=s.replay_timeout_s) for r in replays))
    except TimeoutError:
        log.warning(
            "window replay not caught up after %.0f s; serving with %d requests so far",
            s.replay_timeout_s,
            len(svc.window),
        )
    log.info(
        "training window rebuilt: %d requests (%d with decode profiles), %d live workers",
        len(svc.window),
        svc.window.with_profile,
        len(svc.workers(time.time())),
    )
    await svc.reconcile_announcement()
    task = asyncio.create_task(svc.housekeeping(), name="trainer-housekeeping")

    async def stop_task() -> None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    ctx.stack.push_async_callback(stop_task)
    await bus.serve(subjects.trainer_refit, TRAINER_QUEUE, RefitRequest, svc.on_refit_request)
    ctx.set_ready()
    log.info(
        "trainer %s ready: refit every %s, window %d requests / %.0f s, workers %s",
        s.instance_id,
        f"{s.refit_interval_s:g} s" if s.refit_interval_s > 0 else "(on request only)",
        s.window_max_samples,
        s.window_max_age_s,
        ",".join(s.trainer_workers) if s.trainer_workers else "from load reports",
    )


def main() -> int:
    return service_main("trainer", TrainerSettings, setup)
