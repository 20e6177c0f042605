"""Repository API for partition versions: plain records in, plain records out.

Callers hand in a `sqlalchemy.orm.Session` (from a `sessionmaker` they own; this module
holds no engine) and get back frozen dataclasses, never ORM objects. The functions flush
but never commit: the caller's transaction is the unit of work,

    factory = make_session_factory(make_engine(url))
    with factory.begin() as session:        # commits on success, rolls back on error
        version = create_version(session, record)
        activate(session, version)

Versions are immutable. The content of a version is its blob: the encoded
`eldr.wire.PartitionBlob`, byte for byte what is published to the object store, stamped with
the version number; the row's `blob_sha256` is always the SHA-256 of those bytes. Nothing
here updates a stored blob; only the status (candidate -> active -> retired, candidate ->
rejected) and the note move.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy import URL, Engine, create_engine, event, func, make_url, select, text, update
from sqlalchemy.orm import Session, sessionmaker

from eldr.store.models import PartitionStatus, PartitionVersion
from eldr.wire import PartitionBlob, WireError, decode

log = logging.getLogger(__name__)

MAX_BLOB_BYTES = 1 << 30
"""Largest blob the store reads or writes (the object store's readers have their own,
smaller limit, `BusSettings.max_object_bytes`)."""

MAX_MODEL_CHARS = 200
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

DEFAULT_LIST_LIMIT = 50


class VersionNotFoundError(LookupError):
    """No partition version has this id."""


class InvalidTransitionError(ValueError):
    """The requested status change is not allowed from the version's current status."""


class CorruptVersionError(ValueError):
    """A stored version's blob does not hash as its row says, does not decode, or does not
    agree with the row (version number, model, sizes)."""


class BlobVersionMismatchError(ValueError):
    """The insert got another version number than the one the record's blob carries (a
    writer that guessed the next number wrong); nothing was stored."""

    def __init__(self, blob_version: int, inserted: int) -> None:
        super().__init__(
            f"the blob carries version {blob_version}, the insert got {inserted}; not stored"
        )
        self.blob_version = blob_version
        self.inserted = inserted


# --- engine ---------------------------------------------------------------------------------


