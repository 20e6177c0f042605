"""Partition-version store against real databases: SQLite (a temp file) and PostgreSQL.

PostgreSQL tests use the session's throwaway database (`pg_url`, tests/integration/
conftest.py), with the schema emptied before each test.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import io
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import sqlalchemy as sa
from sqlalchemy import create_engine, inspect, select, text, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import NullPool

from eldr.core.partition.partition import Partition
from eldr.core.signature.signature import Calibration
from eldr.partitions import writer as partition_writer
from eldr.partitions.codec import partition_from_blob
from eldr.partitions.writer import blob_for_version
from eldr.store import migrate, repo
from eldr.store.cli import register
from eldr.store.models import (
    ImmutableVersionError,
    PartitionStatus,
    PartitionVersion,
    UtcDateTime,
)
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


def make_partition(
    model: str = "olmoe-1b-7b",
    *,
    seed: int = 7,
    num_centroids: int = 6,
    k: int = 3,
    idf: bool = True,
) -> Partition:
    rng = np.random.default_rng(seed)
    num_moe_layers, num_experts = 4, 8
    mask = np.array([True, False, True, True])
    centroids = rng.standard_normal((num_centroids, int(mask.sum()) * num_experts))
    centroids /= np.linalg.norm(centroids, axis=1, keepdims=True)
    return Partition(
        version=0,
        model=model,
        calibration=Calibration(
            num_moe_layers,
            num_experts,
            "idf" if idf else "raw",
            rng.random(num_moe_layers * num_experts).astype(np.float32) if idf else None,
            mask,
        ),
        centroids=centroids.astype(np.float32),
        owners=np.array([i % k for i in range(num_centroids)]),
        workers=tuple(f"decode-{i}" for i in range(k)),
        metrics={"inertia": 1.25, "balance": 1.1},
    )


def make_record(
    model: str = "olmoe-1b-7b",
    *,
    version: int = 1,
    seed: int = 7,
    num_centroids: int = 6,
    k: int = 3,
    optional_arrays: bool = True,
    created_at: datetime | None = None,
    parent_version: int | None = None,
) -> PartitionRecord:
    """A new record whose blob carries `version` (the number its insert must get)."""
    p = make_partition(model, seed=seed, num_centroids=num_centroids, k=k, idf=optional_arrays)
    return PartitionRecord(
        blob_bytes=blob_for_version(p, version).blob_bytes,
        seed=seed,
        n_train=1000 + seed,
        parent_version=parent_version,
        note="first fit",
        created_at=created_at,
    )


def _next_id(session: Session) -> int:
    """The id the next insert gets (what the writer stamps its blob with)."""
    return partition_writer._next_version(session)


def add(session: Session, model: str = "olmoe-1b-7b", **kwargs: Any) -> int:
    """Store a new version the way the writer does: its blob stamped with its number."""
    return repo.create_version(session, make_record(model, version=_next_id(session), **kwargs))


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
            version = add(session)
        migrate.downgrade(db_url, "0001")
        assert "prices" in {c["name"] for c in inspect(engine).get_columns("partition_versions")}
        migrate.upgrade(db_url)
        assert migrate.check(db_url) == []
        with sessions() as session:
            stored = repo.get(session, version)
        assert (stored.num_centroids, stored.dim) == (6, 24)
    finally:
        engine.dispose()


# --- 0003: the blob becomes the one stored content of a version -------------------------

# partition_versions at revision 0002, to write rows as the code of that time did.
V0002 = sa.table(
    "partition_versions",
    sa.column("id", sa.Integer()),
    sa.column("created_at", UtcDateTime()),
    sa.column("model", sa.String()),
    sa.column("status", sa.String()),
    sa.column("k", sa.Integer()),
    sa.column("num_centroids", sa.Integer()),
    sa.column("dim", sa.Integer()),
    sa.column("transform", sa.String()),
    sa.column("num_moe_layers", sa.Integer()),
    sa.column("num_experts", sa.Integer()),
    sa.column("seed", sa.BigInteger()),
    sa.column("n_train", sa.Integer()),
    sa.column("centroids", sa.LargeBinary()),
    sa.column("owners", sa.JSON()),
    sa.column("workers", sa.JSON()),
    sa.column("idf", sa.LargeBinary()),
    sa.column("layer_mask", sa.LargeBinary()),
    sa.column("metrics", sa.JSON()),
    sa.column("parent_version", sa.Integer()),
    sa.column("note", sa.Text()),
    sa.column("blob_sha256", sa.String()),
)
GOLDEN_BLOB_V1 = REPO_ROOT / "tests" / "unit" / "wire" / "golden" / "partition_blob.v1.msgpack"


def _npy(array: np.ndarray) -> bytes:
    """An array as revision 0002's repository stored it (`.npy`, little-endian)."""
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")))
    return buffer.getvalue()


