"""Online refits of the partition: the trainer service's logic, without its process.

`Trainer` keeps the training window (`eldr.core.training.trainwindow`) fed by routing decisions,
decode summaries and load reports, decides when to refit, and runs a refit. The service
(`eldr_services.trainer`) builds it from its settings, feeds it from the bus, runs the
scheduling loop and records what the `TrainerObserver` hears as Prometheus metrics. The
collaborators come in as arguments: the database (`TrainerDatabase`), the announcer
(`PartitionAnnouncer`, on a `PartitionBus`), the observer and the clock; tests give an
SQLite file, a fake bus and a fake clock.

What a refit decides is the pure refit plan (`eldr.core.training.refit`), which the online
benchmark runs too: `TrainerState` holds the window, the active version, its drift monitor,
the schedule and the drift cut, and says when a refit is due (a `RefitRequest`:
"request"; every `refit_interval_s`: "schedule"; the live decode workers differing from
the active version's once the set has settled: "churn"; the drift monitor: "drift");
`TrainerState.select` picks the requests and `plan_refit` fits the candidate (aligned to
the active version, in a worker thread, with cooperative checkpoints for `fit_timeout_s`
and for stopping), shadow-gates it (scheduled and drift refits: held-out requests routed
under both partitions, promoted only if the modelled expert union is lower; churn refits,
the first version and operator requests ungated) and gives the verdict. This module keeps
the I/O around it:

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
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from sqlalchemy import Engine, make_url
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from eldr.bus import BusError
from eldr.core.partition.partition import FitReport, Partition
from eldr.core.signature.sparse import SparseRow
from eldr.core.training.config import TrainerConfig as TrainerConfig  # the service's import
from eldr.core.training.online import DriftBaseline, DriftMonitor, DriftStatus, ShadowResult
from eldr.core.training.refit import (
    FitAborted,
    FitFailed,
    RefitResult,
    RefitSkipped,
    TrainerState,
    TrainingSelection,
    plan_refit,
    shadow_batch,
)
from eldr.core.training.trainwindow import LiveWorkers, TrainingWindow
from eldr.partitions.announce import BlobMismatchError, PartitionBus, announce_version
from eldr.partitions.codec import partition_from_blob
from eldr.partitions.writer import (
    StoredVersion,
    WriteLockTimeoutError,
    load_active,
    stored_version,
    write_active_version,
    write_rejected_version,
)
from eldr.store import migrate, repo
from eldr.store.models import PartitionStatus
from eldr.wire import (
    Decision,
    DecodeSummary,
    LoadReport,
    Message,
    PartitionAnnouncement,
    RefitReply,
    RequestFinished,
    SparseCounts,
)

log = logging.getLogger(__name__)

TRIGGERS = ("request", "schedule", "drift", "churn")
OUTCOMES = ("ok", "skipped", "error", "rejected")
ERROR_STAGES = ("database", "lock", "fit", "publish", "internal")

M = TypeVar("M", bound=Message)


class RefitFailed(Exception):  # noqa: N818 - carries the failing stage for the metric
    def __init__(self, stage: str, message: str) -> None:
        super().__init__(message)
        self.stage = stage


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
        self, with_summary: int, without_summary: int, finished_without_summary: int = 0
    ) -> None:
        """Requests in the training window now (and of those without a decode summary, how
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
        """The newest active version of `model` numbered above `after`, with the blob its
        row stores (`repo.CorruptVersionError`, a ValueError, if that blob does not hash as
        the row says)."""
        with self.sessions()() as session:
            infos = [
                i
                for i in repo.list_versions(session, model, limit=50)
                if i.status is PartitionStatus.ACTIVE and i.version > after
            ]
            if not infos:
                return None
            record = repo.get(session, max(infos, key=lambda i: i.version).version)
        return stored_version(record)

    def close(self) -> None:
        if self._engine is not None:
            self._engine.dispose()


# --- announcing --------------------------------------------------------------------------


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
        try:
            await announce_version(
                self.bus,
                stored,
                bucket=self.bucket,
                subject=self.subject,
                created_ts_s=self.clock.time(),
                msg_id=f"partition-v{stored.version}",
            )
        except BusError as exc:
            self.pending = stored
            raise RefitFailed(
                "publish",
                f"version {stored.version} is stored and active but could not be announced "
                f"({exc}); the next refit announces it",
            ) from exc
        except BlobMismatchError as exc:
            self.pending = None  # retrying cannot help
            raise RefitFailed("publish", str(exc)) from exc
        self.pending = None
        log.info(
            "announced partition version %d of %s (%d workers, sha256 %s)",
            stored.version,
            stored.model,
            len(stored.blob.workers),
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
    """A refit's plan and the version it was stored as."""

    stored: StoredVersion
    result: RefitResult


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
        self.state = TrainerState(config, mono_s=clock.monotonic())
        """The window, active version, drift monitor, schedule and drift cut."""
        self.live = LiveWorkers(config.worker_ttl_s, max_workers=config.max_workers)
        self._refit_lock = asyncio.Lock()
        self._refit_running: tuple[str, float] | None = None
        """(trigger, monotonic start) of the refit under way, if any."""
        self._cancel = threading.Event()
        """Set to abandon the fit under way (the service is stopping)."""
        self.in_flight: dict[str, int] = {}
        """Per decode worker, running + waiting requests of its last load report."""

    @property
    def window(self) -> TrainingWindow:
        return self.state.window

    @property
    def active(self) -> Partition | None:
        """The active version as this trainer last stored or found it (drift, churn)."""
        return self.state.active

    @property
    def monitor(self) -> DriftMonitor | None:
        return self.state.monitor

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
            outcome = self.state.add_decision(
                msg.request_id,
                msg.model,
                msg.worker_id,
                _sparse_row(msg.signature),
                ts_s or self.clock.time(),
            )
        self.observer.took_input("decision", outcome)
        self._report_window()

    def add_summary(self, msg: DecodeSummary, ts_s: float | None) -> None:
        """Join a decode summary to its request in the window."""
        outcome = self.state.add_summary(
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
        outcome = self.state.finish(msg.request_id, ts_s or self.clock.time())
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
        with_summary = self.window.with_summary
        self.observer.window_changed(
            with_summary, len(self.window) - with_summary, self.window.finished_without_summary
        )

    # --- schedule --------------------------------------------------------------------------

    def restart_schedule(self) -> None:
        """Count the schedule from now (the service calls it when its loop starts)."""
        self.state.restart_schedule(self.clock.monotonic())

    def due(self) -> tuple[str, str] | None:
        """Age the window, then (trigger, reason) if a refit is due now, else None."""
        now_s = self.clock.time()
        live = self.workers(now_s)
        due = self.state.due(
            now_s=now_s, mono_s=self.clock.monotonic(), live=live, drift=self.drift_status()
        )
        self._report_window()
        self.observer.saw_live_workers(len(live))
        return due

    def drift_status(self) -> DriftStatus | None:
        """The monitor's verdict now (None without an active version or monitoring)."""
        monitor = self.monitor
        status = self.state.drift_status()
        if monitor is None or status is None:
            return None
        if monitor.baseline is not None:
            self.observer.drift_baseline_set(monitor.baseline)
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
        self.state.restart_schedule(self.clock.monotonic())
        now_s = self.clock.time()
        self.window.expire(now_s)
        self._report_window()
        await self.announcer.announce_pending()
        live = self.workers(now_s)
        self.observer.saw_live_workers(len(live))
        selection = self.state.select(now_s=now_s, live=live, k=k, trigger=trigger)
        checkpoint = self._checkpoint(time.monotonic() + self.config.fit_timeout_s)
        outcome = await asyncio.to_thread(
            self._fit_and_store, selection, reason, dict(self.in_flight), checkpoint
        )
        result = outcome.result
        baseline = self.state.apply(result)
        if baseline is not None:
            self.observer.drift_baseline_set(baseline)
        self._observe_fit(outcome)
        report = result.report
        model = selection.snapshot.model
        moved = "n/a" if report.moved_share is None else f"{100 * report.moved_share:.1f}%"
        unprofiled = self.window.finished_without_summary
        fitted = (
            f"{report.n_train} requests ({result.n_with_summary} with decode summaries"
            + (
                f"; {unprofiled} finished without one: is the capture plugin on the decode "
                "instances (ELDR_VLLM_ROLE=decode)?"
                if unprofiled and result.n_with_summary < self.config.min_profiled
                else ""
            )
            + "), "
            f"{len(result.workers)} workers, {report.kept_layers}/{report.of_layers} layers, "
            f"moved {moved}, fit {result.fit_s:.3g} s"
        )
        if not result.promote:
            message = (
                f"version {outcome.stored.version} ({model}) {result.verdict.reason}; "
                f"version {result.previous_version} stays active ({fitted})"
            )
            log.warning("refit (%s, %s): %s", trigger, reason, message)
            return RefitReply(version=None, status="rejected", message=message)
        await self.announcer.announce(outcome.stored)
        message = f"version {outcome.stored.version} ({model}): {fitted}; {result.verdict.reason}"
        log.info("refit (%s, %s): %s", trigger, reason, message)
        return RefitReply(version=outcome.stored.version, status="ok", message=message)

    def set_active(self, partition: Partition) -> None:
        """Track the active version: the drift monitor measures against it."""
        baseline = self.state.set_active(partition)
        if baseline is not None:
            self.observer.drift_baseline_set(baseline)

    def _fit_and_store(
        self,
        selection: TrainingSelection,
        reason: str,
        in_flight: dict[str, int],
        checkpoint: Callable[[], None] | None = None,
    ) -> FitOutcome:
        """Runs in a worker thread: read the active version, run the refit plan on it
        (`plan_refit`), store the candidate as active or rejected. What `checkpoint` raises
        (`FitAborted`: the time limit, or the service stopping) ends the refit at stage
        "fit" before anything is stored."""
        model = selection.snapshot.model
        sessions = self.database.sessions()
        try:
            previous = load_active(sessions, model)
        except SQLAlchemyError as exc:
            raise RefitFailed("database", self.database.describe_error(exc)) from exc
        except ValueError as exc:  # a corrupt stored version: fit without alignment
            log.error("active version of %s unreadable, not aligning to it: %s", model, exc)
            previous = None
        c = self.config
        try:
            result = plan_refit(
                selection,
                previous,
                config=c,
                in_flight=in_flight,
                checkpoint=checkpoint,
                clock=time.perf_counter,
            )
        except FitFailed as exc:
            raise RefitFailed("fit", str(exc)) from exc
        self.observer.fitted(result.fit_s)
        for note in result.report.notes:
            log.info("fit note: %s", note)
        if result.shadow is not None:
            self.observer.shadow_evaluated(result.shadow)
        note = f"{reason}: {result.verdict.reason}"[:500]
        write = write_active_version if result.promote else write_rejected_version
        try:
            stored = write(
                sessions,
                result.partition,
                seed=c.seed,
                n_train=result.report.n_train,
                parent_version=result.previous_version,
                note=note,
                lock_timeout_s=c.write_lock_timeout_s,
            )
        except WriteLockTimeoutError as exc:
            raise RefitFailed("lock", str(exc)) from exc
        except SQLAlchemyError as exc:
            raise RefitFailed("database", self.database.describe_error(exc)) from exc
        return FitOutcome(stored, result)

    def shadow_batch(self, workers: tuple[str, ...]) -> float:
        """The per-worker batch a shadow evaluation models now (`shadow_batch`: the setting,
        else the mean in flight by the load reports, at least MIN_SHADOW_BATCH)."""
        return shadow_batch(self.config.shadow_batch, self.in_flight, workers)

    def _observe_fit(self, outcome: FitOutcome) -> None:
        if outcome.result.promote:
            self.observer.version_promoted(outcome.stored.version, outcome.result.report)
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
                self.set_active(partition_from_blob(record.blob, "exact"))
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
