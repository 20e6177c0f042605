"""Drop partition_versions.prices: never written (always NULL), and gone from the blob
(PartitionBlob v2) and the record.

Revision ID: 0002
Revises: 0001
Created: 2026-12-05

Written by hand and reviewed; keep it in step with eldr.store.models (`eldr db check`).
SQLite (3.35 and later) and PostgreSQL both drop a column that no index or constraint
names in place.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.drop_column("partition_versions", "prices")


def downgrade() -> None:
    op.add_column("partition_versions", sa.Column("prices", sa.LargeBinary(), nullable=True))
