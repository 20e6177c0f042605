"""The trainer service against a real nats-server and a real database: the window rebuilt
from the streams, refits stored as immutable versions, blob and announcement matching the
database, skips, a database that is down, scheduled refits, `eldr refit`, and the write
lock on PostgreSQL."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from sqlalchemy.pool import NullPool

from eldr.bus import Bus, Topology, apply_topology
from eldr.bus.topology import PARTITIONS, build_topology
from eldr.core.partition.partition import Partition
from eldr.core.signature.signature import Calibration
from eldr.core.workload.synthetic import SyntheticSpec, generate
from eldr.core.workload.trace import expert_counts
from eldr.partitions import writer as partition_writer
from eldr.partitions.writer import write_active_version
from eldr.settings import BusSettings, RetentionSettings
from eldr.store import migrate, repo
from eldr.store.models import PartitionStatus
from eldr.training import cli as trainer_cli
from eldr.wire import (
    DecodeSummary,
    LoadReport,
    PartitionAnnouncement,
    PartitionBlob,
    RefitReply,
    RefitRequest,
    SparseCounts,
)
from eldr_services.trainer.service import setup
from eldr_services.trainer.settings import TrainerSettings
from support import messages
from support.services import running_service

pytestmark = pytest.mark.integration

SPEC = SyntheticSpec(
    num_topics=3,
    num_moe_layers=4,
    num_experts=16,
    top_k=2,
    prompt_len_range=(8, 32),
    decode_len_range=(4, 16),
)
WORKERS = ("dw0", "dw1", "dw2")
REFIT_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def trainer_settings(
    bus_settings: BusSettings, retention: RetentionSettings, database_url: str, **kw: object
) -> TrainerSettings:
    base = bus_settings.model_dump() | retention.model_dump()
    base.update(
        database_url=database_url,
        metrics_port=free_port(),
        refit_interval_s=0.0,
        min_samples=40,
        min_profiled=10,
        database_connect_timeout_s=2.0,
    )
    base.update(kw)
    return TrainerSettings(**base)


def running_trainer(settings: TrainerSettings) -> AbstractAsyncContextManager[None]:
    return running_service("trainer", settings, setup, ready_timeout_s=30, stop_timeout_s=30)


async def publish_traffic(bus: Bus, model: str, n: int, *, start: int = 0, seed: int = 0) -> None:
    """n routed requests with signatures, and a decode summary for every other one."""
    traces = generate(SPEC, n, np.random.default_rng(seed)).traces
    for i, trace in enumerate(traces):
        rid = f"{model}-req-{start + i}"
        prefill = expert_counts(trace.prefill, SPEC.num_experts).astype(np.uint32)
        await bus.js_publish(
            bus.subjects.decision(rid),
            messages.decision(rid, WORKERS[i % len(WORKERS)], counts=prefill, model=model),
        )
        if i % 2 == 0:
            decode = expert_counts(trace.decode, SPEC.num_experts).astype(np.uint32)
            await bus.js_publish(
                bus.subjects.profiles(WORKERS[i % len(WORKERS)]),
                DecodeSummary(
                    request_id=rid,
                    worker_id=WORKERS[i % len(WORKERS)],
                    ts_s=time.time(),
                    tokens=trace.decode_tokens,
                    counts=SparseCounts.from_dense(decode),
                ),
            )


async def report_load(bus: Bus, workers: tuple[str, ...] = WORKERS) -> None:
    for seq, w in enumerate(workers):
        await bus.publish(
            bus.subjects.load(w),
            LoadReport(
                worker_id=w,
                incarnation="inc",
                seq=seq,
                ts_s=time.time(),
                running=0,
                waiting=0,
                kv_tokens=0,
                kv_capacity_tokens=1000,
                admitted=[],
            ),
        )
    await bus.flush()


async def refit(bus: Bus, reason: str = "test", k: int | None = None) -> RefitReply:
    return await bus.request(
        bus.subjects.trainer_refit,
        RefitRequest(reason=reason, k=k),
        RefitReply,
        timeout_s=REFIT_TIMEOUT_S,
    )


async def metric(settings: TrainerSettings, name: str, **labels: str) -> float:
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{settings.metrics_port}/metrics") as response,
    ):
        text = await response.text()
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    pattern = re.escape(name) + (r"\{" + re.escape(want) + r"\}" if want else "") + r" (\S+)"
    found = re.search(r"^" + pattern + r"$", text, re.MULTILINE)
    assert found is not None, f"{name}{{{want}}} not in /metrics"
    return float(found.group(1))


async def wait_for_metric(
    settings: TrainerSettings, value: float, name: str, **labels: str
) -> None:
    deadline = time.monotonic() + 10
    while await metric(settings, name, **labels) != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        await asyncio.sleep(0.05)


async def last_announcement(bus: Bus) -> PartitionAnnouncement | None:
    topo = build_topology(bus.subjects.namespace, RetentionSettings())
    return await bus.get_last(
        topo.stream_name(PARTITIONS), bus.subjects.partition_active, PartitionAnnouncement
    )


@pytest.fixture
async def bus(bus_factory: Callable[..., Awaitable[Bus]], topology: Topology) -> Bus:
    """A bus on this test's namespace with its streams in place (traffic is published
    before the trainer starts, which would otherwise create them)."""
    bus = await bus_factory("test")
    await apply_topology(bus, topology)
    return bus


@pytest.fixture(params=["postgresql", "sqlite"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'eldr.db'}"
    return str(request.getfixturevalue("pg_url"))


async def test_refits_store_publish_and_announce_new_versions(
    bus: Bus,
    bus_settings: BusSettings,
    retention: RetentionSettings,
    database_url: str,
    namespace: str,
) -> None:
    model = f"model-{namespace}"
    await publish_traffic(bus, model, 60)  # before start: the window is rebuilt by replay
    await report_load(bus)
    settings = trainer_settings(bus_settings, retention, database_url)
    async with running_trainer(settings):
        await wait_for_metric(settings, 30, "eldr_trainer_window_samples", profile="with")
        first = await refit(bus, "first")
        assert first.status == "ok", first.message
        assert first.version is not None

        engine = repo.make_engine(database_url, poolclass=NullPool)
        try:
            with repo.make_session_factory(engine)() as session:
                record = repo.get_active(session, model)
            assert record is not None
            assert record.version == first.version
            assert tuple(record.blob.workers) == WORKERS
            assert record.n_train == 60
            bucket = build_topology(namespace, retention).partitions_bucket
            blob = await bus.object_get(
                bucket, f"v{first.version}", PartitionBlob, expected_sha256=record.blob_sha256
            )
            assert blob.version == first.version
            # The object store holds the very bytes the database stores.
            assert await bus.object_get_bytes(bucket, f"v{first.version}") == record.blob_bytes
            announced = await last_announcement(bus)
            assert announced is not None
            assert (announced.version, announced.model, announced.sha256) == (
                first.version,
                model,
                record.blob_sha256,
            )
            assert announced.object_name == f"v{first.version}"

            await publish_traffic(bus, model, 30, start=60, seed=1)  # live, after start
            await wait_for_metric(settings, 45, "eldr_trainer_window_samples", profile="with")
            second = await refit(bus, "second")
            assert second.status == "ok", second.message
            assert second.version == first.version + 1
            with repo.make_session_factory(engine)() as session:
                assert repo.get(session, first.version).status is PartitionStatus.RETIRED
                newer = repo.get(session, second.version)
            assert newer.status is PartitionStatus.ACTIVE
            assert newer.parent_version == first.version
            assert newer.n_train == 90
            assert newer.note == "second: promoted without a shadow gate: an operator asked for it"
            assert "moved_share" in newer.blob.metrics
        finally:
            engine.dispose()
        announced = await last_announcement(bus)
        assert announced is not None
        assert announced.version == second.version
        assert await metric(settings, "eldr_trainer_active_version") == second.version
        assert (
            await metric(settings, "eldr_trainer_refits_total", outcome="ok", trigger="request")
            == 2
        )
        assert await metric(settings, "eldr_trainer_fit_duration_seconds_count") == 2


async def test_too_few_samples_skip_with_the_reason(
    bus: Bus, bus_settings: BusSettings, retention: RetentionSettings, tmp_path: Path
) -> None:
    await publish_traffic(bus, "m", 10)
    await report_load(bus)
    settings = trainer_settings(bus_settings, retention, f"sqlite:///{tmp_path / 'eldr.db'}")
    async with running_trainer(settings):
        reply = await refit(bus)
        assert (reply.status, reply.version) == ("skipped", None)
        assert "10 request(s)" in reply.message
        assert "needs 40" in reply.message
        assert (
            await metric(
                settings, "eldr_trainer_refits_total", outcome="skipped", trigger="request"
            )
            == 1
        )
    assert await last_announcement(bus) is None


async def test_no_live_worker_skips(
    bus: Bus, bus_settings: BusSettings, retention: RetentionSettings, tmp_path: Path
) -> None:
    await publish_traffic(bus, "m", 45)
    settings = trainer_settings(bus_settings, retention, f"sqlite:///{tmp_path / 'eldr.db'}")
    async with running_trainer(settings):
        reply = await refit(bus)
        assert reply.status == "skipped"
        assert "no live decode workers" in reply.message
        await report_load(bus, ("dw0", "dw1"))
        await wait_for_metric(settings, 2, "eldr_trainer_live_workers")
        ok = await refit(bus, k=2)
        assert ok.status == "ok", ok.message
        too_many = await refit(bus, k=3)
        assert too_many.status == "skipped"
        assert "k=3" in too_many.message


async def test_a_database_that_is_down_fails_the_refit_but_not_the_service(
    bus: Bus, bus_settings: BusSettings, retention: RetentionSettings
) -> None:
    await publish_traffic(bus, "m", 45)
    settings = trainer_settings(
        bus_settings,
        retention,
        "postgresql+psycopg://eldr:secret@127.0.0.1:1/nothing",
        trainer_workers=WORKERS,
    )
    async with running_trainer(settings):
        for attempt in (1, 2):
            reply = await refit(bus)
            assert (reply.status, reply.version) == ("error", None)
            assert "unavailable" in reply.message
            assert "secret" not in reply.message
            assert (
                await metric(settings, "eldr_trainer_refit_errors_total", stage="database")
                == attempt
            )
        assert (
            await metric(settings, "eldr_trainer_refits_total", outcome="error", trigger="request")
            == 2
        )
    assert await last_announcement(bus) is None


async def test_scheduled_refits_publish_once_per_new_data(
    bus: Bus, bus_settings: BusSettings, retention: RetentionSettings, tmp_path: Path
) -> None:
    await publish_traffic(bus, "m", 45)
    settings = trainer_settings(
        bus_settings,
        retention,
        f"sqlite:///{tmp_path / 'eldr.db'}",
        refit_interval_s=0.5,
        trainer_workers=WORKERS,
    )
    async with running_trainer(settings):
        await wait_for_metric(
            settings, 1, "eldr_trainer_refits_total", outcome="ok", trigger="schedule"
        )
        await wait_for_metric(
            settings, 1, "eldr_trainer_refits_total", outcome="skipped", trigger="schedule"
        )
        announced = await last_announcement(bus)
        assert announced is not None
        assert announced.workers == list(WORKERS)
        assert (
            await metric(settings, "eldr_trainer_refits_total", outcome="ok", trigger="schedule")
            == 1
        )


async def test_eldr_refit_prints_the_reply(
    bus: Bus,
    bus_settings: BusSettings,
    retention: RetentionSettings,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("ELDR_NATS_URL", bus_settings.nats_url)
    monkeypatch.setenv("ELDR_NAMESPACE", bus_settings.namespace)
    assert await trainer_cli.refit("cli", None, 5.0) == trainer_cli.EXIT_ERROR
    assert "no trainer" in capsys.readouterr().err
    await publish_traffic(bus, "m", 45)
    settings = trainer_settings(
        bus_settings, retention, f"sqlite:///{tmp_path / 'eldr.db'}", trainer_workers=WORKERS
    )
    async with running_trainer(settings):
        assert await trainer_cli.refit("cli", None, REFIT_TIMEOUT_S) == trainer_cli.EXIT_OK
        out = capsys.readouterr().out
        assert "status: ok" in out
        assert "version: 1" in out
        assert await trainer_cli.refit("cli", 5, REFIT_TIMEOUT_S) == trainer_cli.EXIT_SKIPPED


async def test_a_stored_but_unannounced_version_is_announced_at_start(
    bus: Bus, bus_settings: BusSettings, retention: RetentionSettings, tmp_path: Path
) -> None:
    # As after a crash between the commit and the announcement.
    url = f"sqlite:///{tmp_path / 'eldr.db'}"
    migrate.upgrade(url)
    engine = repo.make_engine(url, poolclass=NullPool)
    try:
        stored = write_active_version(
            repo.make_session_factory(engine),
            _tiny_partition(),
            seed=0,
            n_train=3,
            parent_version=None,
            note="crashed before announcing",
            lock_timeout_s=5,
        )
    finally:
        engine.dispose()
    assert await last_announcement(bus) is None
    async with running_trainer(trainer_settings(bus_settings, retention, url)):
        announced = await last_announcement(bus)
    assert announced is not None
    assert (announced.version, announced.sha256) == (stored.version, stored.sha256)


def _tiny_partition() -> Partition:
    L, E = SPEC.num_moe_layers, SPEC.num_experts
    return Partition(
        version=1,
        model="m",
        calibration=Calibration(L, E, "raw", None, np.ones(L, dtype=bool)),
        centroids=np.eye(len(WORKERS), L * E, dtype=np.float32),
        owners=np.arange(len(WORKERS)),
        workers=WORKERS,
    )


def test_postgres_writers_take_turns_and_numbers_match_blobs(pg_url: str, namespace: str) -> None:
    migrate.upgrade(pg_url)
    engine = repo.make_engine(pg_url)
    sessions = repo.make_session_factory(engine)
    model = f"model-{namespace}"
    partition = dataclasses.replace(_tiny_partition(), model=model)
    try:
        holder = sessions()
        holder.begin()
        partition_writer.take_write_lock(holder, timeout_s=5)
        with pytest.raises(partition_writer.WriteLockTimeoutError):
            write_active_version(
                sessions,
                partition,
                seed=0,
                n_train=3,
                parent_version=None,
                note="",
                lock_timeout_s=0.3,
            )
        holder.rollback()
        holder.close()

        stored: list[partition_writer.StoredVersion] = []

        def writer() -> None:
            stored.append(
                write_active_version(
                    sessions,
                    partition,
                    seed=0,
                    n_train=3,
                    parent_version=None,
                    note="",
                    lock_timeout_s=20,
                )
            )

        threads = [threading.Thread(target=writer) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        versions = sorted(s.version for s in stored)
        assert versions == list(range(versions[0], versions[0] + 4))
        with sessions() as session:
            for s in stored:
                assert s.blob.version == s.version
                assert repo.get(session, s.version).blob_sha256 == s.sha256
            active = repo.get_active(session, model)
        assert active is not None
        assert active.version == versions[-1]
    finally:
        engine.dispose()


async def test_a_candidate_the_shadow_gate_turns_down_is_stored_rejected_and_not_used(
    bus: Bus,
    bus_settings: BusSettings,
    retention: RetentionSettings,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    database_url = f"sqlite:///{tmp_path / 'eldr.db'}"
    await publish_traffic(bus, "m", 80)
    settings = trainer_settings(
        bus_settings,
        retention,
        database_url,
        trainer_workers=WORKERS,
        shadow_gate_requests=True,
        shadow_min_requests=4,
        shadow_min_gain=0.99,  # no candidate can be 99% better: every gated refit is rejected
        shadow_batch=4.0,
    )
    async with running_trainer(settings):
        await wait_for_metric(settings, 40, "eldr_trainer_window_samples", profile="with")
        first = await refit(bus, "first")
        assert first.status == "ok", first.message
        assert "no active version" in first.message
        second = await refit(bus, "second")
        assert (second.status, second.version) == ("rejected", None)
        assert f"version {first.version} stays active" in second.message
        assert "shadow on" in second.message
        assert (
            await metric(
                settings, "eldr_trainer_refits_total", outcome="rejected", trigger="request"
            )
            == 1
        )
        assert await metric(settings, "eldr_trainer_active_version") == first.version
        assert await metric(settings, "eldr_trainer_last_rejected_version") == first.version + 1
        assert await metric(settings, "eldr_trainer_shadow_union_per_layer", partition="active") > 0
        monkeypatch.setenv("ELDR_NATS_URL", bus_settings.nats_url)
        monkeypatch.setenv("ELDR_NAMESPACE", bus_settings.namespace)
        assert await trainer_cli.refit("cli", None, REFIT_TIMEOUT_S) == trainer_cli.EXIT_REJECTED
    engine = repo.make_engine(database_url, poolclass=NullPool)
    try:
        with repo.make_session_factory(engine)() as session:
            rejected = repo.get(session, first.version + 1)
            third = repo.get(session, first.version + 2)
            active = repo.get_active(session, "m")
    finally:
        engine.dispose()
    assert rejected.status is PartitionStatus.REJECTED
    assert rejected.note.startswith("second: rejected: shadow on")
    assert third.status is PartitionStatus.REJECTED
    assert active is not None
    assert active.version == first.version
    announced = await last_announcement(bus)
    assert announced is not None
    assert announced.version == first.version


async def test_a_worker_joining_triggers_a_refit_for_the_new_worker_set(
    bus: Bus, bus_settings: BusSettings, retention: RetentionSettings, tmp_path: Path
) -> None:
    await publish_traffic(bus, "m", 60)
    await report_load(bus, WORKERS)
    settings = trainer_settings(
        bus_settings,
        retention,
        f"sqlite:///{tmp_path / 'eldr.db'}",
        churn_settle_s=0.2,
    )
    async with running_trainer(settings):
        await wait_for_metric(settings, 3, "eldr_trainer_live_workers")
        first = await refit(bus, "first")
        assert first.status == "ok", first.message
        await report_load(bus, (*WORKERS, "dw3"))
        await wait_for_metric(
            settings, 1, "eldr_trainer_refits_total", outcome="ok", trigger="churn"
        )
        announced = await last_announcement(bus)
        assert announced is not None
        assert announced.version == first.version + 1
        assert announced.workers == [*WORKERS, "dw3"]
