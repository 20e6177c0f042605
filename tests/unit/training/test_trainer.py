"""The trainer's refit orchestration (`eldr.training.trainer`) with an SQLite file, a fake bus, a
fake clock and a recording observer: no sockets."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest

from eldr.bus import BusError, ObjectRef, PublishAck
from eldr.core.training.refit import ungated_because
from eldr.core.workload.synthetic import SyntheticSpec, generate
from eldr.core.workload.trace import expert_counts
from eldr.store import migrate
from eldr.training.trainer import (
    PartitionAnnouncer,
    Trainer,
    TrainerConfig,
    TrainerDatabase,
)
from eldr.wire import (
    Decision,
    DecodeSummary,
    LoadReport,
    Message,
    PartitionAnnouncement,
    SparseCounts,
)
from eldr_services.trainer.settings import TrainerSettings
from support import messages

M = TypeVar("M", bound=Message)

SPEC = SyntheticSpec(
    num_topics=3,
    num_moe_layers=4,
    num_experts=16,
    top_k=2,
    prompt_len_range=(8, 32),
    decode_len_range=(4, 16),
)
WORKERS = ("dw0", "dw1", "dw2")
BUCKET, SUBJECT, STREAM = "t-partitions", "t.partition.active", "T_PARTITIONS"
CONFIG = TrainerConfig(min_samples=30, min_profiled=10, reduce_dim=0, drift_detection=False)


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1_700_000_000.0
        self.mono_s = 100.0

    def time(self) -> float:
        return self.now_s

    def monotonic(self) -> float:
        return self.mono_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds
        self.mono_s += seconds


class FakeBus:
    """Object store and stream in memory; `fail` makes every call raise BusError."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], bytes] = {}
        self.published: list[tuple[str, Message, str | None]] = []
        self.fail = False
        self.corrupt = False

    async def object_put_bytes(self, bucket: str, name: str, data: bytes) -> ObjectRef:
        if self.fail:
            raise BusError("bus down")
        data += b"x" if self.corrupt else b""
        self.objects[(bucket, name)] = data
        return ObjectRef(bucket, name, len(data), hashlib.sha256(data).hexdigest())

    async def js_publish(
        self,
        subject: str,
        message: Message,
        *,
        msg_id: str | None = None,
        timeout_s: float | None = None,
    ) -> PublishAck:
        if self.fail:
            raise BusError("bus down")
        self.published.append((subject, message, msg_id))
        return PublishAck(STREAM, len(self.published), duplicate=False)

    async def get_last(self, stream: str, subject: str, message_type: type[M]) -> M | None:
        if self.fail:
            raise BusError("bus down")
        for subj, message, _ in reversed(self.published):
            if subj == subject and isinstance(message, message_type):
                return message
        return None

    def announced(self) -> list[int]:
        return [m.version for _, m, _ in self.published if isinstance(m, PartitionAnnouncement)]