def _v1_blob(v2_bytes: bytes) -> bytes:
    """The PartitionBlob v1 of the same content: the field order of the v1 golden file,
    `prices` nil, `v` 1 (what a version stored before v2 was announced with)."""
    fields = msgspec.msgpack.decode(v2_bytes)
    v1_order = msgspec.msgpack.decode(GOLDEN_BLOB_V1.read_bytes())
    return msgspec.msgpack.encode({k: 1 if k == "v" else fields.get(k) for k in v1_order})


@dataclasses.dataclass
class OldVersion:
    """A version written at revision 0002: its partition, its columns, its announced blob."""

    partition: Partition
    columns: dict[str, Any]
    blob_bytes: bytes


def _write_0002_versions(url: str) -> dict[int, OldVersion]:
    """Migrate to 0002 and store versions 1..4 the way the writer did then (columns, and
    the SHA-256 of the blob it announced), then delete version 4 (the top one): 1 idf,
    2 raw (no idf), 3 stored before PartitionBlob v2 (its row holds the v1 hash)."""
    migrate.upgrade(url, "0002")
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    specs = [
        (make_partition(seed=1, num_centroids=7), "retired", None),
        (make_partition(seed=2, idf=False, k=2), "retired", 1),
        (make_partition(seed=3), "active", 2),
        (make_partition(seed=4), "rejected", 3),
    ]
    versions: dict[int, OldVersion] = {}
    engine = repo.make_engine(url, poolclass=NullPool)
    try:
        with engine.begin() as connection:
            for number, (p, status, parent) in enumerate(specs, start=1):
                cal = p.calibration
                blob = blob_for_version(p, number).blob_bytes
                if number == 3:
                    blob = _v1_blob(blob)
                columns: dict[str, Any] = {
                    "created_at": t0 + timedelta(minutes=number),
                    "model": p.model,
                    "status": status,
                    "k": p.k,
                    "num_centroids": p.centroids.shape[0],
                    "dim": p.centroids.shape[1],
                    "transform": cal.transform,
                    "num_moe_layers": cal.num_moe_layers,
                    "num_experts": cal.num_experts,
                    "seed": number * 1_000_003,
                    "n_train": 100 + number,
                    "centroids": _npy(p.centroids),
                    "owners": [int(o) for o in p.owners],
                    "workers": list(p.workers),
                    "idf": None if cal.idf is None else _npy(np.asarray(cal.idf, np.float32)),
                    "layer_mask": _npy(np.asarray(cal.layer_mask, dtype=bool)),
                    "metrics": dict(p.metrics),
                    "parent_version": parent,
                    "note": f"fit {number}",
                    "blob_sha256": hashlib.sha256(blob).hexdigest(),
                }
                insert = sa.insert(V0002).values(**columns).returning(V0002.c.id)
                assert connection.execute(insert).scalar_one() == number
                versions[number] = OldVersion(p, {"id": number, **columns}, blob)
            connection.execute(sa.delete(V0002).where(V0002.c.id == 4))
    finally:
        engine.dispose()
    del versions[4]
    return versions


def _rows_0002(url: str) -> list[dict[str, Any]]:
    engine = repo.make_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as connection:
            rows = connection.execute(sa.select(V0002).order_by(V0002.c.id))
            return [dict(row._mapping) for row in rows]
    finally:
        engine.dispose()


