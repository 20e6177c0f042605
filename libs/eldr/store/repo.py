"""Repository API for partition versions: plain records in, plain records out.

Callers hand in a `sqlalchemy.orm.Session` (from a `sessionmaker` they own; this module
holds no engine) and get back frozen dataclasses with numpy arrays, never ORM objects or
bytes. The functions flush but never commit: the caller's transaction is the unit of work,

    factory = make_session_factory(make_engine(url))
    with factory.begin() as session:        # commits on success, rolls back on error
        version = create_version(session, record)
        activate(session, version)

Versions are immutable. Nothing here updates centroids or any other content of a stored
version; only the status (candidate -> active -> retired, candidate -> rejected) and the
note move. Arrays are stored as `.npy` bytes, so their dtype and shape travel with them.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
from sqlalchemy import URL, Engine, create_engine, event, func, make_url, select, text, update
from sqlalchemy.orm import Session, sessionmaker

from eldr.store.models import PartitionStatus, PartitionVersion

log = logging.getLogger(__name__)

CENTROID_DTYPE = np.dtype(np.float32)
IDF_DTYPE = np.dtype(np.float32)
LAYER_MASK_DTYPE = np.dtype(np.bool_)

MAX_MODEL_CHARS = 200
MAX_TRANSFORM_CHARS = 64
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1

DEFAULT_LIST_LIMIT = 50


class VersionNotFoundError(LookupError):
    """No partition version has this id."""


class InvalidTransitionError(ValueError):
    """The requested status change is not allowed from the version's current status."""


class CorruptVersionError(ValueError):
    """A stored array does not have the dtype or shape its row says it has."""


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


