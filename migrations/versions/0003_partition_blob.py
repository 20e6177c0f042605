"""Partition versions store their blob: the encoded `PartitionBlob` becomes the one stored
content of a version, and the columns that duplicated it go.

Revision ID: 0003
Revises: 0002
Created: 2026-12-12

Written by hand and reviewed; keep it in step with eldr.store.models (`eldr db check`).

Upgrade: adds `blob` and fills it, row by row, with the blob the trainer published for the
row: the row's columns encoded as a `PartitionBlob` stamped with the row's id. The SHA-256
of those bytes must equal the row's `blob_sha256`. A row stored before PartitionBlob v2
holds the hash of its v1 blob (`prices` nil after `workers`, `v` last: the layout that
`eldr.partitions.writer._v1_sha256` reproduced at revision 0002); such a row gets those v1
bytes, exactly what was announced for it. If any row matches neither encoding, nothing is
changed and the upgrade fails naming the rows: no hash is overwritten. Then `transform`,
`centroids`, `owners`, `workers`, `idf`, `layer_mask` and `metrics` are dropped (the blob
holds them). Downgrade decodes each blob back into those columns (`idf` flat
[num_moe_layers * num_experts], as the trainer stored it) and drops `blob`.

The encoder and decoder are this file's own, from the columns and plain msgspec, not
eldr.wire or eldr.partitions: a revision must keep producing the bytes of its time when the
application's blob schema moves on. tests/integration/test_store.py checks that they agree
byte for byte with `eldr.wire.encode` at this revision.

SQLite cannot make a column NOT NULL in place; there the table is rebuilt (batch mode) from
the explicit definition below rather than by reflection, which would lose AUTOINCREMENT and
the partial index's WHERE clause, and the AUTOINCREMENT counter is carried over.
"""

from __future__ import annotations

import hashlib
import io
import math
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec
import numpy as np
import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLE = "partition_versions"
STATUSES = ("candidate", "active", "retired", "rejected")

# The columns the blob holds, with their definitions at revision 0002.
CONTENT_COLUMNS: tuple[tuple[str, sa.types.TypeEngine[Any], bool], ...] = (
    ("transform", sa.String(length=64), False),
    ("centroids", sa.LargeBinary(), False),
    ("owners", sa.JSON(), False),
    ("workers", sa.JSON(), False),
    ("idf", sa.LargeBinary(), True),
    ("layer_mask", sa.LargeBinary(), False),
    ("metrics", sa.JSON(), False),
)

MAX_REPORTED_ROWS = 20


# --- the schema, spelled out for SQLite's table rebuild ----------------------------------


def _table(*extra: sa.Column[Any]) -> sa.Table:
    """partition_versions with the columns that 0002 and 0003 share, plus `extra`."""
    return sa.Table(
        TABLE,
        sa.MetaData(),
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("k", sa.Integer(), nullable=False),
        sa.Column("num_centroids", sa.Integer(), nullable=False),
        sa.Column("dim", sa.Integer(), nullable=False),
        sa.Column("num_moe_layers", sa.Integer(), nullable=False),
        sa.Column("num_experts", sa.Integer(), nullable=False),
        sa.Column("seed", sa.BigInteger(), nullable=False),
        sa.Column("n_train", sa.Integer(), nullable=False),
        sa.Column("parent_version", sa.Integer(), nullable=True),
        sa.Column("note", sa.Text(), nullable=False),
        sa.Column("blob_sha256", sa.String(length=64), nullable=False),
        *extra,
        sa.PrimaryKeyConstraint("id", name="pk_partition_versions"),
        sa.ForeignKeyConstraint(
            ["parent_version"],
            [f"{TABLE}.id"],
            name="fk_partition_versions_parent_version_partition_versions",
        ),
        sa.CheckConstraint(
            "status IN (" + ", ".join(f"'{s}'" for s in STATUSES) + ")",
            name="ck_partition_versions_status",
        ),
        sa.Index("ix_partition_versions_model_created_at", "model", "created_at"),
        sa.Index(
            "uq_partition_versions_one_active_per_model",
            "model",
            unique=True,
            postgresql_where=sa.text("status = 'active'"),
            sqlite_where=sa.text("status = 'active'"),
        ),
        sqlite_autoincrement=True,
    )


