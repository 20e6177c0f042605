"""Alembic environment for ELDR's database.

The URL comes from the Alembic config's `sqlalchemy.url` when a caller sets it
(`eldr.store.migrate`, tests, `alembic -x`-less scripts), otherwise from the settings
(`ELDR_DATABASE_URL`, default `sqlite:///.eldr/eldr.db`). `alembic.ini` deliberately leaves
`sqlalchemy.url` unset so that `alembic upgrade head` at the repository root follows the
settings too.

Revisions are written by hand and reviewed; `eldr db check` verifies that they produce the
schema described by `eldr.store.models`.
"""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context
from sqlalchemy import make_url
from sqlalchemy.pool import NullPool

from eldr.store.models import Base
from eldr.store.repo import make_engine
from eldr.store.settings import StoreSettings

config = context.config

# Only the `alembic` command line reads an ini file; the Python API leaves logging alone.
if config.config_file_name is not None:
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata


def database_url() -> str:
    return config.get_main_option("sqlalchemy.url") or StoreSettings().database_url


def run_migrations_offline() -> None:
    """Emit SQL to stdout (`alembic upgrade head --sql`) instead of connecting."""
    url = database_url()
    context.configure(
        url=url,
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
        render_as_batch=make_url(url).get_backend_name() == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = make_engine(database_url(), poolclass=NullPool)
    try:
        with engine.connect() as connection:
            is_sqlite = connection.dialect.name == "sqlite"
            if is_sqlite:
                # Batch migrations rebuild a table (copy, drop, rename); with foreign keys
                # enforced, dropping the old table would check or cascade references.
                connection.exec_driver_sql("PRAGMA foreign_keys = OFF")
                connection.commit()
            context.configure(
                connection=connection,
                target_metadata=target_metadata,
                compare_type=True,
                # SQLite cannot ALTER most things; batch mode recreates the table instead.
                render_as_batch=is_sqlite,
            )
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