def make_engine(url: str | URL, **engine_kwargs: Any) -> Engine:
    """An engine for `url`, configured for how ELDR uses each backend.

    SQLite: creates the file's parent directory, turns on foreign keys (off by default in
    SQLite) and WAL journaling (readers do not block the trainer's writes). PostgreSQL:
    `pool_pre_ping`, so a router survives a database restart. Extra keyword arguments go
    to `sqlalchemy.create_engine`.
    """
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        database = parsed.database or ""
        in_memory = database in ("", ":memory:") or parsed.query.get("mode") == "memory"
        if not in_memory and not database.startswith("file:"):
            Path(database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(parsed, **engine_kwargs)
        event.listen(engine, "connect", _sqlite_pragmas_wal if not in_memory else _sqlite_pragmas)
        return engine
    engine_kwargs.setdefault("pool_pre_ping", True)
    return create_engine(parsed, **engine_kwargs)


def _sqlite_pragmas(dbapi_connection: Any, connection_record: Any) -> None:
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA foreign_keys = ON")
    finally:
        cursor.close()


def _sqlite_pragmas_wal(dbapi_connection: Any, connection_record: Any) -> None:
    _sqlite_pragmas(dbapi_connection, connection_record)
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA journal_mode = WAL")
    finally:
        cursor.close()


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    """A `sessionmaker` for the repository functions.

    `expire_on_commit=False`: the functions return detached dataclasses anyway, and
    nothing should reload rows merely because a transaction ended.
    """
    return sessionmaker(engine, expire_on_commit=False)


# --- records --------------------------------------------------------------------------------


@dataclass(frozen=True)
class PartitionRecord:
    """One partition version as plain data: its blob and what the blob does not hold.

    blob_bytes: the encoded `PartitionBlob`, exactly the bytes published to the object
    store (at most MAX_BLOB_BYTES); `blob` is them decoded (validated, as every consumer
    decodes them), and `blob_sha256` their SHA-256. The blob's `version` is the version
    number: a new record carries the number its insert will get (`create_version` refuses
    any other), a stored one its own. `model`, `k`, `num_centroids`, `dim`,
    `num_moe_layers` and `num_experts` are read from the blob. seed, n_train,
    parent_version and note describe the fit.

    `version`, `status` and `created_at` are filled in by the store: a new record leaves
    them at their defaults (created_at may be given; it defaults to the time of writing).
    """

    blob_bytes: bytes = field(repr=False)
    seed: int
    n_train: int
    parent_version: int | None = None
    note: str = ""
    version: int | None = None
    status: PartitionStatus = PartitionStatus.CANDIDATE
    created_at: datetime | None = None
    blob: PartitionBlob = field(init=False, repr=False, compare=False)
    blob_sha256: str = field(init=False)
    model: str = field(init=False, compare=False)
    k: int = field(init=False, compare=False)
    """Number of workers (slots)."""
    num_centroids: int = field(init=False, compare=False)
    dim: int = field(init=False, compare=False)
    num_moe_layers: int = field(init=False, compare=False)
    num_experts: int = field(init=False, compare=False)

    def __post_init__(self) -> None:
        data = bytes(self.blob_bytes)
        object.__setattr__(self, "blob_bytes", data)
        try:
            blob = decode(data, PartitionBlob, MAX_BLOB_BYTES)
        except WireError as exc:
            raise ValueError(f"blob_bytes are not a valid partition blob: {exc}") from exc
        _check_text("model", blob.model, MAX_MODEL_CHARS)
        if not blob.workers:
            raise ValueError("a partition needs at least one worker")
        if len(set(blob.workers)) != len(blob.workers):
            raise ValueError(f"worker ids must be unique: {blob.workers}")
        n_centroids, dim = blob.centroids.shape
        if n_centroids == 0 or dim == 0:
            raise ValueError(f"centroids must be [num_centroids, dim], got {blob.centroids.shape}")
        for name in ("centroids", "idf"):
            array = getattr(blob, name)
            if array is not None and not np.isfinite(array.to_numpy()).all():
                raise ValueError(f"{name} contains NaN or inf")
        if self.version is not None and blob.version != self.version:
            raise ValueError(f"version {self.version} holds a blob of version {blob.version}")
        if self.n_train < 0:
            raise ValueError(f"n_train must be >= 0, got {self.n_train}")
        if not _INT64_MIN <= self.seed <= _INT64_MAX:
            raise ValueError(f"seed {self.seed} does not fit in 64 bits")
        if self.parent_version is not None and self.parent_version <= 0:
            raise ValueError(f"parent_version must be a version id, got {self.parent_version}")
        object.__setattr__(self, "status", PartitionStatus(self.status))
        if self.created_at is not None and self.created_at.tzinfo is None:
            raise ValueError("created_at must be timezone-aware")
        for name, value in (
            ("blob", blob),
            ("blob_sha256", hashlib.sha256(data).hexdigest()),
            ("model", blob.model),
            ("k", len(blob.workers)),
            ("num_centroids", int(n_centroids)),
            ("dim", int(dim)),
            ("num_moe_layers", blob.num_moe_layers),
            ("num_experts", blob.num_experts),
        ):
            object.__setattr__(self, name, value)


@dataclass(frozen=True)
class VersionInfo:
    """A partition version without its blob, for listings (`get` has the content)."""

    version: int
    model: str
    status: PartitionStatus
    created_at: datetime
    k: int
    num_centroids: int
    dim: int
    n_train: int
    seed: int
    parent_version: int | None
    note: str
    blob_sha256: str


def _check_text(name: str, value: str, max_chars: int) -> None:
    if not value or len(value) > max_chars:
        raise ValueError(f"{name} must be 1..{max_chars} characters, got {value!r}")


def _to_row(record: PartitionRecord) -> PartitionVersion:
    row = PartitionVersion(
        model=record.model,
        status=PartitionStatus.CANDIDATE.value,
        k=record.k,
        num_centroids=record.num_centroids,
        dim=record.dim,
        num_moe_layers=record.num_moe_layers,
        num_experts=record.num_experts,
        seed=record.seed,
        n_train=record.n_train,
        parent_version=record.parent_version,
        note=record.note,
        blob_sha256=record.blob_sha256,
        blob=record.blob_bytes,
    )
    if record.created_at is not None:
        row.created_at = record.created_at
    return row


def _from_row(row: PartitionVersion) -> PartitionRecord:
    data = bytes(row.blob)
    sha = hashlib.sha256(data).hexdigest()
    if sha != row.blob_sha256:
        raise CorruptVersionError(
            f"version {row.id}: the stored blob hashes to {sha}, the row says {row.blob_sha256}"
        )
    try:
        record = PartitionRecord(
            blob_bytes=data,
            seed=row.seed,
            n_train=row.n_train,
            parent_version=row.parent_version,
            note=row.note,
            version=row.id,
            status=PartitionStatus(row.status),
            created_at=row.created_at,
        )
    except ValueError as exc:
        raise CorruptVersionError(f"version {row.id}: {exc}") from exc
    for name in ("model", "k", "num_centroids", "dim", "num_moe_layers", "num_experts"):
        if getattr(record, name) != getattr(row, name):
            raise CorruptVersionError(
                f"version {row.id}: the blob has {name}={getattr(record, name)!r}, "
                f"the row says {getattr(row, name)!r}"
            )
    return record


# --- repository functions -------------------------------------------------------------------


def create_version(session: Session, record: PartitionRecord) -> int:
    """Store `record` as a new candidate version and return its version number.

    The number is the database's; it must be the one the record's blob carries, else
    `BlobVersionMismatchError` (and nothing is stored). Callers that cannot know the next
    number under a lock of their own use `eldr.partitions.writer`.
    """
    if record.version is not None:
        raise ValueError(
            f"record is already version {record.version}; versions are immutable, "
            "store a copy with dataclasses.replace(record, version=None, ...)"
        )
    if record.status is not PartitionStatus.CANDIDATE:
        raise ValueError(
            f"new versions start as candidates, got {record.status}; use activate()/reject()"
        )
    if record.parent_version is not None:
        _model_of(session, record.parent_version)
    row = _to_row(record)
    session.add(row)
    session.flush()
    if row.id != record.blob.version:
        inserted = row.id
        # Leave no row with a blob of another version behind, whatever the caller does next.
        session.delete(row)
        session.flush()
        raise BlobVersionMismatchError(record.blob.version, inserted)
    log.info(
        "stored partition version %d for model %s (k=%d, centroids=%d, dim=%d, n_train=%d)",
        row.id,
        record.model,
        record.k,
        record.num_centroids,
        record.dim,
        record.n_train,
    )
    return row.id


def activate(session: Session, version_id: int, *, note: str | None = None) -> int | None:
    """Make `version_id` the active version of its model; return the version it retired.

    The previous active version (if any) is retired and this one activated in the caller's
    transaction, so readers see either the old or the new active version, never none or
    two. Activating the active version is a no-op (its note is still updated when given);
    a retired version may be activated again (rollback); a rejected one may not.
    Concurrent activations for one model are serialised (a PostgreSQL advisory lock per
    model; SQLite's database write lock), so the last to commit wins.
    """
    model = _model_of(session, version_id)
    _lock_model_for_writes(session, model, version_id)
    status = session.scalar(
        select(PartitionVersion.status).where(PartitionVersion.id == version_id).with_for_update()
    )
    if status == PartitionStatus.REJECTED:
        raise InvalidTransitionError(f"version {version_id} was rejected and cannot be activated")
    values: dict[str, Any] = {"status": PartitionStatus.ACTIVE.value}
    if note is not None:
        values["note"] = note
    retired: int | None = None
    if status != PartitionStatus.ACTIVE:
        # Retire first: the one-active-per-model index is checked statement by statement.
        retired_ids = session.scalars(
            update(PartitionVersion)
            .where(
                PartitionVersion.model == model,
                PartitionVersion.status == PartitionStatus.ACTIVE.value,
            )
            .values(status=PartitionStatus.RETIRED.value)
            .returning(PartitionVersion.id)
        ).all()
        retired = retired_ids[0] if retired_ids else None
    session.execute(
        update(PartitionVersion).where(PartitionVersion.id == version_id).values(**values)
    )
    session.flush()
    log.info("activated partition version %d for model %s (retired %s)", version_id, model, retired)
    return retired


def reject(session: Session, version_id: int, note: str) -> None:
    """Mark a candidate (or retired) version rejected, with the reason in `note`.

    An active version cannot be rejected: activate its replacement first.
    """
    rejectable = (PartitionStatus.CANDIDATE.value, PartitionStatus.RETIRED.value)
    # One conditional UPDATE, so a concurrent activate() cannot slip in between a status
    # check and the write.
    changed = session.scalars(
        update(PartitionVersion)
        .where(PartitionVersion.id == version_id, PartitionVersion.status.in_(rejectable))
        .values(status=PartitionStatus.REJECTED.value, note=note)
        .returning(PartitionVersion.id)
    ).all()
    if not changed:
        status = session.scalar(
            select(PartitionVersion.status).where(PartitionVersion.id == version_id)
        )
        if status is None:
            raise VersionNotFoundError(f"no partition version {version_id}")
        raise InvalidTransitionError(f"version {version_id} is {status}; cannot reject it")
    session.flush()
    log.info("rejected partition version %d: %s", version_id, note)


def get(session: Session, version_id: int) -> PartitionRecord:
    """The version `version_id`; raises `VersionNotFoundError` if there is none."""
    row = session.scalars(
        select(PartitionVersion)
        .where(PartitionVersion.id == version_id)
        .execution_options(populate_existing=True)
    ).one_or_none()
    if row is None:
        raise VersionNotFoundError(f"no partition version {version_id}")
    return _from_row(row)


def get_active(session: Session, model: str) -> PartitionRecord | None:
    """The active version of `model`, or None before the first activation."""
    row = session.scalars(
        select(PartitionVersion)
        .where(
            PartitionVersion.model == model,
            PartitionVersion.status == PartitionStatus.ACTIVE.value,
        )
        .execution_options(populate_existing=True)
    ).one_or_none()
    return None if row is None else _from_row(row)


def list_versions(
    session: Session, model: str | None = None, limit: int = DEFAULT_LIST_LIMIT
) -> list[VersionInfo]:
    """Newest first, without blobs; all models when `model` is None."""
    if limit <= 0:
        raise ValueError(f"limit must be positive, got {limit}")
    pv = PartitionVersion
    query = select(
        pv.id,
        pv.model,
        pv.status,
        pv.created_at,
        pv.k,
        pv.num_centroids,
        pv.dim,
        pv.n_train,
        pv.seed,
        pv.parent_version,
        pv.note,
        pv.blob_sha256,
    )
    if model is not None:
        query = query.where(pv.model == model)
    query = query.order_by(pv.created_at.desc(), pv.id.desc()).limit(limit)
    return [
        VersionInfo(
            version=row.id,
            model=row.model,
            status=PartitionStatus(row.status),
            created_at=row.created_at,
            k=row.k,
            num_centroids=row.num_centroids,
            dim=row.dim,
            n_train=row.n_train,
            seed=row.seed,
            parent_version=row.parent_version,
            note=row.note,
            blob_sha256=row.blob_sha256,
        )
        for row in session.execute(query)
    ]


def _model_of(session: Session, version_id: int) -> str:
    model = session.scalar(select(PartitionVersion.model).where(PartitionVersion.id == version_id))
    if model is None:
        raise VersionNotFoundError(f"no partition version {version_id}")
    return model


def _advisory_key(model: str) -> int:
    digest = hashlib.blake2b(f"eldr.partition_versions:{model}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def _lock_model_for_writes(session: Session, model: str, version_id: int) -> None:
    """Serialise status changes of one model's versions until the transaction ends.

    Row locks alone are not enough on PostgreSQL: under READ COMMITTED a waiting UPDATE
    does not see a version that a concurrent transaction has just activated, and the
    unique index would then fail the second activation instead of ordering it.
    """
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        session.execute(select(func.pg_advisory_xact_lock(_advisory_key(model))))
    elif dialect == "sqlite":
        # A write takes SQLite's database-wide write lock now, before the status is read,
        # so that read cannot be stale. It leaves the row as it was.
        session.execute(
            text("UPDATE partition_versions SET status = status WHERE id = :id"),
            {"id": version_id},
        )


__all__ = [
    "MAX_BLOB_BYTES",
    "BlobVersionMismatchError",
    "CorruptVersionError",
    "InvalidTransitionError",
    "PartitionRecord",
    "VersionInfo",
    "VersionNotFoundError",
    "activate",
    "create_version",
    "get",
    "get_active",
    "list_versions",
    "make_engine",
    "make_session_factory",
    "reject",
]
