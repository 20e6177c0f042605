"""Partition-version store against real databases: SQLite (a temp file) and PostgreSQL.

PostgreSQL tests use the session's throwaway database (`pg_url`, tests/integration/
conftest.py), with the schema emptied before each test.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import create_engine, inspect, select, text, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import NullPool

from eldr.store import migrate, repo
from eldr.store.cli import register
from eldr.store.models import ImmutableVersionError, PartitionStatus, PartitionVersion
from eldr.store.repo import PartitionRecord

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]


def _reset_pg(url: str) -> None:
    engine = create_engine(url, poolclass=NullPool)
    with engine.begin() as connection:
        connection.exec_driver_sql("DROP SCHEMA public CASCADE")
        connection.exec_driver_sql("CREATE SCHEMA public")
    engine.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty database of each kind."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'state' / 'eldr.db'}"
    url: str = request.getfixturevalue("pg_url")
    _reset_pg(url)
    return url


@pytest.fixture
def sessions(db_url: str) -> Iterator[sessionmaker[Session]]:
    """A session factory on a database migrated to head."""
    migrate.upgrade(db_url)
    engine = repo.make_engine(db_url)
    yield repo.make_session_factory(engine)
    engine.dispose()


def make_record(
    model: str = "olmoe-1b-7b",
    *,
    seed: int = 7,
    num_centroids: int = 6,
    k: int = 3,
    dim: int = 16,
    optional_arrays: bool = True,
    created_at: datetime | None = None,
    parent_version: int | None = None,
) -> PartitionRecord:
    rng = np.random.default_rng(seed)
    centroids = rng.standard_normal((num_centroids, dim)).astype(np.float32)
    centroids /= np.linalg.norm(centroids, axis=1, keepdims=True)
    num_moe_layers, num_experts = 4, 8
    return PartitionRecord(
        model=model,
        transform="count_idf",
        num_moe_layers=num_moe_layers,
        num_experts=num_experts,
        seed=seed,
        n_train=1000 + seed,
        centroids=centroids,
        owners=tuple(i % k for i in range(num_centroids)),
        workers=tuple(f"decode-{i}" for i in range(k)),
        layer_mask=np.array([True, False, True, True]),
        blob_sha256=hashlib.sha256(centroids.tobytes()).hexdigest(),
        idf=rng.random((num_moe_layers, num_experts)).astype(np.float32)
        if optional_arrays
        else None,
        metrics={"inertia": 1.25, "cluster_sizes": [334, 333, 333], "balanced": True},
        parent_version=parent_version,
        note="first fit",
        created_at=created_at,
    )


def _status(sessions: sessionmaker[Session], version: int) -> PartitionStatus:
    with sessions() as session:
        return repo.get(session, version).status


# --- migrations -----------------------------------------------------------------------------


def test_upgrade_head_then_check_finds_no_differences(db_url: str) -> None:
    migrate.upgrade(db_url)
    assert migrate.check(db_url) == []


def test_check_reports_an_unmigrated_database(db_url: str) -> None:
    problems = migrate.check(db_url)
    assert any("revision <none>" in p for p in problems)
    assert any("add_table" in p and "partition_versions" in p for p in problems)


def test_check_reports_an_index_missing_from_the_database(db_url: str) -> None:
    migrate.upgrade(db_url)
    engine = repo.make_engine(db_url, poolclass=NullPool)
    with engine.begin() as connection:
        connection.exec_driver_sql("DROP INDEX ix_partition_versions_model_created_at")
    engine.dispose()
    assert any("ix_partition_versions_model_created_at" in p for p in migrate.check(db_url))


def test_downgrade_base_removes_the_table(db_url: str) -> None:
    migrate.upgrade(db_url)
    migrate.downgrade(db_url, "base")
    engine = repo.make_engine(db_url, poolclass=NullPool)
    try:
        assert "partition_versions" not in inspect(engine).get_table_names()
    finally:
        engine.dispose()
    assert migrate.current_revision(db_url) is None


def test_upgrade_after_downgrade_restores_the_schema(db_url: str) -> None:
    migrate.upgrade(db_url)
    migrate.downgrade(db_url, "base")
    migrate.upgrade(db_url)
    assert migrate.check(db_url) == []


def test_the_prices_column_goes_and_comes_back_with_the_rows(db_url: str) -> None:
    """0002 drops the never-written prices column in place: rows stay, on both backends."""
    migrate.upgrade(db_url)
    engine = repo.make_engine(db_url, poolclass=NullPool)
    sessions = repo.make_session_factory(engine)
    try:
        with sessions.begin() as session:
            version = repo.create_version(session, make_record())
        migrate.downgrade(db_url, "0001")
        assert "prices" in {c["name"] for c in inspect(engine).get_columns("partition_versions")}
        migrate.upgrade(db_url)
        assert migrate.check(db_url) == []
        with sessions() as session:
            assert repo.get(session, version).centroids.shape == (6, 16)
    finally:
        engine.dispose()


# --- round trip -----------------------------------------------------------------------------


def test_round_trip_preserves_every_field_and_array(sessions: sessionmaker[Session]) -> None:
    record = make_record()
    with sessions.begin() as session:
        version = repo.create_version(session, record)
    with sessions() as session:
        stored = repo.get(session, version)
    assert stored.version == version
    np.testing.assert_array_equal(stored.centroids, record.centroids)
    assert stored.centroids.dtype == np.float32
    np.testing.assert_array_equal(stored.layer_mask, record.layer_mask)
    assert stored.layer_mask.dtype == np.bool_
    assert stored.idf is not None
    assert record.idf is not None
    np.testing.assert_array_equal(stored.idf, record.idf)
    assert stored.idf.shape == (4, 8)
    for name in (
        "model",
        "transform",
        "num_moe_layers",
        "num_experts",
        "seed",
        "n_train",
        "owners",
        "workers",
        "blob_sha256",
        "note",
        "parent_version",
        "k",
        "num_centroids",
        "dim",
    ):
        assert getattr(stored, name) == getattr(record, name), name
    assert dict(stored.metrics) == dict(record.metrics)


def test_round_trip_without_optional_arrays(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        version = repo.create_version(session, make_record(optional_arrays=False))
    with sessions() as session:
        stored = repo.get(session, version)
    assert stored.idf is None


def test_new_version_is_a_candidate_stamped_in_utc(sessions: sessionmaker[Session]) -> None:
    before = datetime.now(UTC)
    with sessions.begin() as session:
        version = repo.create_version(session, make_record())
    with sessions() as session:
        stored = repo.get(session, version)
    assert stored.status is PartitionStatus.CANDIDATE
    assert stored.created_at is not None
    assert stored.created_at.utcoffset() == timedelta(0)
    assert before - timedelta(seconds=1) <= stored.created_at <= datetime.now(UTC)


def test_version_numbers_increase(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        first = repo.create_version(session, make_record(seed=1))
        second = repo.create_version(session, make_record(seed=2))
    assert second > first


def test_get_of_an_unknown_version_raises(sessions: sessionmaker[Session]) -> None:
    with sessions() as session, pytest.raises(repo.VersionNotFoundError):
        repo.get(session, 999)


def test_parent_version_must_exist(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session, pytest.raises(repo.VersionNotFoundError):
        repo.create_version(session, make_record(parent_version=999))


def test_parent_version_is_kept(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        parent = repo.create_version(session, make_record(seed=1))
        child = repo.create_version(session, make_record(seed=2, parent_version=parent))
    with sessions() as session:
        assert repo.get(session, child).parent_version == parent


# --- status changes -------------------------------------------------------------------------


def test_no_active_version_before_the_first_activation(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        repo.create_version(session, make_record())
    with sessions() as session:
        assert repo.get_active(session, "olmoe-1b-7b") is None


def test_activate_then_get_active_round_trips(sessions: sessionmaker[Session]) -> None:
    record = make_record()
    with sessions.begin() as session:
        version = repo.create_version(session, record)
        assert repo.activate(session, version) is None
    with sessions() as session:
        active = repo.get_active(session, record.model)
    assert active is not None
    assert active.version == version
    assert active.status is PartitionStatus.ACTIVE
    np.testing.assert_array_equal(active.centroids, record.centroids)


def test_activating_a_second_version_retires_the_first(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        first = repo.create_version(session, make_record(seed=1))
        repo.activate(session, first)
    with sessions.begin() as session:
        second = repo.create_version(session, make_record(seed=2, parent_version=first))
        retired = repo.activate(session, second, note="lower inertia")
    assert retired == first
    assert _status(sessions, first) is PartitionStatus.RETIRED
    with sessions() as session:
        active = repo.get_active(session, "olmoe-1b-7b")
    assert active is not None
    assert active.version == second
    assert active.note == "lower inertia"


def test_activation_retires_only_versions_of_the_same_model(
    sessions: sessionmaker[Session],
) -> None:
    with sessions.begin() as session:
        other = repo.create_version(session, make_record("other-model", seed=1))
        repo.activate(session, other)
        mine = repo.create_version(session, make_record("olmoe-1b-7b", seed=2))
        repo.activate(session, mine)
    assert _status(sessions, other) is PartitionStatus.ACTIVE
    assert _status(sessions, mine) is PartitionStatus.ACTIVE


def test_activating_the_active_version_changes_nothing(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        version = repo.create_version(session, make_record())
        repo.activate(session, version)
    with sessions.begin() as session:
        assert repo.activate(session, version) is None
    assert _status(sessions, version) is PartitionStatus.ACTIVE


def test_a_retired_version_can_be_activated_again(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        first = repo.create_version(session, make_record(seed=1))
        repo.activate(session, first)
        second = repo.create_version(session, make_record(seed=2))
        repo.activate(session, second)
    with sessions.begin() as session:
        assert repo.activate(session, first, note="rollback") == second
    assert _status(sessions, first) is PartitionStatus.ACTIVE
    assert _status(sessions, second) is PartitionStatus.RETIRED


def test_reject_records_the_reason(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        version = repo.create_version(session, make_record())
        repo.reject(session, version, "imbalance 1.8 > 1.2")
    with sessions() as session:
        stored = repo.get(session, version)
    assert stored.status is PartitionStatus.REJECTED
    assert stored.note == "imbalance 1.8 > 1.2"


def test_rejecting_a_candidate_keeps_the_active_version(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        active = repo.create_version(session, make_record(seed=1))
        repo.activate(session, active)
        candidate = repo.create_version(session, make_record(seed=2))
        repo.reject(session, candidate, "worse")
    with sessions() as session:
        current = repo.get_active(session, "olmoe-1b-7b")
    assert current is not None
    assert current.version == active


def test_a_rejected_version_cannot_be_activated(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        version = repo.create_version(session, make_record())
        repo.reject(session, version, "worse")
    with sessions.begin() as session, pytest.raises(repo.InvalidTransitionError):
        repo.activate(session, version)


def test_the_active_version_cannot_be_rejected(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        version = repo.create_version(session, make_record())
        repo.activate(session, version)
    with sessions.begin() as session, pytest.raises(repo.InvalidTransitionError):
        repo.reject(session, version, "too late")
    assert _status(sessions, version) is PartitionStatus.ACTIVE


def test_activate_of_an_unknown_version_raises(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session, pytest.raises(repo.VersionNotFoundError):
        repo.activate(session, 999)


# --- constraints ----------------------------------------------------------------------------


def test_two_active_versions_of_one_model_violate_the_index(
    sessions: sessionmaker[Session],
) -> None:
    with sessions.begin() as session:
        first = repo.create_version(session, make_record(seed=1))
        second = repo.create_version(session, make_record(seed=2))
        repo.activate(session, first)
    with sessions.begin() as session, pytest.raises(IntegrityError):
        # Around the repository API, straight to the table.
        session.execute(
            update(PartitionVersion).where(PartitionVersion.id == second).values(status="active")
        )


def test_an_unknown_status_violates_the_check(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        version = repo.create_version(session, make_record())
    with sessions.begin() as session, pytest.raises(IntegrityError):
        session.execute(
            update(PartitionVersion).where(PartitionVersion.id == version).values(status="live")
        )


def test_a_dangling_parent_violates_the_foreign_key(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        version = repo.create_version(session, make_record())
    with sessions.begin() as session, pytest.raises(IntegrityError):
        session.execute(
            text("UPDATE partition_versions SET parent_version = 999 WHERE id = :id"),
            {"id": version},
        )


def test_stored_content_cannot_be_changed_through_the_orm(
    sessions: sessionmaker[Session],
) -> None:
    with sessions.begin() as session:
        version = repo.create_version(session, make_record())
    with sessions() as session:
        row = session.scalars(select(PartitionVersion).where(PartitionVersion.id == version)).one()
        row.centroids = b"tampered"
        with pytest.raises(ImmutableVersionError, match="centroids"):
            session.flush()


# --- listing --------------------------------------------------------------------------------


def test_list_versions_is_newest_first_and_limited(sessions: sessionmaker[Session]) -> None:
    t0 = datetime(2025, 1, 1, tzinfo=UTC)
    with sessions.begin() as session:
        versions = [
            repo.create_version(session, make_record(seed=i, created_at=t0 + timedelta(hours=i)))
            for i in range(4)
        ]
        repo.create_version(session, make_record("other-model", created_at=t0))
    with sessions() as session:
        listed = repo.list_versions(session, "olmoe-1b-7b", limit=3)
    assert [info.version for info in listed] == versions[::-1][:3]
    assert listed[0].created_at == t0 + timedelta(hours=3)
    assert (listed[0].num_centroids, listed[0].dim, listed[0].k) == (6, 16, 3)


def test_list_versions_without_model_lists_every_model(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        repo.create_version(session, make_record("a"))
        repo.create_version(session, make_record("b"))
    with sessions() as session:
        assert {info.model for info in repo.list_versions(session)} == {"a", "b"}


# --- concurrency (PostgreSQL: real concurrent transactions) ---------------------------------


def _wait_for_a_lock_waiter(url: str, deadline_s: float) -> None:
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as connection:
            deadline = time.monotonic() + deadline_s
            while time.monotonic() < deadline:
                waiting = connection.execute(
                    text(
                        "SELECT count(*) FROM pg_stat_activity"
                        " WHERE datname = current_database() AND wait_event_type = 'Lock'"
                    )
                ).scalar_one()
                connection.rollback()  # a fresh snapshot on the next poll
                if waiting:
                    return
                time.sleep(0.01)
    finally:
        engine.dispose()
    raise AssertionError("the second activation never waited for the first")


def test_concurrent_activations_are_serialised_on_postgres(pg_url: str) -> None:
    _reset_pg(pg_url)
    migrate.upgrade(pg_url)
    engine = repo.make_engine(pg_url)
    sessions = repo.make_session_factory(engine)
    try:
        with sessions.begin() as session:
            v1, v2, v3 = (repo.create_version(session, make_record(seed=i)) for i in range(3))
            repo.activate(session, v1)
        errors: list[BaseException] = []

        def activate_v3() -> None:
            try:
                with sessions.begin() as session:
                    repo.activate(session, v3)
            except BaseException as exc:
                errors.append(exc)

        first = sessions()
        first.begin()
        repo.activate(first, v2)
        racer = threading.Thread(target=activate_v3)
        racer.start()
        _wait_for_a_lock_waiter(pg_url, deadline_s=10)
        first.commit()
        first.close()
        racer.join(timeout=10)
        assert not racer.is_alive()
        assert errors == []
        assert [_status(sessions, v) for v in (v1, v2, v3)] == [
            PartitionStatus.RETIRED,
            PartitionStatus.RETIRED,
            PartitionStatus.ACTIVE,
        ]
    finally:
        engine.dispose()


# --- command line and alembic.ini -----------------------------------------------------------


def _run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="eldr")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return int(args.func(args))


def test_cli_upgrade_check_and_versions(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite:///{tmp_path / 'eldr.db'}"
    assert _run_cli(["db", "upgrade", "--url", url]) == 0
    assert _run_cli(["db", "check", "--url", url]) == 0
    engine = repo.make_engine(url)
    with repo.make_session_factory(engine).begin() as session:
        version = repo.create_version(session, make_record())
        repo.activate(session, version)
    engine.dispose()
    capsys.readouterr()
    assert _run_cli(["db", "versions", "--url", url, "--model", "olmoe-1b-7b"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["version", "model", "status"]
    assert lines[1].split()[:3] == [str(version), "olmoe-1b-7b", "active"]


def test_cli_check_fails_on_an_unmigrated_database(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'eldr.db'}"
    assert _run_cli(["db", "check", "--url", url]) == 1
    assert "add_table" in capsys.readouterr().out


def test_alembic_command_line_follows_the_settings(tmp_path: Path) -> None:
    db_file = tmp_path / "from-settings" / "eldr.db"
    env = dict(os.environ, ELDR_DATABASE_URL=f"sqlite:///{db_file}")
    subprocess.run(
        [sys.executable, "-m", "alembic", "-c", str(REPO_ROOT / "alembic.ini"), "upgrade", "head"],
        cwd=tmp_path,
        env=env,
        check=True,
        capture_output=True,
        timeout=60,
    )
    assert migrate.check(f"sqlite:///{db_file}") == []


def test_record_copy_can_be_stored_as_a_new_version(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        version = repo.create_version(session, make_record())
        stored = repo.get(session, version)
        with pytest.raises(ValueError, match="immutable"):
            repo.create_version(session, stored)
        copy = dataclasses.replace(
            stored, version=None, status=PartitionStatus.CANDIDATE, created_at=None
        )
        assert repo.create_version(session, copy) > version


def test_cli_versions_on_an_unmigrated_database_says_to_upgrade(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'eldr.db'}"
    assert _run_cli(["db", "versions", "--url", url]) == 1
    assert "eldr db upgrade" in capsys.readouterr().err


def test_sqlite_databases_use_wal_and_foreign_keys(tmp_path: Path) -> None:
    engine = repo.make_engine(f"sqlite:///{tmp_path / 'eldr.db'}")
    try:
        with engine.connect() as connection:
            assert connection.exec_driver_sql("PRAGMA journal_mode").scalar_one() == "wal"
            assert connection.exec_driver_sql("PRAGMA foreign_keys").scalar_one() == 1
    finally:
        engine.dispose()
