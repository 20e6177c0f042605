"""Partition versions: one row per fitted partition, at most one active per model.

Revision ID: 0001
Revises:
Created: 2025-11-29

Written by hand and reviewed; keep it in step with eldr.store.models (`eldr db check`).
Do not import the models here: a revision describes the schema as it was at this point.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

STATUSES = ("candidate", "active", "retired", "rejected")


def upgrade() -> None:
    op.create_table(
        "partition_versions",
        # The version number; sqlite_autoincrement below keeps SQLite from reusing one.
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("k", sa.Integer(), nullable=False),
        sa.Column("num_centroids", sa.Integer(), nullable=False),
        sa.Column("dim", sa.Integer(), nullable=False),
        sa.Column("transform", sa.String(length=64), nullable=False),
        sa.Column("num_moe_layers", sa.Integer(), nullable=False),
        sa.Column("num_experts", sa.Integer(), nullable=False),
        sa.Column("seed", sa.BigInteger(), nullable=False),
        sa.Column("n_train", sa.Integer(), nullable=False),
        # float32 [num_centroids, dim] as .npy bytes
        sa.Column("centroids", sa.LargeBinary(), nullable=False),
        # centroid -> worker slot
        sa.Column("owners", sa.JSON(), nullable=False),
        # worker ids by slot
        sa.Column("workers", sa.JSON(), nullable=False),
        sa.Column("idf", sa.LargeBinary(), nullable=True),
        sa.Column("layer_mask", sa.LargeBinary(), nullable=False),
        sa.Column("prices", sa.LargeBinary(), nullable=True),
        sa.Column("metrics", sa.JSON(), nullable=False),
        sa.Column("parent_version", sa.Integer(), nullable=True),
        sa.Column("note", sa.Text(), nullable=False),
        sa.Column("blob_sha256", sa.String(length=64), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_partition_versions")),
        sa.ForeignKeyConstraint(
            ["parent_version"],
            ["partition_versions.id"],
            name=op.f("fk_partition_versions_parent_version_partition_versions"),
        ),
        sa.CheckConstraint(
            "status IN (" + ", ".join(f"'{s}'" for s in STATUSES) + ")",
            name=op.f("ck_partition_versions_status"),
        ),
        sqlite_autoincrement=True,
    )
    op.create_index(
        op.f("ix_partition_versions_model_created_at"),
        "partition_versions",
        ["model", "created_at"],
    )
    # At most one active version per model: a partial unique index on both backends.
    op.create_index(
        "uq_partition_versions_one_active_per_model",
        "partition_versions",
        ["model"],
        unique=True,
        postgresql_where=sa.text("status = 'active'"),
        sqlite_where=sa.text("status = 'active'"),
    )


def downgrade() -> None:
    op.drop_index("uq_partition_versions_one_active_per_model", table_name="partition_versions")
    op.drop_index(op.f("ix_partition_versions_model_created_at"), table_name="partition_versions")
    op.drop_table("partition_versions")