class Recorder:
    """Every observer call, as (method, args)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def of(self, method: str) -> list[tuple[Any, ...]]:
        return [args for name, args in self.calls if name == method]

    def _record(self, method: str, *args: Any) -> None:
        self.calls.append((method, args))

    def took_input(self, kind: str, outcome: str) -> None:
        self._record("took_input", kind, outcome)

    def window_changed(
        self, with_summary: int, without_summary: int, finished_without_summary: int = 0
    ) -> None:
        self._record("window_changed", with_summary, without_summary)
        self._record("finished_without_summary", finished_without_summary)

    def saw_live_workers(self, count: int) -> None:
        self._record("saw_live_workers", count)

    def refit_ended(self, trigger: str, status: str) -> None:
        self._record("refit_ended", trigger, status)

    def refit_failed(self, stage: str) -> None:
        self._record("refit_failed", stage)

    def fitted(self, seconds: float) -> None:
        self._record("fitted", seconds)

    def shadow_evaluated(self, result: Any) -> None:
        self._record("shadow_evaluated", result)

    def version_rejected(self, version: int) -> None:
        self._record("version_rejected", version)

    def version_promoted(self, version: int, report: Any) -> None:
        self._record("version_promoted", version)

    def found_active(self, version: int) -> None:
        self._record("found_active", version)

    def drift_baseline_set(self, baseline: Any) -> None:
        self._record("drift_baseline_set", baseline)

    def drift_measured(self, best_similarity: float, occupancy_skew: float) -> None:
        self._record("drift_measured", best_similarity, occupancy_skew)

    def drift_verdict(self, drifted: bool) -> None:
        self._record("drift_verdict", drifted)


@dataclasses.dataclass
class Rig:
    trainer: Trainer
    bus: FakeBus
    clock: FakeClock
    observer: Recorder
    database: TrainerDatabase


@pytest.fixture(scope="module")
def migrated_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One migrated database file; tests copy it (migrating each time is slow)."""
    path = tmp_path_factory.mktemp("template") / "eldr.db"
    migrate.upgrade(f"sqlite:///{path}")
    return path


def make_rig(url: str, config: TrainerConfig = CONFIG, *, migrate_on_start: bool = False) -> Rig:
    clock, bus, observer = FakeClock(), FakeBus(), Recorder()
    database = TrainerDatabase(
        url, migrate_on_start=migrate_on_start, connect_timeout_s=1.0, sqlite_timeout_s=5.0
    )
    announcer = PartitionAnnouncer(bus, bucket=BUCKET, subject=SUBJECT, stream=STREAM, clock=clock)
    return Rig(
        Trainer(config, database, announcer, observer, clock), bus, clock, observer, database
    )


@pytest.fixture
def db_url(migrated_db: Path, tmp_path: Path) -> str:
    path = tmp_path / "eldr.db"
    shutil.copy(migrated_db, path)
    return f"sqlite:///{path}"


@pytest.fixture
def rig(db_url: str) -> Iterator[Rig]:
    r = make_rig(db_url)
    yield r
    r.database.close()


def decision(
    rid: str, counts: np.ndarray | None, *, model: str = "m", worker: str = "dw0"
) -> Decision:
    return messages.decision(rid, worker, counts=counts, ts_s=0.0, model=model)


def load(worker: str, running: int = 0, waiting: int = 0) -> LoadReport:
    return LoadReport(
        worker_id=worker,
        incarnation="i0",
        seq=1,
        ts_s=0.0,
        running=running,
        waiting=waiting,
        kv_tokens=0,
        kv_capacity_tokens=1000,
        admitted=[],
    )


def feed(rig: Rig, n: int, *, start: int = 0, seed: int = 0) -> None:
    """n requests with signatures (every other one with a decode summary), and live workers."""
    traces = generate(SPEC, n, np.random.default_rng(seed)).traces
    for i, trace in enumerate(traces):
        rid = f"req-{start + i}"
        prefill = expert_counts(trace.prefill, SPEC.num_experts).astype(np.uint32)
        rig.trainer.add_decision(decision(rid, prefill, worker=WORKERS[i % 3]), rig.clock.now_s)
        if i % 2 == 0:
            decode = expert_counts(trace.decode, SPEC.num_experts).astype(np.uint32)
            profile = DecodeSummary(
                request_id=rid,
                worker_id=WORKERS[i % 3],
                ts_s=0.0,
                tokens=trace.decode_tokens,
                counts=SparseCounts.from_dense(decode),
            )
            rig.trainer.add_summary(profile, rig.clock.now_s)
    for w in WORKERS:
        rig.trainer.add_load(load(w), rig.clock.now_s)


# --- config ------------------------------------------------------------------------------


def test_the_config_has_the_settings_names_and_defaults() -> None:
    settings_fields = TrainerSettings.model_fields
    for f in dataclasses.fields(TrainerConfig):
        assert f.name in settings_fields, f.name
        assert f.default == settings_fields[f.name].default, f.name