def _content_columns(*, nullable: bool) -> list[sa.Column[Any]]:
    return [
        sa.Column(name, type_, nullable=nullable or null_ok)
        for name, type_, null_ok in CONTENT_COLUMNS
    ]


# --- the blob, from the columns and back -------------------------------------------------


def _from_npy(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


def _to_npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")))
    return buffer.getvalue()


def _ndarray(array: np.ndarray, dtype: str) -> dict[str, Any]:
    """An eldr.wire NdArray: dtype name, shape, little-endian C-order bytes."""
    wire = np.ascontiguousarray(array, dtype=np.dtype(dtype).newbyteorder("<"))
    return {"dtype": dtype, "shape": [int(d) for d in wire.shape], "data": wire.tobytes()}


def _blob_v2(row: Any) -> dict[str, Any]:
    """The fields of the PartitionBlob v2 for `row`, in the order msgspec encodes them."""
    n_layers, n_experts = int(row.num_moe_layers), int(row.num_experts)
    idf = None
    if row.idf is not None:
        idf = _ndarray(
            _from_npy(row.idf).astype(np.float32).reshape(n_layers, n_experts), "float32"
        )
    return {
        "kind": "partition_blob",
        "v": 2,
        "version": int(row.id),
        "model": row.model,
        "transform": row.transform,
        "num_moe_layers": n_layers,
        "num_experts": n_experts,
        "idf": idf,
        "layer_mask": _ndarray(_from_npy(row.layer_mask).astype(np.uint8), "uint8"),
        "centroids": _ndarray(_from_npy(row.centroids), "float32"),
        "owners": [int(o) for o in row.owners],
        "workers": [str(w) for w in row.workers],
        "metrics": {k: float(v) for k, v in row.metrics.items() if math.isfinite(float(v))},
        "projection": None,
        "projection_mean": None,
    }


def _blob_v1(v2: dict[str, Any]) -> dict[str, Any]:
    """The same content as PartitionBlob v1: `prices` (nil) after `workers`, `v` last."""
    v1: dict[str, Any] = {}
    for key, value in v2.items():
        if key != "v":
            v1[key] = value
        if key == "workers":
            v1["prices"] = None
    v1["v"] = 1
    return v1


def _encode_row(row: Any) -> bytes:
    """The bytes whose SHA-256 the row holds; ValueError naming the hashes if none match."""
    try:
        v2 = _blob_v2(row)
    except (ValueError, TypeError, KeyError, OSError) as exc:
        raise ValueError(f"version {row.id}: its columns do not make a blob: {exc}") from exc
    candidates = [msgspec.msgpack.encode(v2), msgspec.msgpack.encode(_blob_v1(v2))]
    hashes = [hashlib.sha256(data).hexdigest() for data in candidates]
    for data, sha in zip(candidates, hashes, strict=True):
        if sha == row.blob_sha256:
            return data
    raise ValueError(
        f"version {row.id}: the row says blob_sha256 {row.blob_sha256}; its columns encode "
        f"to {hashes[0]} (PartitionBlob v2) and {hashes[1]} (v1)"
    )


def _columns_from_blob(data: bytes) -> dict[str, Any]:
    """The content columns (revision 0002) of a stored v1 or v2 blob."""
    fields = msgspec.msgpack.decode(data)

    def array(name: str) -> np.ndarray:
        wire = fields[name]
        dtype = np.dtype(wire["dtype"]).newbyteorder("<")
        return np.frombuffer(wire["data"], dtype=dtype).reshape(wire["shape"])

    idf = None if fields["idf"] is None else _to_npy(array("idf").astype(np.float32).reshape(-1))
    return {
        "transform": fields["transform"],
        "centroids": _to_npy(array("centroids").astype(np.float32)),
        "owners": [int(o) for o in fields["owners"]],
        "workers": [str(w) for w in fields["workers"]],
        "idf": idf,
        "layer_mask": _to_npy(array("layer_mask").astype(np.bool_)),
        "metrics": {str(k): float(v) for k, v in fields["metrics"].items()},
    }


# --- rows ---------------------------------------------------------------------------------

_OLD = sa.table(
    TABLE,
    sa.column("id", sa.Integer()),
    sa.column("model", sa.String()),
    sa.column("num_moe_layers", sa.Integer()),
    sa.column("num_experts", sa.Integer()),
    sa.column("blob_sha256", sa.String()),
    *(sa.column(name, type_) for name, type_, _ in CONTENT_COLUMNS),
)
_NEW = sa.table(TABLE, sa.column("id", sa.Integer()), sa.column("blob", sa.LargeBinary()))


def _ids(connection: sa.Connection) -> list[int]:
    return list(connection.scalars(sa.select(_OLD.c.id).order_by(_OLD.c.id)))


def _old_rows(connection: sa.Connection) -> Iterator[Any]:
    # One row at a time: a blob can be megabytes.
    for version in _ids(connection):
        yield connection.execute(sa.select(_OLD).where(_OLD.c.id == version)).one()


def _require_online() -> None:
    if op.get_context().as_sql:
        raise RuntimeError("revision 0003 rewrites every row; run it on the database, not --sql")


def _sqlite_sequence(connection: sa.Connection) -> int | None:
    exists = connection.scalar(
        sa.text("SELECT count(*) FROM sqlite_master WHERE name = 'sqlite_sequence'")
    )
    if not exists:
        return None
    seq = connection.scalar(sa.text(f"SELECT seq FROM sqlite_sequence WHERE name = '{TABLE}'"))
    return None if seq is None else int(seq)


def _restore_sqlite_sequence(connection: sa.Connection, seq: int | None) -> None:
    """Keep AUTOINCREMENT's high-water mark across the rebuild (it copies rows, so the new
    counter would only reach the largest id still present)."""
    if seq is None:
        return
    current = _sqlite_sequence(connection)
    if current is None:
        connection.execute(
            sa.text(f"INSERT INTO sqlite_sequence (name, seq) VALUES ('{TABLE}', :seq)"),
            {"seq": seq},
        )
    elif current < seq:
        connection.execute(
            sa.text(f"UPDATE sqlite_sequence SET seq = :seq WHERE name = '{TABLE}'"),
            {"seq": seq},
        )


# --- upgrade and downgrade ----------------------------------------------------------------


def upgrade() -> None:
    _require_online()
    connection = op.get_bind()

    # Check every row before changing anything (SQLite's DDL is not transactional here).
    problems: list[str] = []
    for row in _old_rows(connection):
        try:
            _encode_row(row)
        except ValueError as exc:
            problems.append(str(exc))
    if problems:
        shown = problems[:MAX_REPORTED_ROWS]
        more = len(problems) - len(shown)
        raise RuntimeError(
            f"revision 0003 would not reproduce the announced blob of {len(problems)} "
            "partition version(s); nothing was changed:\n  "
            + "\n  ".join(shown)
            + (f"\n  ... and {more} more" if more else "")
        )

    op.add_column(TABLE, sa.Column("blob", sa.LargeBinary(), nullable=True))
    for row in _old_rows(connection):
        connection.execute(sa.update(_NEW).where(_NEW.c.id == row.id).values(blob=_encode_row(row)))

    is_sqlite = connection.dialect.name == "sqlite"
    seq = _sqlite_sequence(connection) if is_sqlite else None
    with op.batch_alter_table(
        TABLE,
        copy_from=_table(*_content_columns(nullable=False), sa.Column("blob", sa.LargeBinary())),
    ) as batch:
        batch.alter_column("blob", existing_type=sa.LargeBinary(), nullable=False)
        for name, _, _ in CONTENT_COLUMNS:
            batch.drop_column(name)
    if is_sqlite:
        _restore_sqlite_sequence(connection, seq)


def downgrade() -> None:
    _require_online()
    connection = op.get_bind()
    for column in _content_columns(nullable=True):
        op.add_column(TABLE, column)
    for version in _ids(connection):
        data = connection.scalar(sa.select(_NEW.c.blob).where(_NEW.c.id == version))
        connection.execute(
            sa.update(_OLD).where(_OLD.c.id == version).values(**_columns_from_blob(data))
        )

    is_sqlite = connection.dialect.name == "sqlite"
    seq = _sqlite_sequence(connection) if is_sqlite else None
    with op.batch_alter_table(
        TABLE,
        copy_from=_table(
            sa.Column("blob", sa.LargeBinary(), nullable=False),
            *_content_columns(nullable=True),
        ),
    ) as batch:
        for name, type_, null_ok in CONTENT_COLUMNS:
            if not null_ok:
                batch.alter_column(name, existing_type=type_, nullable=False)
        batch.drop_column("blob")
    if is_sqlite:
        _restore_sqlite_sequence(connection, seq)
