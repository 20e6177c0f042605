"""Online refits of the partition: the trainer service's logic, without its process.

`Trainer` keeps the training window (`eldr.core.training.trainwindow`) fed by routing decisions,
decode profiles and load reports, decides when to refit, and runs a refit. The service
(`eldr_services.trainer`) builds it from its settings, feeds it from the bus, runs the
scheduling loop and records what the `TrainerObserver` hears as Prometheus metrics. The
collaborators come in as arguments: the database (`TrainerDatabase`), the announcer
(`PartitionAnnouncer`, on a `PartitionBus`), the observer and the clock; tests give an
SQLite file, a fake bus and a fake clock.

A refit fits a partition with `eldr.core.partition.partition.fit_partition` in a worker thread,
aligned to the active version so that traffic moves as little as possible. Triggers
(`eldr.core.routing.online.refit_trigger`): a `RefitRequest` ("request"), every `refit_interval_s`
("schedule"), the live decode workers differing from the active version's once the set
has settled ("churn": a worker joined or left), or the drift monitor seeing recent requests
sit worse against the active version than its baseline ("drift";
`eldr.core.routing.online.DriftMonitor`).

Scheduled and drift refits are gated (`shadow_gate`): a share of the window's requests
(by a hash of the request id) is held out of the fit, and both the active version and
the candidate route those requests in a shadow evaluation modelled on the cost model
(`eldr.core.routing.online.shadow_evaluate`); the candidate is promoted only if its modelled
expert union is lower. Churn refits, the first version and operator requests are promoted
without a gate (the reason says so). Then:

1. a promoted candidate is stored as a new, immutable version and activated, in one
   transaction under the partition write lock (`eldr.partitions.writer`): the database
   numbers versions; a rejected one is stored with status "rejected" and the active
   version is untouched. Either way the version's note says why (the trigger, and the
   shadow evaluation's numbers or why there was none), and so do the `RefitReply`, the
   log and the observer;
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
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar

import numpy as np
from sqlalchemy import Engine, make_url
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from eldr.bus import BusError, ObjectRef, PublishAck
from eldr.core.partition.partition import FitReport, Partition, fit_partition
from eldr.core.routing.online import (
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
    LiveWorkers,
    SparseRow,
    TrainingSet,
    TrainingWindow,
    WindowSnapshot,
    pick_workers,
)
from eldr.core.workload.trace import ModelGeometry
from eldr.partitions.codec import partition_from_record
from eldr.partitions.writer import (
    StoredVersion,
    WriteLockTimeoutError,
    blob_for_version,
    load_active,
    write_active_version,
    write_rejected_version,
)
from eldr.store import migrate, repo
from eldr.store.models import PartitionStatus
from eldr.wire import (
    Decision,
    DecodeProfile,
    LoadReport,
    Message,
    PartitionAnnouncement,
    RefitReply,
    RequestFinished,
    SparseCounts,
)

log = logging.getLogger(__name__)

MIN_SHADOW_BATCH = 8.0
"""Smallest per-worker batch a shadow evaluation models (see `Trainer.shadow_batch`)."""
TRIGGERS = ("request", "schedule", "drift", "churn")
OUTCOMES = ("ok", "skipped", "error", "rejected")
ERROR_STAGES = ("database", "lock", "fit", "publish", "internal")

M = TypeVar("M", bound=Message)


class RefitSkipped(Exception):  # noqa: N818 - an outcome, not an error
    """A refit's preconditions do not hold; the message says which."""


class FitAborted(Exception):  # noqa: N818 - a reason to stop, raised by the fit's checkpoint
    """The fit passed its time limit or was cancelled (the service is stopping)."""


class RefitFailed(Exception):  # noqa: N818 - carries the failing stage for the metric
    def __init__(self, stage: str, message: str) -> None:
        super().__init__(message)
        self.stage = stage


