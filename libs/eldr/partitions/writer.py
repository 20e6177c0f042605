"""Storing a fitted partition as the new active version, one writer at a time.

A version is immutable; its row stores the blob routers load, byte for byte, with its
SHA-256, and the blob carries the version number, which the database assigns. So the
writer, holding the write lock, reads the number the next insert will get, encodes the blob
with it, inserts the row with those bytes (the store checks that the insert got that
number), and activates the version, all in one transaction. If the number differs (a
writer that bypassed the lock), the transaction is rolled back and the write tried again;
nothing half-written is ever committed. What is announced afterwards is the stored bytes.

The write lock makes "only one trainer writes at a time" hold across processes and hosts:
on PostgreSQL a transaction-scoped advisory lock (`pg_try_advisory_xact_lock`, polled up
to a timeout); on SQLite the database file's write lock, taken by the transaction's first
statement (other writers wait for SQLite's busy timeout). Both end with the transaction.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from dataclasses import dataclass

import msgspec
from sqlalchemy import func, select, text
from sqlalchemy.orm import Session, sessionmaker

from eldr.core.partition.partition import Partition
from eldr.partitions.codec import partition_from_blob, partition_to_blob
from eldr.store import repo
from eldr.store.models import PartitionVersion
from eldr.wire import PartitionBlob, encode

log = logging.getLogger(__name__)

WRITE_LOCK_NAME = "eldr.trainer.write"
MAX_WRITE_ATTEMPTS = 3
_LOCK_POLL_S = 0.05


class WriteLockTimeoutError(TimeoutError):
    """Another writer held the partition write lock for longer than the timeout."""


class VersionRaceError(RuntimeError):
    """The inserted row did not get the version number the blob was encoded with."""


@dataclass(frozen=True)
class StoredVersion:
    """A partition version with the exact blob that belongs to it (as stored, activated and
    announced); `retired` is the version its activation retired, if any."""

    version: int
    retired: int | None
    blob: PartitionBlob
    blob_bytes: bytes
    sha256: str

    @property
    def model(self) -> str:
        return self.blob.model


def write_lock_key() -> int:
    digest = hashlib.blake2b(WRITE_LOCK_NAME.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def blob_for_version(
    partition: Partition, version: int, retired: int | None = None
) -> StoredVersion:
    """`partition` as version `version`: its blob stamped with that number, the encoded
    bytes and their SHA-256 (what the row stores and the announcement names)."""
    blob = msgspec.structs.replace(partition_to_blob(partition), version=version)
    data = encode(blob)
    return StoredVersion(version, retired, blob, data, hashlib.sha256(data).hexdigest())


def stored_version(record: repo.PartitionRecord, retired: int | None = None) -> StoredVersion:
    """A stored version with the blob its row holds: the exact bytes to publish (the store
    has checked that they hash as the row says and carry the row's version number)."""
    if record.version is None:
        raise ValueError("a stored partition record has a version")
    return StoredVersion(
        record.version, retired, record.blob, record.blob_bytes, record.blob_sha256
    )


def load_active(sessions: sessionmaker[Session], model: str) -> Partition | None:
    """The active partition of `model` from the database (exact index), or None."""
    with sessions() as session:
        record = repo.get_active(session, model)
    return None if record is None else partition_from_blob(record.blob, index_method="exact")


def write_active_version(
    sessions: sessionmaker[Session],
    partition: Partition,
    *,
    seed: int,
    n_train: int,
    parent_version: int | None,
    note: str,
    lock_timeout_s: float,
) -> StoredVersion:
    """Store `partition` as a new version and make it the active one of its model.

    `partition.version` is ignored: the database numbers versions. Raises
    WriteLockTimeoutError, VersionRaceError (after MAX_WRITE_ATTEMPTS) or the driver's
    errors (database down); in every failure case nothing is committed.
    """
    return _write(
        sessions,
        partition,
        seed=seed,
        n_train=n_train,
        parent_version=parent_version,
        note=note,
        lock_timeout_s=lock_timeout_s,
        activate=True,
    )


def write_rejected_version(
    sessions: sessionmaker[Session],
    partition: Partition,
    *,
    seed: int,
    n_train: int,
    parent_version: int | None,
    note: str,
    lock_timeout_s: float,
) -> StoredVersion:
    """Store `partition` as a new version with status rejected and `note` saying why.

    A candidate the shadow evaluation turned down is kept (immutable, like every
    version) so that an operator can see what was fitted and why it was not used; it is
    never announced. The active version is untouched. Same errors as
    `write_active_version`.
    """
    return _write(
        sessions,
        partition,
        seed=seed,
        n_train=n_train,
        parent_version=parent_version,
        note=note,
        lock_timeout_s=lock_timeout_s,
        activate=False,
    )


def _write(
    sessions: sessionmaker[Session],
    partition: Partition,
    *,
    seed: int,
    n_train: int,
    parent_version: int | None,
    note: str,
    lock_timeout_s: float,
    activate: bool,
) -> StoredVersion:
    last_race: VersionRaceError | None = None
    for attempt in range(1, MAX_WRITE_ATTEMPTS + 1):
        try:
            return _write_once(
                sessions,
                partition,
                seed=seed,
                n_train=n_train,
                parent_version=parent_version,
                note=note,
                lock_timeout_s=lock_timeout_s,
                activate=activate,
            )
        except VersionRaceError as exc:
            log.warning("partition write attempt %d: %s; retrying", attempt, exc)
            last_race = exc
    assert last_race is not None
    raise last_race


def _write_once(
    sessions: sessionmaker[Session],
    partition: Partition,
    *,
    seed: int,
    n_train: int,
    parent_version: int | None,
    note: str,
    lock_timeout_s: float,
    activate: bool = True,
) -> StoredVersion:
    with sessions.begin() as session:
        take_write_lock(session, lock_timeout_s)
        expected = _next_version(session)
        stored = blob_for_version(partition, expected)
        record = repo.PartitionRecord(
            blob_bytes=stored.blob_bytes,
            seed=seed,
            n_train=n_train,
            parent_version=parent_version,
            note=note,
        )
        try:
            version = repo.create_version(session, record)
        except repo.BlobVersionMismatchError as exc:
            # Leaving the `with` block by an exception rolls the transaction back.
            raise VersionRaceError(
                f"expected version {expected}, the insert got {exc.inserted}"
            ) from exc
        if activate:
            retired = repo.activate(session, version)
        else:
            repo.reject(session, version, note)
            retired = None
    return dataclasses.replace(stored, retired=retired)


def take_write_lock(session: Session, timeout_s: float) -> None:
    """Take the partition write lock for the rest of `session`'s transaction (the module
    docstring says how); WriteLockTimeoutError after `timeout_s` on PostgreSQL."""
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        deadline = time.monotonic() + timeout_s
        key = write_lock_key()
        while not session.scalar(select(func.pg_try_advisory_xact_lock(key))):
            if time.monotonic() >= deadline:
                raise WriteLockTimeoutError(
                    f"partition write lock still held by another writer after {timeout_s:.1f} s"
                )
            time.sleep(_LOCK_POLL_S)
    elif dialect == "sqlite":
        # A write statement opens SQLite's write transaction (and waits for the file's
        # write lock) even when it changes no row; reads after it cannot be stale.
        session.execute(text("UPDATE partition_versions SET status = status WHERE 0"))


def _next_version(session: Session) -> int:
    """The id the next insert into partition_versions will get (under the write lock)."""
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        row = session.execute(
            text(
                "SELECT s.last_value, s.start_value, s.increment_by FROM pg_sequences s "
                "WHERE format('%I.%I', s.schemaname, s.sequencename) = "
                "pg_get_serial_sequence('partition_versions', 'id')"
            )
        ).one_or_none()
        if row is not None:
            last, start, step = row
            return int(start) if last is None else int(last) + int(step)
    elif dialect == "sqlite":
        # AUTOINCREMENT: the next id is one past the largest ever handed out.
        seq = session.scalar(
            text("SELECT seq FROM sqlite_sequence WHERE name = 'partition_versions'")
        )
        if seq is not None:
            return int(seq) + 1
    # Anything else: a guess that the insert's check confirms or refutes.
    largest = session.scalar(select(func.max(PartitionVersion.id)))
    return 1 if largest is None else int(largest) + 1
