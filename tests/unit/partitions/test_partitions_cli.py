"""`eldr partitions activate`: the database side of a rollback (SQLite file; no sockets).
The announcement to running routers is exercised in
tests/integration/test_deploy_entrypoints.py."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest
from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker

from eldr.core.partition.partition import Partition
from eldr.core.signature.signature import Calibration
from eldr.partitions.cli import ActivationError, activate_version
from eldr.partitions.codec import blob_sha256
from eldr.partitions.writer import rebuild_stored, write_active_version
from eldr.store import migrate, repo
from eldr.store.models import PartitionStatus, PartitionVersion
from eldr.wire import encode

GOLDEN_BLOB_V1 = Path(__file__).parents[1] / "wire" / "golden" / "partition_blob.v1.msgpack"


def make_partition(seed: int) -> Partition:
    rng = np.random.default_rng(seed)
    centroids = rng.random((3, 8)).astype(np.float32)
    centroids /= np.linalg.norm(centroids, axis=1, keepdims=True)
    return Partition(
        version=0,
        model="m",
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
    factory = repo.make_session_factory(engine)
    for seed in (1, 2):
        write_active_version(
            factory,
            make_partition(seed),
            seed=seed,
            n_train=10,
            parent_version=None,
            note="fit",
            lock_timeout_s=5,
        )
    yield factory
    engine.dispose()


def statuses(sessions: sessionmaker[Session]) -> dict[int, PartitionStatus]:
    with sessions() as session:
        return {i.version: i.status for i in repo.list_versions(session, "m")}


def test_a_retired_version_becomes_active_again_with_its_own_blob(
    sessions: sessionmaker[Session],
) -> None:
    assert statuses(sessions) == {1: PartitionStatus.RETIRED, 2: PartitionStatus.ACTIVE}
    activated = activate_version(sessions, 1, note="rollback", lock_timeout_s=5)
    assert (activated.version, activated.retired, activated.model) == (1, 2, "m")
    assert statuses(sessions) == {1: PartitionStatus.ACTIVE, 2: PartitionStatus.RETIRED}
    assert activated.blob.version == 1
    assert blob_sha256(activated.blob) == activated.sha256
    with sessions() as session:
        record = repo.get(session, 1)
    assert record.blob_sha256 == activated.sha256
    assert record.note == "rollback"


def test_activating_the_active_version_changes_nothing(sessions: sessionmaker[Session]) -> None:
    activated = activate_version(sessions, 2, note=None, lock_timeout_s=5)
    assert activated.retired is None
    assert statuses(sessions) == {1: PartitionStatus.RETIRED, 2: PartitionStatus.ACTIVE}


def test_an_unknown_version_is_refused(sessions: sessionmaker[Session]) -> None:
    with pytest.raises(ActivationError, match="no partition version 7"):
        activate_version(sessions, 7, note=None, lock_timeout_s=5)


def test_a_rejected_version_is_refused(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        repo.reject(session, 1, "bad fit")
    with pytest.raises(ActivationError, match="rejected"):
        activate_version(sessions, 1, note=None, lock_timeout_s=5)
    assert statuses(sessions)[2] is PartitionStatus.ACTIVE


def test_a_version_whose_blob_cannot_be_reproduced_is_not_activated(
    sessions: sessionmaker[Session],
) -> None:
    with sessions.begin() as session:
        session.execute(
            update(PartitionVersion).where(PartitionVersion.id == 1).values(blob_sha256="0" * 64)
        )
    with pytest.raises(ActivationError, match="hashes to"):
        activate_version(sessions, 1, note=None, lock_timeout_s=5)
    assert statuses(sessions) == {1: PartitionStatus.RETIRED, 2: PartitionStatus.ACTIVE}


def test_a_version_stored_with_a_v1_blob_is_activated_with_its_v2_blob(
    sessions: sessionmaker[Session],
) -> None:
    """A row written before PartitionBlob v2 holds the hash of its v1 blob (`prices` nil,
    fields in the order of the v1 golden file); it is still activated, and announced with
    the v2 blob and hash."""
    with sessions() as session:
        v2_blob = rebuild_stored(repo.get(session, 1)).blob
    fields = msgspec.msgpack.decode(encode(v2_blob))
    v1_order = msgspec.msgpack.decode(GOLDEN_BLOB_V1.read_bytes())
    v1 = {k: 1 if k == "v" else fields.get(k) for k in v1_order}
    assert v1["prices"] is None
    v1_sha = hashlib.sha256(msgspec.msgpack.encode(v1)).hexdigest()
    with sessions.begin() as session:
        session.execute(
            update(PartitionVersion).where(PartitionVersion.id == 1).values(blob_sha256=v1_sha)
        )
    rolled_back = activate_version(sessions, 1, note="rollback", lock_timeout_s=5)
    assert rolled_back.blob.v == 2
    assert rolled_back.sha256 == blob_sha256(rolled_back.blob) != v1_sha
