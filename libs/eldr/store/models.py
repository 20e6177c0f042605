"""SQLAlchemy 2 declarative models for ELDR's persistent state.

One table so far: `partition_versions`. The trainer writes every fit as a new row, a
*version*, and never changes its content afterwards; only `status` and `note` move (a
candidate is activated or rejected, an active version is retired when another one replaces
it). Routers hot-swap by version number (`id`).

These models are the reference that the hand-written Alembic revisions in `migrations/` must
match; `eldr db check` (and the integration tests) compare the two. Change both together.
Callers outside `eldr.store` use `eldr.store.repo` and never touch these classes.
"""

from __future__ import annotations

import enum
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    DateTime,
    Dialect,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    event,
    inspect,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

# Explicit constraint names keep migrations stable across backends: without them PostgreSQL
# and SQLite invent different names, and a later migration could not drop or alter them.
NAMING_CONVENTION: dict[str, str] = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class PartitionStatus(enum.StrEnum):
    """Life cycle of a partition version.

    candidate -> active -> retired, or candidate -> rejected. A retired version may be
    activated again (a rollback); a rejected one may not.
    """

    CANDIDATE = "candidate"
    ACTIVE = "active"
    RETIRED = "retired"
    REJECTED = "rejected"


STATUS_VALUES: tuple[str, ...] = tuple(s.value for s in PartitionStatus)


class UtcDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC timestamp on every backend.

    PostgreSQL keeps the offset (`timestamptz`); SQLite stores text without one, so values
    are normalised to UTC on the way in and marked UTC on the way out.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: pass a timezone-aware one")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


def utc_now() -> datetime:
    return datetime.now(UTC)


class PartitionVersion(Base):
    """One fitted partition version: its blob, and what listings and queries need.

    `blob` is the content: the encoded `eldr.wire.PartitionBlob` exactly as it was (or is
    to be) published to the object store, stamped with this row's `id`; `blob_sha256` is
    the SHA-256 of those bytes, the hash the announcements name. The other columns are not
    in the blob (`status`, `note`, `seed`, `n_train`, `parent_version`, `created_at`) or
    repeat a few numbers from it (`model`, `k`, `num_centroids`, `dim`, `num_moe_layers`,
    `num_experts`) so that the one-active-per-model index, filters and listings need not
    load the blob; `eldr.store.repo` checks them against the blob on the way in and out.
    """

    __tablename__ = "partition_versions"

    # The version number. sqlite_autoincrement: never reuse a number, even after a delete.
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime(), default=utc_now)
    model: Mapped[str] = mapped_column(String(200))
    status: Mapped[str] = mapped_column(String(16), default=PartitionStatus.CANDIDATE.value)
    k: Mapped[int] = mapped_column(Integer)
    num_centroids: Mapped[int] = mapped_column(Integer)
    dim: Mapped[int] = mapped_column(Integer)
    num_moe_layers: Mapped[int] = mapped_column(Integer)
    num_experts: Mapped[int] = mapped_column(Integer)
    # 64-bit: numpy seeds are often wider than a 32-bit INTEGER.
    seed: Mapped[int] = mapped_column(BigInteger)
    n_train: Mapped[int] = mapped_column(Integer)
    parent_version: Mapped[int | None] = mapped_column(ForeignKey("partition_versions.id"))
    note: Mapped[str] = mapped_column(Text, default="")
    blob_sha256: Mapped[str] = mapped_column(String(64))
    blob: Mapped[bytes] = mapped_column(LargeBinary)

    __table_args__ = (
        CheckConstraint(
            "status IN (" + ", ".join(f"'{s}'" for s in STATUS_VALUES) + ")",
            name="status",
        ),
        # At most one active version per model. Partial unique indexes exist on both
        # backends; the WHERE clause must be spelled for each dialect.
        Index(
            "uq_partition_versions_one_active_per_model",
            "model",
            unique=True,
            postgresql_where=text("status = 'active'"),
            sqlite_where=text("status = 'active'"),
        ),
        Index(None, "model", "created_at"),
        {"sqlite_autoincrement": True},
    )

    def __repr__(self) -> str:
        return f"PartitionVersion(id={self.id!r}, model={self.model!r}, status={self.status!r})"


# Columns that may change after insert; everything else is the immutable content of a version.
MUTABLE_COLUMNS: frozenset[str] = frozenset({"status", "note"})


class ImmutableVersionError(RuntimeError):
    """Raised when a flush would change the content of a stored partition version."""


@event.listens_for(PartitionVersion, "before_update")
def _refuse_content_changes(mapper: Any, connection: Any, target: PartitionVersion) -> None:
    # A guard against ORM code that edits a version in place; bulk UPDATE statements bypass
    # mapper events, which is why the repository API offers no such statement.
    state = inspect(target)
    changed = sorted(
        attr.key
        for attr in state.attrs
        if attr.key not in MUTABLE_COLUMNS and attr.history.has_changes()
    )
    if changed:
        raise ImmutableVersionError(
            f"partition version {target.id} is immutable; refused change to {', '.join(changed)}"
        )