def test_the_config_is_read_from_settings() -> None:
    settings = TrainerSettings(min_samples=7, shadow_gate=False, trainer_workers=("a", "b"))
    config = TrainerConfig.from_settings(settings)
    assert (config.min_samples, config.shadow_gate, config.trainer_workers) == (
        7,
        False,
        ("a", "b"),
    )


# --- inputs ------------------------------------------------------------------------------


def test_a_decision_without_a_signature_is_counted_and_ignored(rig: Rig) -> None:
    rig.trainer.add_decision(decision("r1", None), None)
    assert len(rig.trainer.window) == 0
    assert rig.observer.of("took_input") == [("decision", "no_signature")]


def test_decisions_for_another_model_are_ignored_when_the_model_is_fixed(db_url: str) -> None:
    rig = make_rig(db_url, dataclasses.replace(CONFIG, model="m"))
    rig.trainer.add_decision(decision("r1", np.ones((4, 16), np.uint32), model="other"), None)
    assert len(rig.trainer.window) == 0
    assert rig.observer.of("took_input") == [("decision", "other_model")]


def test_a_decision_without_a_timestamp_is_stamped_by_the_clock(rig: Rig) -> None:
    rig.trainer.add_decision(decision("r1", np.ones((4, 16), np.uint32)), None)
    snapshot = rig.trainer.window.snapshot()
    assert snapshot is not None
    assert snapshot.samples[0].ts_s == rig.clock.now_s


def test_load_reports_make_workers_live(rig: Rig) -> None:
    rig.trainer.add_load(load("dw1"), rig.clock.now_s)
    rig.trainer.add_load(load("dw0"), rig.clock.now_s)
    assert rig.trainer.workers(rig.clock.now_s) == ("dw0", "dw1")
    assert rig.trainer.workers(rig.clock.now_s + CONFIG.worker_ttl_s + 1) == ()


def test_a_fixed_worker_list_ignores_load_reports(db_url: str) -> None:
    rig = make_rig(db_url, dataclasses.replace(CONFIG, trainer_workers=("b", "a")))
    rig.trainer.add_load(load("dw0"), rig.clock.now_s)
    assert rig.trainer.workers(rig.clock.now_s) == ("a", "b")


def test_the_shadow_batch_is_the_mean_in_flight_but_at_least_eight(rig: Rig) -> None:
    rig.trainer.add_load(load("dw0", running=20, waiting=4), rig.clock.now_s)
    rig.trainer.add_load(load("dw1", running=2), rig.clock.now_s)
    assert rig.trainer.shadow_batch(("dw0", "dw1")) == 13.0
    assert rig.trainer.shadow_batch(("dw1",)) == 8.0


def test_a_set_shadow_batch_wins_over_load_reports(db_url: str) -> None:
    rig = make_rig(db_url, dataclasses.replace(CONFIG, shadow_batch=3.0))
    rig.trainer.add_load(load("dw0", running=20), rig.clock.now_s)
    assert rig.trainer.shadow_batch(("dw0",)) == 3.0


# --- refits ------------------------------------------------------------------------------


async def test_a_refit_without_live_workers_is_skipped(rig: Rig) -> None:
    reply = await rig.trainer.refit("test", None, trigger="request")
    assert reply.status == "skipped"
    assert "no live decode workers" in reply.message
    assert rig.observer.of("refit_ended") == [("request", "skipped")]


async def test_a_refit_with_too_few_requests_is_skipped(rig: Rig) -> None:
    feed(rig, 10)
    reply = await rig.trainer.refit("test", None, trigger="request")
    assert reply.status == "skipped"
    assert reply.message == "10 request(s) in the window, a refit needs 30"