@dataclass(frozen=True)
class TrainerConfig:
    """What a `Trainer` is tuned by: the fields of the same names of the trainer service's
    settings (their descriptions are there); the defaults are the settings' defaults."""

    model: str | None = None
    trainer_workers: tuple[str, ...] = ()
    worker_ttl_s: float = 10.0
    window_max_samples: int = 20_000
    window_max_age_s: float = 1800.0
    min_samples: int = 256
    refit_interval_s: float = 60.0
    seed: int = 0
    transform: Literal["idf", "raw"] = "idf"
    layer_selection: Literal["greedy", "all"] = "greedy"
    min_profiled: int = 64
    reduce_dim: int = 128
    write_lock_timeout_s: float = 30.0
    shadow_gate: bool = True
    shadow_gate_requests: bool = False
    shadow_min_gain: float = 0.0
    shadow_holdout_fraction: float = 0.2
    shadow_min_requests: int = 32
    shadow_batch: float = 0.0
    shadow_tau: float = 0.1
    drift_detection: bool = True
    drift_window: int = 512
    drift_min_samples: int = 128
    drift_max_similarity_drop: float = 0.05
    drift_max_skew_rise: float = 0.2
    drift_min_gap_s: float = 30.0
    drift_fit_max_age_s: float = 300.0
    churn_refit: bool = True
    churn_settle_s: float = 5.0
    max_workers: int = 1024
    fit_timeout_s: float = 300.0

    @classmethod
    def from_settings(cls, settings: object) -> TrainerConfig:
        """The config from any object with attributes of these names (the service's
        settings)."""
        values = {f.name: getattr(settings, f.name) for f in dataclasses.fields(cls)}
        return cls(**values)


class Clock(Protocol):
    def time(self) -> float:
        """Unix seconds (window timestamps, announcements)."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (the refit schedule)."""
        ...


class SystemClock:
    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()


class TrainerObserver(Protocol):
    """What a `Trainer` reports as it goes (the service turns it into metrics)."""

    def took_input(self, kind: str, outcome: str) -> None:
        """A decision or profile was taken or ignored (`outcome` says which and why)."""

    def window_changed(
        self, with_profile: int, without_profile: int, finished_without_profile: int = 0
    ) -> None:
        """Requests in the training window now (and of those without a decode profile, how
        many have finished: their profile is not coming)."""

    def saw_live_workers(self, count: int) -> None:
        """Decode workers a refit would use now."""

    def refit_ended(self, trigger: str, status: str) -> None:
        """A refit ended (status: ok, skipped, error, rejected)."""

    def refit_failed(self, stage: str) -> None:
        """A refit failed at `stage` (one of ERROR_STAGES)."""

    def fitted(self, seconds: float) -> None:
        """One fit took this long."""

    def shadow_evaluated(self, result: ShadowResult) -> None:
        """A shadow evaluation's result."""

    def version_rejected(self, version: int) -> None:
        """The shadow gate stored `version` as rejected."""

    def version_promoted(self, version: int, report: FitReport) -> None:
        """`version` (fitted as `report` says) was stored as active."""

    def found_active(self, version: int) -> None:
        """`version` was found active in the database at start."""

    def drift_baseline_set(self, baseline: DriftBaseline) -> None:
        """The active version's drift baseline."""

    def drift_measured(self, best_similarity: float, occupancy_skew: float) -> None:
        """What the drift monitor measures on recent requests."""

    def drift_verdict(self, drifted: bool) -> None:
        """The drift monitor's verdict now."""


# --- database ----------------------------------------------------------------------------


