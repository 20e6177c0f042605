"""Run and check the Alembic migrations from Python (and from `eldr db`).

The Alembic environment lives in `migrations/` at the repository root, next to
`alembic.ini`. It is not part of the installed package: these functions find it relative
to this file, which works for a source checkout and an editable install (`pip install -e`),
the two ways ELDR runs today. A wheel install has no `migrations/`; point
`ELDR_MIGRATIONS_DIR` at a copy of it (see `migrations_dir`).

`check` is the guard against drift: it compares the models in `eldr.store.models` with
the schema that the migrations produced, using Alembic's autogenerate comparison.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import URL, make_url
from sqlalchemy.pool import NullPool
from sqlalchemy.schema import Column, Constraint, Index, Table

from eldr.store.models import Base
from eldr.store.repo import make_engine
from eldr.store.settings import StoreSettings

log = logging.getLogger(__name__)

# libs/eldr/store/migrate.py -> the repository root is three directories above `eldr/`.
REPO_ROOT = Path(__file__).resolve().parents[3]


def migrations_dir() -> Path:
    """The Alembic script directory: `$ELDR_MIGRATIONS_DIR`, else `<repo>/migrations`."""
    override = StoreSettings().migrations_dir
    path = override if override is not None else REPO_ROOT / "migrations"
    if not (path / "env.py").is_file():
        raise FileNotFoundError(
            f"no Alembic environment at {path} (migrations/ is not installed with the "
            f"package; run from a source checkout or set ELDR_MIGRATIONS_DIR)"
        )
    return path


def _url_string(url: str | URL) -> str:
    return make_url(url).render_as_string(hide_password=False)


def alembic_config(url: str | URL) -> Config:
    """An Alembic `Config` for `url`, without reading `alembic.ini` (or its logging setup)."""
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    # ConfigParser interpolation: a URL-encoded password contains '%'.
    config.set_main_option("sqlalchemy.url", _url_string(url).replace("%", "%%"))
    return config


def upgrade(url: str | URL, revision: str = "head") -> None:
    """Migrate the database at `url` up to `revision` (creating an SQLite file if needed)."""
    log.info("upgrading database %s to %s", make_url(url), revision)
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str | URL, revision: str) -> None:
    """Migrate the database at `url` down to `revision` ("base" removes every table)."""
    log.info("downgrading database %s to %s", make_url(url), revision)
    command.downgrade(alembic_config(url), revision)


def head_revision() -> str | None:
    return ScriptDirectory(str(migrations_dir())).get_current_head()


def current_revision(url: str | URL) -> str | None:
    engine = make_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()


def check(url: str | URL) -> list[str]:
    """Differences between the models and the database at `url`; empty when they agree.

    Reports a database that is not at the head revision, then every difference Alembic's
    autogenerate finds (tables, columns, types, nullability, indexes, unique and foreign
    key constraints). Alembic does not compare CHECK constraints or partial-index WHERE
    clauses; the integration tests cover those by behaviour.
    """
    head = head_revision()
    engine = make_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"compare_type": True})
            problems: list[str] = []
            current = context.get_current_revision()
            if current != head:
                problems.append(f"database is at revision {current or '<none>'}, head is {head}")
            problems.extend(_describe(diff) for diff in compare_metadata(context, Base.metadata))
            return problems
    finally:
        engine.dispose()


def _describe(diff: Any) -> str:
    # compare_metadata yields tuples like ("add_table", Table) and, for column changes,
    # lists of ("modify_type", schema, table, column, info, old, new) tuples.
    if isinstance(diff, list):
        return "; ".join(_describe(part) for part in diff)
    op, *details = diff
    if op.startswith("modify_") and len(details) == 6:
        _schema, table, column, _info, in_database, in_models = details
        return f"{op}: {table}.{column}: database has {in_database!r}, models say {in_models!r}"
    return f"{op}: " + ", ".join(_name(detail) for detail in details if detail is not None)


def _name(item: Any) -> str:
    if isinstance(item, Table):
        return f"table {item.name}"
    if isinstance(item, Column):
        return f"column {item.table.name}.{item.name}" if item.table is not None else item.name
    if isinstance(item, Index):
        columns = ", ".join(str(c) for c in _index_columns(item))
        return f"index {item.name} ({columns})"
    if isinstance(item, Constraint):
        return f"constraint {item.name} ({type(item).__name__})"
    if isinstance(item, dict):
        return ", ".join(f"{key}={value!r}" for key, value in item.items())
    return repr(item)


def _index_columns(index: Index) -> Iterable[Any]:
    return [getattr(expr, "name", expr) for expr in index.expressions]