def test_0003_stores_each_version_the_blob_it_was_announced_with(db_url: str) -> None:
    versions = _write_0002_versions(db_url)
    migrate.upgrade(db_url)
    assert migrate.check(db_url) == []
    engine = repo.make_engine(db_url, poolclass=NullPool)
    sessions = repo.make_session_factory(engine)
    try:
        columns = {c["name"] for c in inspect(engine).get_columns("partition_versions")}
        assert columns.isdisjoint(
            {"transform", "centroids", "owners", "workers", "idf", "layer_mask", "metrics"}
        )
        with sessions() as session:
            for number, old in versions.items():
                record = repo.get(session, number)
                # The exact bytes announced, so the same hash as before.
                assert record.blob_bytes == old.blob_bytes, number
                assert record.blob_sha256 == old.columns["blob_sha256"], number
                assert record.blob.v == (1 if number == 3 else 2)
                assert record.blob.version == number
                for name in ("status", "note", "seed", "n_train", "parent_version"):
                    assert getattr(record, name) == old.columns[name], (number, name)
                assert record.created_at == old.columns["created_at"]
                back, p = partition_from_blob(record.blob), old.partition
                assert (back.model, back.workers) == (p.model, p.workers)
                np.testing.assert_array_equal(back.centroids, p.centroids)
                np.testing.assert_array_equal(back.owners, p.owners)
                assert back.calibration.transform == p.calibration.transform
                np.testing.assert_array_equal(back.calibration.layer_mask, p.calibration.layer_mask)
                if p.calibration.idf is None:
                    assert back.calibration.idf is None
                else:
                    assert back.calibration.idf is not None
                    np.testing.assert_array_equal(back.calibration.idf, p.calibration.idf)
                assert back.metrics == p.metrics
        # The next version gets the next number, never the deleted 4's (AUTOINCREMENT kept
        # through SQLite's table rebuild), and retires the active one.
        stored = partition_writer.write_active_version(
            sessions,
            make_partition(seed=5),
            seed=5,
            n_train=10,
            parent_version=3,
            note="after 0003",
            lock_timeout_s=5,
        )
        assert (stored.version, stored.retired) == (5, 3)
        with sessions() as session:
            assert repo.get(session, 5).blob_bytes == stored.blob_bytes
    finally:
        engine.dispose()


def test_0003_downgrade_restores_the_columns_as_they_were(db_url: str) -> None:
    versions = _write_0002_versions(db_url)
    before = _rows_0002(db_url)
    assert [row["id"] for row in before] == sorted(versions)
    migrate.upgrade(db_url)
    migrate.downgrade(db_url, "0002")
    assert migrate.current_revision(db_url) == "0002"
    assert _rows_0002(db_url) == before
    # And up again: the same blobs.
    migrate.upgrade(db_url)
    engine = repo.make_engine(db_url, poolclass=NullPool)
    try:
        with repo.make_session_factory(engine)() as session:
            for number, old in versions.items():
                assert repo.get(session, number).blob_bytes == old.blob_bytes
    finally:
        engine.dispose()


def test_0003_refuses_rows_whose_announced_blob_it_cannot_reproduce(db_url: str) -> None:
    versions = _write_0002_versions(db_url)
    engine = repo.make_engine(db_url, poolclass=NullPool)
    with engine.begin() as connection:
        connection.execute(sa.update(V0002).where(V0002.c.id == 2).values(blob_sha256="0" * 64))
    engine.dispose()
    before = _rows_0002(db_url)
    with pytest.raises(RuntimeError, match="1 partition version") as failure:
        migrate.upgrade(db_url)
    assert "version 2: the row says blob_sha256 " + "0" * 64 in str(failure.value)
    assert "nothing was changed" in str(failure.value)
    assert migrate.current_revision(db_url) == "0002"
    assert _rows_0002(db_url) == before
    assert len(before) == len(versions)


# --- round trip -----------------------------------------------------------------------------


def test_round_trip_keeps_the_blob_bytes_and_every_field(sessions: sessionmaker[Session]) -> None:
    record = make_record(version=1)
    with sessions.begin() as session:
        version = repo.create_version(session, record)
    with sessions() as session:
        stored = repo.get(session, version)
    assert stored.version == version == 1
    assert stored.blob_bytes == record.blob_bytes
    assert stored.blob_sha256 == hashlib.sha256(record.blob_bytes).hexdigest()
    assert stored.blob == record.blob
    for name in (
        "model",
        "num_moe_layers",
        "num_experts",
        "seed",
        "n_train",
        "note",
        "parent_version",
        "k",
        "num_centroids",
        "dim",
    ):
        assert getattr(stored, name) == getattr(record, name), name
    p = partition_from_blob(stored.blob)
    expected = make_partition()
    np.testing.assert_array_equal(p.centroids, expected.centroids)
    np.testing.assert_array_equal(p.owners, expected.owners)
    assert p.calibration.idf is not None
    np.testing.assert_array_equal(p.calibration.idf, expected.calibration.idf)
    assert p.metrics == expected.metrics


