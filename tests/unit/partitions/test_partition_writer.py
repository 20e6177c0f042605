"""Storing a partition as the active version (SQLite file; no sockets)."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy.orm import Session, sessionmaker

from eldr.core.partition.partition import Partition
from eldr.core.signature.signature import Calibration
from eldr.partitions import writer as partition_writer
from eldr.partitions.codec import partition_from_blob
from eldr.partitions.writer import (
    VersionRaceError,
    load_active,
    write_active_version,
)
from eldr.store import migrate, repo
from eldr.store.models import PartitionStatus
from eldr.wire import PartitionBlob, decode


def make_partition(seed: int = 0, model: str = "m") -> Partition:
    rng = np.random.default_rng(seed)
    centroids = rng.random((3, 8)).astype(np.float32)
    centroids /= np.linalg.norm(centroids, axis=1, keepdims=True)
    return Partition(
        version=99,  # ignored by the writer: the database numbers versions
        model=model,
        calibration=Calibration(2, 4, "idf", rng.random(8).astype(np.float32), np.ones(2, bool)),
        centroids=centroids,
        owners=np.array([0, 1, 2]),
        workers=("dw0", "dw1", "dw2"),
        metrics={"inertia": 0.5},
    )


@pytest.fixture
def sessions(tmp_path: Path) -> Iterator[sessionmaker[Session]]:
    url = f"sqlite:///{tmp_path / 'eldr.db'}"
    migrate.upgrade(url)
    engine = repo.make_engine(url, connect_args={"timeout": 10.0})
    yield repo.make_session_factory(engine)
    engine.dispose()


def write(sessions: sessionmaker[Session], p: Partition, parent: int | None = None) -> int:
    return write_active_version(
        sessions, p, seed=1, n_train=10, parent_version=parent, note="test", lock_timeout_s=5
    ).version


def test_the_first_version_is_active_and_its_blob_matches_the_row(
    sessions: sessionmaker[Session],
) -> None:
    stored = write_active_version(
        sessions,
        make_partition(),
        seed=1,
        n_train=10,
        parent_version=None,
        note="first",
        lock_timeout_s=5,
    )
    assert stored.blob.version == stored.version
    assert stored.retired is None
    assert hashlib.sha256(stored.blob_bytes).hexdigest() == stored.sha256
    assert decode(stored.blob_bytes, PartitionBlob) == stored.blob
    with sessions() as session:
        record = repo.get_active(session, "m")
    assert record is not None
    assert (record.version, record.blob_sha256, record.note) == (
        stored.version,
        stored.sha256,
        "first",
    )


def test_a_second_version_retires_the_first(sessions: sessionmaker[Session]) -> None:
    first = write(sessions, make_partition(0))
    stored = write_active_version(
        sessions,
        make_partition(1),
        seed=1,
        n_train=10,
        parent_version=first,
        note="",
        lock_timeout_s=5,
    )
    assert stored.version == first + 1
    assert stored.retired == first
    with sessions() as session:
        assert repo.get(session, first).status is PartitionStatus.RETIRED
        assert repo.get(session, stored.version).parent_version == first


def test_load_active_returns_the_stored_partition(sessions: sessionmaker[Session]) -> None:
    assert load_active(sessions, "m") is None
    p = make_partition()
    stored = write_active_version(
        sessions, p, seed=1, n_train=10, parent_version=None, note="", lock_timeout_s=5
    )
    active = load_active(sessions, "m")
    assert active is not None
    assert active.version == stored.version
    np.testing.assert_array_equal(active.centroids, p.centroids)
    from_blob = partition_from_blob(stored.blob)
    np.testing.assert_array_equal(active.centroids, from_blob.centroids)


def test_a_wrong_version_guess_is_rolled_back_and_retried(
    sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = partition_writer._next_version
    guesses = iter([42])

    def guess(session: Session) -> int:
        return next(guesses, None) or real(session)

    monkeypatch.setattr(partition_writer, "_next_version", guess)
    version = write(sessions, make_partition())
    with sessions() as session:
        listed = repo.list_versions(session)
    # The first insert (which got the number the blob did not carry) left no trace.
    assert [i.version for i in listed] == [version]
    assert listed[0].status is PartitionStatus.ACTIVE


def test_a_version_race_that_persists_commits_nothing(
    sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(partition_writer, "_next_version", lambda session: 42)
    with pytest.raises(VersionRaceError):
        write(sessions, make_partition())
    with sessions() as session:
        assert repo.list_versions(session) == []


def test_a_writer_waits_for_the_lock_holder(sessions: sessionmaker[Session]) -> None:
    first = write(sessions, make_partition(0))
    holder = sessions()
    holder.begin()
    partition_writer.take_write_lock(holder, timeout_s=5)
    done = threading.Event()
    result: list[int] = []

    def second_writer() -> None:
        result.append(write(sessions, make_partition(1), parent=first))
        done.set()

    thread = threading.Thread(target=second_writer)
    thread.start()
    assert not done.wait(timeout=0.5)  # blocked behind the holder's write lock
    holder.rollback()
    holder.close()
    thread.join(timeout=10)
    assert result == [first + 1]
