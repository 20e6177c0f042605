"""`eldr partitions activate`: the database side of a rollback (SQLite file; no sockets).
The announcement to running routers is exercised in
tests/integration/test_deploy_entrypoints.py."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import msgspec
import numpy as np
import pytest
from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker

from eldr.bus import ObjectRef, PublishAck
from eldr.core.partition.partition import Partition
from eldr.core.signature.signature import Calibration
from eldr.partitions.announce import announce_version
from eldr.partitions.cli import ActivationError, activate_version
from eldr.partitions.codec import blob_sha256
from eldr.partitions.writer import write_active_version
from eldr.store import migrate, repo
from eldr.store.models import PartitionStatus, PartitionVersion
from eldr.wire import Message, PartitionAnnouncement

M = TypeVar("M", bound=Message)

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
    assert record.blob_bytes == activated.blob_bytes
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


def test_a_version_whose_blob_does_not_hash_as_its_row_says_is_not_activated(
    sessions: sessionmaker[Session],
) -> None:
    with sessions.begin() as session:
        session.execute(
            update(PartitionVersion).where(PartitionVersion.id == 1).values(blob_sha256="0" * 64)
        )
    with pytest.raises(ActivationError, match="hashes to"):
        activate_version(sessions, 1, note=None, lock_timeout_s=5)
    assert statuses(sessions) == {1: PartitionStatus.RETIRED, 2: PartitionStatus.ACTIVE}


def _store_as_v1(sessions: sessionmaker[Session], version: int) -> bytes:
    """Make `version` a version stored before PartitionBlob v2, as migration 0003 leaves
    one: its row holds the v1 blob it was announced with (fields in the order of the v1
    golden file, `prices` nil) and that blob's hash."""
    with sessions() as session:
        v2_bytes = repo.get(session, version).blob_bytes
    fields = msgspec.msgpack.decode(v2_bytes)
    v1_order = msgspec.msgpack.decode(GOLDEN_BLOB_V1.read_bytes())
    v1 = {k: 1 if k == "v" else fields.get(k) for k in v1_order}
    assert v1["prices"] is None
    v1_bytes = msgspec.msgpack.encode(v1)
    with sessions.begin() as session:
        session.execute(
            update(PartitionVersion)
            .where(PartitionVersion.id == version)
            .values(blob=v1_bytes, blob_sha256=hashlib.sha256(v1_bytes).hexdigest())
        )
    return v1_bytes


def test_a_version_stored_with_a_v1_blob_is_activated_with_that_blob(
    sessions: sessionmaker[Session],
) -> None:
    v1_bytes = _store_as_v1(sessions, 1)
    rolled_back = activate_version(sessions, 1, note="rollback", lock_timeout_s=5)
    assert rolled_back.blob.v == 1
    assert rolled_back.blob_bytes == v1_bytes
    assert rolled_back.sha256 == hashlib.sha256(v1_bytes).hexdigest()


class RecordingBus:
    """The object store and stream of `PartitionBus`, in memory."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.published: list[Message] = []

    async def object_put_bytes(self, bucket: str, name: str, data: bytes) -> ObjectRef:
        self.objects[name] = data
        return ObjectRef(bucket, name, len(data), hashlib.sha256(data).hexdigest())

    async def js_publish(
        self,
        subject: str,
        message: Message,
        *,
        msg_id: str | None = None,
        timeout_s: float | None = None,
    ) -> PublishAck:
        self.published.append(message)
        return PublishAck("PARTITIONS", len(self.published), duplicate=False)

    async def get_last(self, stream: str, subject: str, message_type: type[M]) -> M | None:
        return None


async def test_the_stored_bytes_are_announced_byte_for_byte(
    sessions: sessionmaker[Session],
) -> None:
    v1_bytes = _store_as_v1(sessions, 1)
    bus = RecordingBus()
    for version, expected in ((1, v1_bytes), (2, None)):
        activated = activate_version(sessions, version, note=None, lock_timeout_s=5)
        await announce_version(
            bus, activated, bucket="b", subject="s", created_ts_s=0.0, msg_id=None
        )
        with sessions() as session:
            stored = repo.get(session, version)
        assert bus.objects[f"v{version}"] == stored.blob_bytes
        assert expected is None or stored.blob_bytes == expected
        announcement = bus.published[-1]
        assert isinstance(announcement, PartitionAnnouncement)
        assert announcement.sha256 == stored.blob_sha256