@dataclass(frozen=True, eq=False)
class PartitionRecord:
    """One partition version as plain data.

    centroids: float32 [num_centroids, dim], read-only (float input is cast to float32,
    the storage precision). owners[c] is the worker slot of centroid c, workers[slot] the
    worker id; k = len(workers). layer_mask: bool [num_moe_layers], the calibrated layers.
    idf: float32 with num_moe_layers * num_experts entries (any shape, kept), or None for
    transforms without IDF. metrics: a JSON object (no NaN/inf). blob_sha256: lowercase hex
    SHA-256 of the partition blob published to the object store.

    `version`, `status` and `created_at` are filled in by the store: a new record leaves
    them at their defaults (created_at may be given; it defaults to the time of writing).
    Compared by identity (numpy arrays have no single truth value).
    """

    model: str
    transform: str
    num_moe_layers: int
    num_experts: int
    seed: int
    n_train: int
    centroids: np.ndarray
    owners: tuple[int, ...]
    workers: tuple[str, ...]
    layer_mask: np.ndarray
    blob_sha256: str
    idf: np.ndarray | None = None
    metrics: Mapping[str, Any] = field(default_factory=dict)
    parent_version: int | None = None
    note: str = ""
    version: int | None = None
    status: PartitionStatus = PartitionStatus.CANDIDATE
    created_at: datetime | None = None

    def __post_init__(self) -> None:
        _check_text("model", self.model, MAX_MODEL_CHARS)
        _check_text("transform", self.transform, MAX_TRANSFORM_CHARS)
        for name in ("num_moe_layers", "num_experts"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.n_train < 0:
            raise ValueError(f"n_train must be >= 0, got {self.n_train}")
        if not _INT64_MIN <= self.seed <= _INT64_MAX:
            raise ValueError(f"seed {self.seed} does not fit in 64 bits")

        centroids = _float_array("centroids", self.centroids, CENTROID_DTYPE)
        if centroids.ndim != 2 or centroids.shape[0] == 0 or centroids.shape[1] == 0:
            raise ValueError(f"centroids must be [num_centroids, dim], got {centroids.shape}")
        object.__setattr__(self, "centroids", centroids)

        workers = tuple(str(w) for w in self.workers)
        if not workers:
            raise ValueError("a partition needs at least one worker")
        if len(set(workers)) != len(workers):
            raise ValueError(f"worker ids must be unique: {workers}")
        object.__setattr__(self, "workers", workers)

        owners = tuple(int(o) for o in np.asarray(self.owners).reshape(-1))
        if len(owners) != centroids.shape[0]:
            raise ValueError(f"{len(owners)} owners for {centroids.shape[0]} centroids")
        if owners and not 0 <= min(owners) <= max(owners) < len(workers):
            raise ValueError(f"owners must be worker slots in [0, {len(workers)})")
        object.__setattr__(self, "owners", owners)

        mask = np.asarray(self.layer_mask)
        if mask.dtype != LAYER_MASK_DTYPE or mask.shape != (self.num_moe_layers,):
            raise ValueError(
                f"layer_mask must be bool [{self.num_moe_layers}], got {mask.dtype} {mask.shape}"
            )
        object.__setattr__(self, "layer_mask", _read_only(mask))

        if self.idf is not None:
            idf = _float_array("idf", self.idf, IDF_DTYPE)
            if idf.size != self.num_moe_layers * self.num_experts:
                raise ValueError(
                    f"idf has {idf.size} entries, expected num_moe_layers * num_experts = "
                    f"{self.num_moe_layers * self.num_experts}"
                )
            object.__setattr__(self, "idf", idf)

        metrics = dict(self.metrics)
        try:
            json.dumps(metrics, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"metrics must be a JSON object without NaN/inf: {exc}") from exc
        object.__setattr__(self, "metrics", MappingProxyType(metrics))

        if not _SHA256_HEX.fullmatch(self.blob_sha256):
            raise ValueError(f"blob_sha256 must be 64 lowercase hex digits: {self.blob_sha256!r}")
        if self.parent_version is not None and self.parent_version <= 0:
            raise ValueError(f"parent_version must be a version id, got {self.parent_version}")
        object.__setattr__(self, "status", PartitionStatus(self.status))
        if self.created_at is not None and self.created_at.tzinfo is None:
            raise ValueError("created_at must be timezone-aware")

    @property
    def k(self) -> int:
        """Number of workers (slots)."""
        return len(self.workers)

    @property
    def num_centroids(self) -> int:
        return int(self.centroids.shape[0])

    @property
    def dim(self) -> int:
        return int(self.centroids.shape[1])


@dataclass(frozen=True)
class VersionInfo:
    """A partition version without its arrays, for listings."""

    version: int
    model: str
    status: PartitionStatus
    created_at: datetime
    k: int
    num_centroids: int
    dim: int
    transform: str
    n_train: int
    seed: int
    parent_version: int | None
    note: str
    blob_sha256: str
    metrics: Mapping[str, Any]


def _check_text(name: str, value: str, max_chars: int) -> None:
    if not value or len(value) > max_chars:
        raise ValueError(f"{name} must be 1..{max_chars} characters, got {value!r}")


def _read_only(array: np.ndarray) -> np.ndarray:
    array.setflags(write=False)
    return array


def _float_array(name: str, value: np.ndarray, dtype: np.dtype) -> np.ndarray:
    array = np.asarray(value)
    if not np.issubdtype(array.dtype, np.floating):
        raise ValueError(f"{name} must be a float array, got {array.dtype}")
    # A private copy: the record must not change when the caller reuses its buffer.
    array = np.array(array, dtype=dtype, order="C", copy=True)
    if not np.isfinite(array).all():
        raise ValueError(f"{name} contains NaN or inf")
    return _read_only(array)


# --- array <-> bytes ------------------------------------------------------------------------


def _to_npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    # Little-endian on disk whatever the host, so a blob reads the same everywhere.
    np.save(buffer, np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")))
    return buffer.getvalue()


def _from_npy(data: bytes, *, version: int, name: str, dtype: np.dtype) -> np.ndarray:
    try:
        array = np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, EOFError, OSError) as exc:
        raise CorruptVersionError(f"version {version}: {name} is not valid .npy: {exc}") from exc
    if array.dtype != dtype:
        raise CorruptVersionError(f"version {version}: {name} is {array.dtype}, expected {dtype}")
    return _read_only(array.astype(dtype, copy=False))


def _to_row(record: PartitionRecord) -> PartitionVersion:
    row = PartitionVersion(
        model=record.model,
        status=PartitionStatus.CANDIDATE.value,
        k=record.k,
        num_centroids=record.num_centroids,
        dim=record.dim,
        transform=record.transform,
        num_moe_layers=record.num_moe_layers,
        num_experts=record.num_experts,
        seed=record.seed,
        n_train=record.n_train,
        centroids=_to_npy(record.centroids),
        owners=list(record.owners),
        workers=list(record.workers),
        idf=None if record.idf is None else _to_npy(record.idf),
        layer_mask=_to_npy(record.layer_mask),
        metrics=dict(record.metrics),
        parent_version=record.parent_version,
        note=record.note,
        blob_sha256=record.blob_sha256,
    )
    if record.created_at is not None:
        row.created_at = record.created_at
    return row


def _from_row(row: PartitionVersion) -> PartitionRecord:
    centroids = _from_npy(row.centroids, version=row.id, name="centroids", dtype=CENTROID_DTYPE)
    if centroids.shape != (row.num_centroids, row.dim):
        raise CorruptVersionError(
            f"version {row.id}: centroids are {centroids.shape}, "
            f"row says ({row.num_centroids}, {row.dim})"
        )
    record = PartitionRecord(
        model=row.model,
        transform=row.transform,
        num_moe_layers=row.num_moe_layers,
        num_experts=row.num_experts,
        seed=row.seed,
        n_train=row.n_train,
        centroids=centroids,
        owners=tuple(row.owners),
        workers=tuple(row.workers),
        layer_mask=_from_npy(
            row.layer_mask, version=row.id, name="layer_mask", dtype=LAYER_MASK_DTYPE
        ),
        blob_sha256=row.blob_sha256,
        idf=None
        if row.idf is None
        else _from_npy(row.idf, version=row.id, name="idf", dtype=IDF_DTYPE),
        metrics=row.metrics,
        parent_version=row.parent_version,
        note=row.note,
        version=row.id,
        status=PartitionStatus(row.status),
        created_at=row.created_at,
    )
    if record.k != row.k:
        raise CorruptVersionError(f"version {row.id}: {record.k} workers, row says k={row.k}")
    return record


# --- repository functions -------------------------------------------------------------------


def create_version(session: Session, record: PartitionRecord) -> int:
    """Store `record` as a new candidate version and return its version number."""
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
    """Newest first, without arrays; all models when `model` is None."""
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
        pv.transform,
        pv.n_train,
        pv.seed,
        pv.parent_version,
        pv.note,
        pv.blob_sha256,
        pv.metrics,
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
            transform=row.transform,
            n_train=row.n_train,
            seed=row.seed,
            parent_version=row.parent_version,
            note=row.note,
            blob_sha256=row.blob_sha256,
            metrics=MappingProxyType(dict(row.metrics)),
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