async def test_the_first_refit_stores_and_announces_version_1(rig: Rig) -> None:
    feed(rig, 60)
    reply = await rig.trainer.refit("test", None, trigger="request")
    assert reply.status == "ok", reply.message
    assert reply.version == 1
    assert "no active version" in reply.message
    assert rig.bus.announced() == [1]
    assert rig.bus.published[0][2] == "partition-v1"
    assert (BUCKET, "v1") in rig.bus.objects
    assert rig.observer.of("version_promoted") == [(1,)]
    assert rig.trainer.active is not None
    assert rig.trainer.active.workers == WORKERS


async def test_a_scheduled_refit_without_new_requests_is_skipped(rig: Rig) -> None:
    feed(rig, 60)
    assert (await rig.trainer.refit("first", None, trigger="schedule")).status == "ok"
    reply = await rig.trainer.refit("again", None, trigger="schedule")
    assert reply.status == "skipped"
    assert reply.message == "no new requests in the window since the last fit"


async def test_a_gated_refit_without_enough_held_out_requests_is_rejected(db_url: str) -> None:
    rig = make_rig(db_url, dataclasses.replace(CONFIG, shadow_min_requests=10_000))
    feed(rig, 60)
    assert (await rig.trainer.refit("first", None, trigger="request")).status == "ok"
    feed(rig, 20, start=60, seed=1)
    reply = await rig.trainer.refit("second", None, trigger="schedule")
    assert reply.status == "rejected", reply.message
    assert "a shadow evaluation needs 10000" in reply.message
    assert "version 1 stays active" in reply.message
    assert rig.observer.of("version_rejected") == [(2,)]
    assert rig.bus.announced() == [1]


async def test_an_unannounced_version_is_announced_by_the_next_refit(rig: Rig) -> None:
    feed(rig, 60)
    rig.bus.fail = True
    reply = await rig.trainer.refit("first", None, trigger="request")
    assert reply.status == "error"
    assert "stored and active but could not be announced" in reply.message
    assert rig.observer.of("refit_failed") == [("publish",)]
    rig.bus.fail = False
    await rig.trainer.refit("too few workers", 5, trigger="request")  # skipped after announcing
    assert rig.bus.announced() == [1]
    assert rig.trainer.announcer.pending is None


async def test_a_blob_whose_hash_differs_is_not_announced_nor_retried(rig: Rig) -> None:
    feed(rig, 60)
    rig.bus.corrupt = True
    reply = await rig.trainer.refit("first", None, trigger="request")
    assert reply.status == "error"
    assert "hashes to" in reply.message
    assert rig.bus.announced() == []
    assert rig.trainer.announcer.pending is None


async def test_an_unreachable_database_fails_the_refit_at_the_database_stage(
    tmp_path: Path,
) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    rig = make_rig(f"sqlite:///{not_a_dir / 'eldr.db'}", migrate_on_start=True)
    feed(rig, 60)
    reply = await rig.trainer.refit("test", None, trigger="request")
    assert reply.status == "error"
    assert reply.message.startswith("database sqlite:///")
    assert rig.observer.of("refit_failed") == [("database",)]


async def test_the_database_is_migrated_on_first_use(tmp_path: Path) -> None:
    rig = make_rig(f"sqlite:///{tmp_path / 'fresh.db'}", migrate_on_start=True)
    assert not rig.database.ready
    feed(rig, 60)
    assert (await rig.trainer.refit("test", None, trigger="request")).status == "ok"
    assert rig.database.ready
    rig.database.close()


# --- gate --------------------------------------------------------------------------------


async def test_which_refits_skip_the_shadow_gate(rig: Rig) -> None:
    feed(rig, 60)
    await rig.trainer.refit("first", None, trigger="request")
    active = rig.trainer.active
    assert active is not None
    config = rig.trainer.config
    assert ungated_because(None, WORKERS, "schedule", config) == "no active version"
    assert ungated_because(active, ("dw0", "dw1", "dw9"), "schedule", config) == (
        "the workers differ from version 1's (joined: dw9; left: dw2)"
    )
    assert ungated_because(active, WORKERS, "request", config) == "an operator asked for it"
    assert ungated_because(active, WORKERS, "schedule", config) == ""