def test_round_trip_without_optional_arrays(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        version = add(session, optional_arrays=False)
    with sessions() as session:
        stored = repo.get(session, version)
    assert stored.blob.idf is None


def test_a_blob_of_another_version_is_refused_and_leaves_nothing(
    sessions: sessionmaker[Session],
) -> None:
    with sessions.begin() as session:
        first = add(session)
        with pytest.raises(repo.BlobVersionMismatchError, match="carries version 7"):
            repo.create_version(session, make_record(version=7))
        assert [i.version for i in repo.list_versions(session)] == [first]
        # The session goes on: the next insert is stored as usual.
        second = add(session, seed=2)
    with sessions() as session:
        assert [i.version for i in repo.list_versions(session)] == [second, first]


def test_a_stored_blob_that_does_not_hash_as_its_row_says_is_corrupt(
    sessions: sessionmaker[Session],
) -> None:
    with sessions.begin() as session:
        version = add(session)
        add(session, seed=2)
    with sessions.begin() as session:
        other = session.scalar(select(PartitionVersion.blob).where(PartitionVersion.id == 2))
        session.execute(text("UPDATE partition_versions SET blob = :b WHERE id = 1"), {"b": other})
    with sessions() as session, pytest.raises(repo.CorruptVersionError, match="hashes to"):
        repo.get(session, version)


def test_a_row_that_disagrees_with_its_blob_is_corrupt(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        version = add(session)
    with sessions.begin() as session:
        session.execute(text("UPDATE partition_versions SET k = 9 WHERE id = :id"), {"id": version})
    with sessions() as session, pytest.raises(repo.CorruptVersionError, match="k=3"):
        repo.get(session, version)


def test_new_version_is_a_candidate_stamped_in_utc(sessions: sessionmaker[Session]) -> None:
    before = datetime.now(UTC)
    with sessions.begin() as session:
        version = add(session)
    with sessions() as session:
        stored = repo.get(session, version)
    assert stored.status is PartitionStatus.CANDIDATE
    assert stored.created_at is not None
    assert stored.created_at.utcoffset() == timedelta(0)
    assert before - timedelta(seconds=1) <= stored.created_at <= datetime.now(UTC)


def test_version_numbers_increase(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        first = add(session, seed=1)
        second = add(session, seed=2)
    assert second > first


def test_get_of_an_unknown_version_raises(sessions: sessionmaker[Session]) -> None:
    with sessions() as session, pytest.raises(repo.VersionNotFoundError):
        repo.get(session, 999)


def test_parent_version_must_exist(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session, pytest.raises(repo.VersionNotFoundError):
        add(session, parent_version=999)


def test_parent_version_is_kept(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        parent = add(session, seed=1)
        child = add(session, seed=2, parent_version=parent)
    with sessions() as session:
        assert repo.get(session, child).parent_version == parent


# --- status changes -------------------------------------------------------------------------


def test_no_active_version_before_the_first_activation(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        add(session)
    with sessions() as session:
        assert repo.get_active(session, "olmoe-1b-7b") is None


def test_activate_then_get_active_round_trips(sessions: sessionmaker[Session]) -> None:
    record = make_record(version=1)
    with sessions.begin() as session:
        version = repo.create_version(session, record)
        assert repo.activate(session, version) is None
    with sessions() as session:
        active = repo.get_active(session, record.model)
    assert active is not None
    assert active.version == version
    assert active.status is PartitionStatus.ACTIVE
    assert active.blob_bytes == record.blob_bytes


def test_activating_a_second_version_retires_the_first(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        first = add(session, seed=1)
        repo.activate(session, first)
    with sessions.begin() as session:
        second = add(session, seed=2, parent_version=first)
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
        other = add(session, "other-model", seed=1)
        repo.activate(session, other)
        mine = add(session, "olmoe-1b-7b", seed=2)
        repo.activate(session, mine)
    assert _status(sessions, other) is PartitionStatus.ACTIVE
    assert _status(sessions, mine) is PartitionStatus.ACTIVE


def test_activating_the_active_version_changes_nothing(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        version = add(session)
        repo.activate(session, version)
    with sessions.begin() as session:
        assert repo.activate(session, version) is None
    assert _status(sessions, version) is PartitionStatus.ACTIVE


def test_a_retired_version_can_be_activated_again(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        first = add(session, seed=1)
        repo.activate(session, first)
        second = add(session, seed=2)
        repo.activate(session, second)
    with sessions.begin() as session:
        assert repo.activate(session, first, note="rollback") == second
    assert _status(sessions, first) is PartitionStatus.ACTIVE
    assert _status(sessions, second) is PartitionStatus.RETIRED


def test_reject_records_the_reason(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        version = add(session)
        repo.reject(session, version, "imbalance 1.8 > 1.2")
    with sessions() as session:
        stored = repo.get(session, version)
    assert stored.status is PartitionStatus.REJECTED
    assert stored.note == "imbalance 1.8 > 1.2"


def test_rejecting_a_candidate_keeps_the_active_version(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        active = add(session, seed=1)
        repo.activate(session, active)
        candidate = add(session, seed=2)
        repo.reject(session, candidate, "worse")
    with sessions() as session:
        current = repo.get_active(session, "olmoe-1b-7b")
    assert current is not None
    assert current.version == active


def test_a_rejected_version_cannot_be_activated(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        version = add(session)
        repo.reject(session, version, "worse")
    with sessions.begin() as session, pytest.raises(repo.InvalidTransitionError):
        repo.activate(session, version)


def test_the_active_version_cannot_be_rejected(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        version = add(session)
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
        first = add(session, seed=1)
        second = add(session, seed=2)
        repo.activate(session, first)
    with sessions.begin() as session, pytest.raises(IntegrityError):
        # Around the repository API, straight to the table.
        session.execute(
            update(PartitionVersion).where(PartitionVersion.id == second).values(status="active")
        )


def test_an_unknown_status_violates_the_check(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        version = add(session)
    with sessions.begin() as session, pytest.raises(IntegrityError):
        session.execute(
            update(PartitionVersion).where(PartitionVersion.id == version).values(status="live")
        )


def test_a_dangling_parent_violates_the_foreign_key(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        version = add(session)
    with sessions.begin() as session, pytest.raises(IntegrityError):
        session.execute(
            text("UPDATE partition_versions SET parent_version = 999 WHERE id = :id"),
            {"id": version},
        )


def test_stored_content_cannot_be_changed_through_the_orm(
    sessions: sessionmaker[Session],
) -> None:
    with sessions.begin() as session:
        version = add(session)
    with sessions() as session:
        row = session.scalars(select(PartitionVersion).where(PartitionVersion.id == version)).one()
        row.blob = b"tampered"
        with pytest.raises(ImmutableVersionError, match="blob"):
            session.flush()


# --- listing --------------------------------------------------------------------------------


def test_list_versions_is_newest_first_and_limited(sessions: sessionmaker[Session]) -> None:
    t0 = datetime(2025, 1, 1, tzinfo=UTC)
    with sessions.begin() as session:
        versions = [add(session, seed=i, created_at=t0 + timedelta(hours=i)) for i in range(4)]
        add(session, "other-model", created_at=t0)
    with sessions() as session:
        listed = repo.list_versions(session, "olmoe-1b-7b", limit=3)
    assert [info.version for info in listed] == versions[::-1][:3]
    assert listed[0].created_at == t0 + timedelta(hours=3)
    assert (listed[0].num_centroids, listed[0].dim, listed[0].k) == (6, 24, 3)


def test_list_versions_without_model_lists_every_model(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        add(session, "a")
        add(session, "b")
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
            v1, v2, v3 = (add(session, seed=i) for i in range(3))
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
        version = add(session)
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


def test_a_stored_record_is_not_stored_again(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        version = add(session)
        stored = repo.get(session, version)
        with pytest.raises(ValueError, match="immutable"):
            repo.create_version(session, stored)
        # A copy still carries its blob, stamped with the old number: refused too.
        copy = dataclasses.replace(
            stored, version=None, status=PartitionStatus.CANDIDATE, created_at=None
        )
        with pytest.raises(repo.BlobVersionMismatchError):
            repo.create_version(session, copy)


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