class TrainerDatabase:
    """Sessions on the partition database, opened on first use and migrated (when asked
    to) before the first one is handed out; until that succeeds every use tries again."""

    def __init__(
        self,
        url: str,
        *,
        migrate_on_start: bool,
        connect_timeout_s: float,
        sqlite_timeout_s: float,
    ) -> None:
        self.url = url
        self.shown = make_url(url).render_as_string(hide_password=True)
        self._connect_timeout_s = connect_timeout_s
        self._sqlite_timeout_s = sqlite_timeout_s
        self._engine: Engine | None = None
        self._sessions: sessionmaker[Session] | None = None
        self._migrated = not migrate_on_start

    @property
    def ready(self) -> bool:
        """Whether sessions were opened on a migrated database."""
        return self._sessions is not None and self._migrated

    def sessions(self) -> sessionmaker[Session]:
        """Sessions on a reachable, migrated database (raises RefitFailed otherwise)."""
        try:
            if self._sessions is None:
                backend = make_url(self.url).get_backend_name()
                connect_args: dict[str, object] = {}
                if backend == "postgresql":
                    connect_args["connect_timeout"] = max(1, math.ceil(self._connect_timeout_s))
                elif backend == "sqlite":
                    connect_args["timeout"] = self._sqlite_timeout_s
                self._engine = repo.make_engine(self.url, connect_args=connect_args)
                self._sessions = repo.make_session_factory(self._engine)
            if not self._migrated:
                # Connect through our engine first: it fails fast when the server is down.
                assert self._engine is not None
                with self._engine.connect():
                    pass
                migrate.upgrade(self.url)
                self._migrated = True
        except (SQLAlchemyError, OSError) as exc:
            raise RefitFailed("database", self.describe_error(exc)) from exc
        return self._sessions

    def describe_error(self, exc: BaseException) -> str:
        detail = str(getattr(exc, "orig", None) or exc).strip().splitlines()
        return f"database {self.shown} unavailable: {detail[0] if detail else type(exc).__name__}"

    def newest_active(self, model: str | None, *, after: int = 0) -> StoredVersion | None:
        """The newest active version of `model` numbered above `after`, with its blob
        rebuilt (ValueError if that blob does not hash as stored)."""
        with self.sessions()() as session:
            infos = [
                i
                for i in repo.list_versions(session, model, limit=50)
                if i.status is PartitionStatus.ACTIVE and i.version > after
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


# --- announcing --------------------------------------------------------------------------


class PartitionBus(Protocol):
    """The part of `eldr.bus.Bus` that announcing a version needs."""

    async def object_put(self, bucket: str, name: str, message: Message) -> ObjectRef: ...

    async def js_publish(
        self, subject: str, message: Message, *, msg_id: str | None = None
    ) -> PublishAck: ...

    async def get_last(self, stream: str, subject: str, message_type: type[M]) -> M | None: ...


class PartitionAnnouncer:
    """Puts a stored version's blob in the object store, then announces it; a version
    whose announcement failed is remembered (`pending`) for the next try."""

    def __init__(
        self, bus: PartitionBus, *, bucket: str, subject: str, stream: str, clock: Clock
    ) -> None:
        self.bus = bus
        self.bucket = bucket
        self.subject = subject
        self.stream = stream
        self.clock = clock
        self.pending: StoredVersion | None = None

    async def announce(self, stored: StoredVersion) -> None:
        blob = stored.blob
        name = f"v{stored.version}"
        try:
            ref = await self.bus.object_put(self.bucket, name, blob)
            if ref.sha256 != stored.sha256:
                # Encoding is deterministic; a mismatch is a bug, and routers would refuse it.
                raise RefitFailed(
                    "publish",
                    f"object {name} hashes to {ref.sha256}, the database has {stored.sha256}",
                )
            await self.bus.js_publish(
                self.subject,
                PartitionAnnouncement(
                    version=stored.version,
                    model=blob.model,
                    object_name=name,
                    sha256=stored.sha256,
                    created_ts_s=self.clock.time(),
                    k=len(blob.workers),
                    dim=blob.centroids.shape[1],
                    workers=list(blob.workers),
                ),
                msg_id=f"partition-v{stored.version}",
            )
        except BusError as exc:
            self.pending = stored
            raise RefitFailed(
                "publish",
                f"version {stored.version} is stored and active but could not be announced "
                f"({exc}); the next refit announces it",
            ) from exc
        except RefitFailed:
            self.pending = None  # retrying cannot help
            raise
        self.pending = None
        log.info(
            "announced partition version %d of %s (%d workers, sha256 %s)",
            stored.version,
            blob.model,
            len(blob.workers),
            stored.sha256[:12],
        )

    async def announce_pending(self) -> None:
        if self.pending is not None:
            await self.announce(self.pending)

    async def last_announced(self) -> int:
        """The version of the last announcement (0: none); BusError or ValueError when it
        cannot be read."""
        last = await self.bus.get_last(self.stream, self.subject, PartitionAnnouncement)
        return 0 if last is None else last.version


# --- the trainer -------------------------------------------------------------------------


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


class Trainer:
    """The training window, the refit triggers and the refit itself."""

    def __init__(
        self,
        config: TrainerConfig,
        database: TrainerDatabase,
        announcer: PartitionAnnouncer,
        observer: TrainerObserver,
        clock: Clock,
    ) -> None:
        self.config = config
        self.database = database
        self.announcer = announcer
        self.observer = observer
        self.clock = clock
        self.window = TrainingWindow(config.window_max_samples, config.window_max_age_s)
        self.live = LiveWorkers(config.worker_ttl_s, max_workers=config.max_workers)
        self._refit_lock = asyncio.Lock()
        self._refit_running: tuple[str, float] | None = None
        """(trigger, monotonic start) of the refit under way, if any."""
        self._cancel = threading.Event()
        """Set to abandon the fit under way (the service is stopping)."""
        self._added_at_last_fit: int | None = None
        self.active: Partition | None = None
        """The active version as this trainer last stored or found it (drift, churn)."""
        self.monitor: DriftMonitor | None = None
        self.in_flight: dict[str, int] = {}
        """Per decode worker, running + waiting requests of its last load report."""
        self._last_fit_mono: float | None = None
        self._drift_cut_s = -math.inf
        """Requests before this (Unix s) are what drifted away: no later fit uses them."""
        self._live: tuple[str, ...] = ()
        self._live_since_mono = clock.monotonic()

    # --- inputs ----------------------------------------------------------------------------

    def add_decision(self, msg: Decision, ts_s: float | None) -> None:
        """Take a routing decision (stamped `ts_s`, else now) into the window."""
        if not msg.assigned:
            outcome = "expired"  # no worker decoded it: nothing to learn
        elif msg.signature is None:
            outcome = "no_signature"
        elif self.config.model is not None and msg.model != self.config.model:
            outcome = "other_model"
        else:
            outcome = self.window.add_decision(
                msg.request_id,
                msg.model,
                msg.worker_id,
                _sparse_row(msg.signature),
                ts_s or self.clock.time(),
            )
            monitor = self.monitor
            if outcome == "added" and monitor is not None and msg.model == monitor.model:
                monitor.observe(msg.signature.to_dense(np.float32))
        self.observer.took_input("decision", outcome)
        self._report_window()

    def add_profile(self, msg: DecodeProfile, ts_s: float | None) -> None:
        """Join a decode profile to its request in the window."""
        outcome = self.window.add_profile(
            msg.request_id, _sparse_row(msg.counts), ts_s or self.clock.time()
        )
        self.observer.took_input("profile", outcome)
        if outcome == "joined":
            self._report_window()

    def add_finished(self, msg: RequestFinished, ts_s: float | None) -> None:
        """A gateway saw the request's decode end: whatever the profile does, it is over."""
        if msg.reason == "moved":
            self.observer.took_input("finished", "moved")
            return
        outcome = self.window.finish(msg.request_id, ts_s or self.clock.time())
        self.observer.took_input("finished", outcome)
        if outcome == "finished":
            self._report_window()

    def add_load(self, msg: LoadReport, ts_s: float | None) -> None:
        """A decode worker's load report: it is live, with this many requests in flight
        (unless the live table is full: `max_workers`)."""
        taken = self.live.on_report(msg.worker_id, ts_s or self.clock.time(), draining=msg.draining)
        if not taken and msg.worker_id not in self.in_flight:
            self.observer.took_input("load", "fleet_full")
            return
        self.in_flight[msg.worker_id] = msg.running + msg.waiting
        while len(self.in_flight) > 2 * self.config.max_workers:
            del self.in_flight[next(iter(self.in_flight))]

    def workers(self, now_s: float) -> tuple[str, ...]:
        """The decode workers a refit would use: the fixed list if set, else the live ones."""
        if self.config.trainer_workers:
            return tuple(sorted(self.config.trainer_workers))
        return self.live.live(now_s)

    def _report_window(self) -> None:
        with_profile = self.window.with_profile
        self.observer.window_changed(
            with_profile, len(self.window) - with_profile, self.window.finished_without_profile
        )

    # --- schedule --------------------------------------------------------------------------

    def restart_schedule(self) -> None:
        """Count the schedule from now (the service calls it when its loop starts)."""
        self._last_fit_mono = self.clock.monotonic()

    def due(self) -> tuple[str, str] | None:
        """Age the window, then (trigger, reason) if a refit is due now, else None."""
        now_s = self.clock.time()
        self.window.expire(now_s)
        self._report_window()
        live = self.workers(now_s)
        self.observer.saw_live_workers(len(live))
        trigger = self.trigger(live)
        if trigger is None:
            return None
        reason = {"schedule": "scheduled", "churn": "worker set changed"}.get(trigger, trigger)
        if trigger == "drift" and self.monitor is not None:
            reason = f"drift: {self.monitor.status().reason}"
        if trigger == "churn":
            active = () if self.active is None else self.active.workers
            reason = (
                f"worker set changed: joined "
                f"{','.join(sorted(set(live) - set(active))) or '-'}, left "
                f"{','.join(sorted(set(active) - set(live))) or '-'}"
            )
        return trigger, reason

    def trigger(self, live: tuple[str, ...]) -> str | None:
        """Why to refit now (`eldr.core.routing.online.refit_trigger`), or None."""
        c = self.config
        mono = self.clock.monotonic()
        if live != self._live:
            self._live = live
            self._live_since_mono = mono
        active = self.active
        drift = self.drift_status()
        return refit_trigger(
            now_s=mono,
            last_fit_s=self._last_fit_mono,
            interval_s=c.refit_interval_s,
            live=live,
            active_workers=None if active is None or not c.churn_refit else active.workers,
            live_since_s=self._live_since_mono,
            churn_settle_s=c.churn_settle_s,
            drift=drift,
            min_gap_s=c.drift_min_gap_s,
        )

    def drift_status(self) -> DriftStatus | None:
        """The monitor's verdict now (None without an active version or monitoring)."""
        if self.monitor is None:
            return None
        status = self.monitor.status()
        if self.monitor.baseline is not None:
            self.observer.drift_baseline_set(self.monitor.baseline)
        if status.samples and status.best_similarity == status.best_similarity:
            self.observer.drift_measured(status.best_similarity, status.occupancy_skew)
        self.observer.drift_verdict(status.drifted)
        return status

    # --- refits ----------------------------------------------------------------------------

    def cancel_fit(self) -> None:
        """Abandon the fit under way at its next checkpoint (the service is stopping); later
        refits are refused."""
        self._cancel.set()

    def _checkpoint(self, deadline_mono: float) -> Callable[[], None]:
        limit_s = self.config.fit_timeout_s

        def check() -> None:
            if self._cancel.is_set():
                raise FitAborted("cancelled: the trainer is stopping")
            if time.monotonic() > deadline_mono:
                raise FitAborted(f"the fit took longer than fit_timeout_s={limit_s:g} s")

        return check

    async def refit(self, reason: str, k: int | None, *, trigger: str) -> RefitReply:
        """Refit now (one at a time: a refit asked for while another runs is answered at
        once, skipped); every outcome is a reply, none raises."""
        running = self._refit_running
        if running is not None or self._refit_lock.locked():
            what, since = running or ("?", self.clock.monotonic())
            message = (
                f"a refit ({what}) is under way for {self.clock.monotonic() - since:.1f} s "
                f"(at most fit_timeout_s={self.config.fit_timeout_s:g} s): not started"
            )
            log.info("refit (%s) skipped: %s", trigger, message)
            self.observer.refit_ended(trigger, "skipped")
            return RefitReply(version=None, status="skipped", message=message)
        if self._cancel.is_set():
            self.observer.refit_ended(trigger, "skipped")
            return RefitReply(version=None, status="skipped", message="the trainer is stopping")
        async with self._refit_lock:
            self._refit_running = (trigger, self.clock.monotonic())
            try:
                reply = await self._refit(reason, k, trigger)
            except RefitSkipped as exc:
                log.info("refit (%s) skipped: %s", trigger, exc)
                reply = RefitReply(version=None, status="skipped", message=str(exc))
            except RefitFailed as exc:
                self.observer.refit_failed(exc.stage)
                log.error("refit (%s) failed at %s: %s", trigger, exc.stage, exc)
                reply = RefitReply(version=None, status="error", message=str(exc))
            except Exception as exc:  # a bug: answer and count it, keep the service up
                self.observer.refit_failed("internal")
                log.exception("refit (%s) failed unexpectedly", trigger)
                reply = RefitReply(
                    version=None, status="error", message=f"{type(exc).__name__}: {exc}"
                )
            finally:
                self._refit_running = None
            self.observer.refit_ended(trigger, reply.status)
            return reply

    async def _refit(self, reason: str, k: int | None, trigger: str) -> RefitReply:
        self._last_fit_mono = self.clock.monotonic()
        now_s = self.clock.time()
        self.window.expire(now_s)
        self._report_window()
        await self.announcer.announce_pending()
        live = self.workers(now_s)
        self.observer.saw_live_workers(len(live))
        if trigger == "schedule" and self._added_at_last_fit == self.window.added_total:
            raise RefitSkipped("no new requests in the window since the last fit")
        snapshot = self.window.snapshot(self.config.model)
        self._check_preconditions(snapshot, live, k)
        assert snapshot is not None
        since_s = self._drift_cut_s
        if trigger == "drift":
            since_s = max(since_s, now_s - self.config.drift_fit_max_age_s)
        if since_s > -math.inf:
            snapshot = self._recent(snapshot, since_s, live)
        added_total = self.window.added_total
        checkpoint = self._checkpoint(time.monotonic() + self.config.fit_timeout_s)
        outcome = await asyncio.to_thread(
            self._fit_and_store, snapshot, live, k, reason, trigger, checkpoint
        )
        self._added_at_last_fit = added_total
        self._observe_fit(outcome)
        report = outcome.report
        moved = "n/a" if report.moved_share is None else f"{100 * report.moved_share:.1f}%"
        unprofiled = self.window.finished_without_profile
        fitted = (
            f"{report.n_train} requests ({outcome.n_with_profile} with decode profiles"
            + (
                f"; {unprofiled} finished without one: is the capture plugin on the decode "
                "instances (ELDR_VLLM_ROLE=decode)?"
                if unprofiled and outcome.n_with_profile < self.config.min_profiled
                else ""
            )
            + "), "
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
        self.set_active(outcome.partition)
        if trigger == "drift":
            self._drift_cut_s = since_s
        await self.announcer.announce(outcome.stored)
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
        if len(recent) < max(self.config.min_samples, len(live)):
            return snapshot
        return WindowSnapshot(snapshot.model, snapshot.shape, recent)

    def set_active(self, partition: Partition) -> None:
        """Track the active version: the drift monitor measures against it."""
        self.active = partition
        c = self.config
        if not c.drift_detection:
            self.monitor = None
            return
        baseline = DriftBaseline.from_metrics(partition.metrics)
        self.monitor = DriftMonitor(
            partition,
            baseline,
            window=max(c.drift_window, c.drift_min_samples),
            thresholds=DriftThresholds(
                max_similarity_drop=c.drift_max_similarity_drop,
                max_skew_rise=c.drift_max_skew_rise,
                min_samples=c.drift_min_samples,
            ),
        )
        if baseline is not None:
            self.observer.drift_baseline_set(baseline)

    def _check_preconditions(
        self, snapshot: WindowSnapshot | None, live: tuple[str, ...], k: int | None
    ) -> None:
        c = self.config
        n = 0 if snapshot is None else len(snapshot)
        if not live:
            raise RefitSkipped(
                f"no live decode workers (none reported within {c.worker_ttl_s:g} s)"
            )
        if k is not None and k > len(live):
            raise RefitSkipped(f"k={k} but only {len(live)} live decode worker(s)")
        needed = max(c.min_samples, k or len(live))
        if n < needed:
            what = "" if c.model is None else f" of model {c.model}"
            raise RefitSkipped(f"{n} request(s){what} in the window, a refit needs {needed}")

    def _fit_and_store(
        self,
        snapshot: WindowSnapshot,
        live: tuple[str, ...],
        k: int | None,
        reason: str,
        trigger: str,
        checkpoint: Callable[[], None] | None = None,
    ) -> FitOutcome:
        """Runs in a worker thread: read the active version, fit, gate, store. The fit
        calls `checkpoint` often; what it raises (`FitAborted`: the time limit, or the
        service stopping) ends the refit at stage "fit" before anything is stored."""
        sessions = self.database.sessions()
        try:
            previous = load_active(sessions, snapshot.model)
        except SQLAlchemyError as exc:
            raise RefitFailed("database", self.database.describe_error(exc)) from exc
        except ValueError as exc:  # a corrupt stored version: fit without alignment
            log.error(
                "active version of %s unreadable, not aligning to it: %s", snapshot.model, exc
            )
            previous = None
        workers = pick_workers(live, k, () if previous is None else previous.workers)
        training = snapshot.training_set()
        L, E = snapshot.shape
        geometry = ModelGeometry(num_layers=L, moe_layers=tuple(range(L)), num_experts=E, top_k=1)
        c = self.config
        forced = self.ungated_because(previous, workers, trigger)
        held = (
            np.zeros(training.n, dtype=bool)
            if forced
            else holdout_mask(training.request_ids, c.shadow_holdout_fraction)
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
                seed=c.seed,
                previous=previous,
                transform=c.transform,
                layer_selection=c.layer_selection,
                reduce_dim=c.reduce_dim or None,
                min_profiled=c.min_profiled,
                holdout_prefill=training.prefill[held] if held.any() else None,
                checkpoint=checkpoint,
            )
        except ValueError as exc:
            raise RefitFailed("fit", f"fit failed: {exc}") from exc
        except FitAborted as exc:
            raise RefitFailed(
                "fit",
                f"fit abandoned after {time.perf_counter() - started:.1f} s "
                f"({training.n} requests, {len(workers)} workers): {exc}",
            ) from exc
        fit_s = time.perf_counter() - started
        self.observer.fitted(fit_s)
        for note in report.notes:
            log.info("fit note: %s", note)
        shadow: ShadowResult | None = None
        missing = ""
        if not forced:
            assert previous is not None
            self._check(checkpoint, started)
            shadow, missing = self._shadow(previous, partition, training, held, workers, L)
        self._check(checkpoint, started)  # nothing is stored after the time limit
        verdict = promotion_verdict(shadow, c.shadow_min_gain, forced=forced, missing=missing)
        note = f"{reason}: {verdict.reason}"[:500]
        write = write_active_version if verdict.promote else write_rejected_version
        try:
            stored = write(
                sessions,
                partition,
                seed=c.seed,
                n_train=report.n_train,
                parent_version=None if previous is None else previous.version,
                note=note,
                lock_timeout_s=c.write_lock_timeout_s,
            )
        except WriteLockTimeoutError as exc:
            raise RefitFailed("lock", str(exc)) from exc
        except SQLAlchemyError as exc:
            raise RefitFailed("database", self.database.describe_error(exc)) from exc
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

    @staticmethod
    def _check(checkpoint: Callable[[], None] | None, started: float) -> None:
        if checkpoint is None:
            return
        try:
            checkpoint()
        except FitAborted as exc:
            raise RefitFailed(
                "fit", f"fit abandoned after {time.perf_counter() - started:.1f} s: {exc}"
            ) from exc

    def ungated_because(
        self, previous: Partition | None, workers: tuple[str, ...], trigger: str
    ) -> str:
        """Why this refit is promoted without a shadow gate ("" when it is gated)."""
        c = self.config
        if previous is None:
            return "no active version"
        if set(previous.workers) != set(workers):
            joined = sorted(set(workers) - set(previous.workers))
            left = sorted(set(previous.workers) - set(workers))
            return (
                f"the workers differ from version {previous.version}'s "
                f"(joined: {','.join(joined) or '-'}; left: {','.join(left) or '-'})"
            )
        if not c.shadow_gate:
            return "the shadow gate is off"
        if trigger == "request" and not c.shadow_gate_requests:
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
        c = self.config
        profiled = held & training.has_profile
        if training.decode is not None and int(profiled.sum()) >= c.shadow_min_requests:
            rows = profiled
            activation = per_token_activation(training.decode[rows], num_moe_layers)
            source = "decode profiles"
        elif int(held.sum()) >= c.shadow_min_requests:
            rows = held
            activation = prefill_activation(training.prefill[rows], num_moe_layers)
            source = f"prefill proxy: {int(profiled.sum())} with decode profiles"
        else:
            return None, (
                f"{int(held.sum())} held-out request(s), a shadow evaluation needs "
                f"{c.shadow_min_requests}"
            )
        result = shadow_evaluate(
            previous,
            candidate,
            training.prefill[rows],
            activation,
            workers,
            batch=self.shadow_batch(workers),
            num_moe_layers=num_moe_layers,
            tau=c.shadow_tau,
            source=source,
        )
        self.observer.shadow_evaluated(result)
        return result, ""

    def shadow_batch(self, workers: tuple[str, ...]) -> float:
        """The per-worker batch to model: the setting, else the fleet's mean in-flight
        requests (at least MIN_SHADOW_BATCH: a quiet fleet, or one whose load reports this
        trainer does not read, would make every partition look alike)."""
        if self.config.shadow_batch > 0:
            return self.config.shadow_batch
        loads = [self.in_flight.get(w, 0) for w in workers]
        return max(MIN_SHADOW_BATCH, float(np.mean(loads)) if loads else 0.0)

    def _observe_fit(self, outcome: FitOutcome) -> None:
        if outcome.verdict.promote:
            self.observer.version_promoted(outcome.stored.version, outcome.report)
        else:
            self.observer.version_rejected(outcome.stored.version)

    # --- start -----------------------------------------------------------------------------

    def load_active_version(self) -> None:
        """Migrate (if configured) and find the active version; failures are only logged."""
        try:
            sessions = self.database.sessions()
            with sessions() as session:
                infos = [
                    i
                    for i in repo.list_versions(session, self.config.model, limit=50)
                    if i.status is PartitionStatus.ACTIVE
                ]
            if infos:
                newest = max(infos, key=lambda i: i.version)
                self.observer.found_active(newest.version)
                with sessions() as session:
                    record = repo.get(session, newest.version)
                self.set_active(partition_from_record(record, "exact"))
        except RefitFailed as exc:
            log.error("at start: %s; refits will retry", exc)
        except SQLAlchemyError as exc:
            log.error("at start: %s; refits will retry", self.database.describe_error(exc))
        except ValueError as exc:  # an unreadable stored version: no drift baseline then
            log.error("at start: active version unreadable: %s", exc)

    async def reconcile_announcement(self) -> None:
        """Announce the newest active version if a crash left it stored but unannounced."""
        if not self.database.ready:
            return
        try:
            announced = await self.announcer.last_announced()
        except (BusError, ValueError) as exc:
            log.error("could not read the last partition announcement: %s", exc)
            return
        try:
            stored = await asyncio.to_thread(
                self.database.newest_active, self.config.model, after=announced
            )
        except (SQLAlchemyError, ValueError) as exc:
            log.error("could not check for an unannounced version: %s", exc)
            return
        if stored is not None:
            log.warning(
                "version %d is active but was never announced: announcing it", stored.version
            )
            with contextlib.suppress(RefitFailed):
                await self.announcer.announce(stored)


def _sparse_row(counts: SparseCounts) -> SparseRow:
    layers, experts = counts.shape
    return SparseRow((layers, experts), counts.indices(), counts.values())