# --- schedule ----------------------------------------------------------------------------


def test_a_scheduled_refit_is_due_after_the_interval(rig: Rig) -> None:
    rig.trainer.restart_schedule()
    rig.clock.advance(CONFIG.refit_interval_s - 1)
    assert rig.trainer.due() is None
    rig.clock.advance(1)
    assert rig.trainer.due() == ("schedule", "scheduled")


async def test_a_churn_refit_names_who_joined_and_left(db_url: str) -> None:
    rig = make_rig(db_url, dataclasses.replace(CONFIG, refit_interval_s=0))
    feed(rig, 60)
    await rig.trainer.refit("first", None, trigger="request")
    rig.trainer.restart_schedule()
    rig.clock.advance(CONFIG.worker_ttl_s - 1)
    for w in ("dw0", "dw1", "dw3"):
        rig.trainer.add_load(load(w), rig.clock.now_s)
    rig.clock.advance(2)  # dw2's report is now older than the TTL
    assert rig.trainer.due() is None  # the new set has not settled yet
    rig.clock.advance(CONFIG.churn_settle_s)
    for w in ("dw0", "dw1", "dw3"):
        rig.trainer.add_load(load(w), rig.clock.now_s)
    assert rig.trainer.due() == ("churn", "worker set changed: joined dw3, left dw2")


# --- start -------------------------------------------------------------------------------


async def test_at_start_the_active_version_is_found_and_an_unannounced_one_announced(
    db_url: str,
) -> None:
    first = make_rig(db_url)
    feed(first, 60)
    first.bus.fail = True
    assert (await first.trainer.refit("crashed", None, trigger="request")).status == "error"
    first.database.close()

    restarted = make_rig(db_url)
    restarted.trainer.load_active_version()
    assert restarted.observer.of("found_active") == [(1,)]
    assert restarted.trainer.active is not None
    await restarted.trainer.reconcile_announcement()
    assert restarted.bus.announced() == [1]
    restarted.database.close()


async def test_at_start_an_announced_version_is_not_announced_again(rig: Rig) -> None:
    feed(rig, 60)
    await rig.trainer.refit("first", None, trigger="request")
    await rig.trainer.reconcile_announcement()
    assert rig.bus.announced() == [1]


async def test_a_fit_past_its_time_limit_is_abandoned_and_nothing_stored(db_url: str) -> None:
    rig = make_rig(db_url, dataclasses.replace(CONFIG, fit_timeout_s=1e-9))
    try:
        feed(rig, 60)
        reply = await rig.trainer.refit("test", None, trigger="request")
    finally:
        rig.database.close()
    assert reply.status == "error"
    assert "fit_timeout_s=1e-09" in reply.message
    assert rig.observer.of("refit_failed") == [("fit",)]
    assert rig.bus.announced() == []


async def test_a_refit_asked_for_during_another_is_answered_at_once(rig: Rig) -> None:
    feed(rig, 60)
    gate = threading.Event()
    real = rig.trainer._fit_and_store

    def slow(*args: Any) -> Any:
        gate.wait(10)
        return real(*args)

    rig.trainer._fit_and_store = slow  # type: ignore[method-assign]
    first = asyncio.create_task(rig.trainer.refit("first", None, trigger="request"))
    await asyncio.sleep(0.05)
    busy = await rig.trainer.refit("second", None, trigger="request")
    gate.set()
    assert (await first).status == "ok"
    assert busy.status == "skipped"
    assert "a refit (request) is under way" in busy.message


async def test_a_cancelled_trainer_abandons_its_fit(rig: Rig) -> None:
    feed(rig, 60)
    rig.trainer.cancel_fit()
    reply = await rig.trainer.refit("test", None, trigger="request")
    assert reply.status == "skipped"
    assert reply.message == "the trainer is stopping"
