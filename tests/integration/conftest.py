"""Fixtures for integration tests: a throwaway PostgreSQL database.

`pg_url` is the URL of a database created for this test session (`eldr_test_<hex>`) and
dropped at its end, on the server named by ELDR_TEST_PG_URL (default
postgresql+psycopg://postgres@127.0.0.1:5432/test; that database is only used to issue
CREATE/DROP DATABASE, never written to). When the server cannot be reached, tests that use
the fixture skip with the reason, or fail when ELDR_TEST_REQUIRE_PG=1 (set that in CI, where
PostgreSQL must be there).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator

import pytest
from sqlalchemy import URL, Engine, create_engine, make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.pool import NullPool

PG_URL_ENV = "ELDR_TEST_PG_URL"
REQUIRE_PG_ENV = "ELDR_TEST_REQUIRE_PG"
DEFAULT_PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
CONNECT_TIMEOUT_S = 5


def _admin_engine(url: URL) -> Engine:
    # AUTOCOMMIT: CREATE/DROP DATABASE cannot run inside a transaction block.
    return create_engine(
        url,
        isolation_level="AUTOCOMMIT",
        poolclass=NullPool,
        connect_args={"connect_timeout": CONNECT_TIMEOUT_S},
    )


@pytest.fixture(scope="session")
def pg_server_url() -> URL:
    """URL of the maintenance database on a reachable PostgreSQL server."""
    url = make_url(os.environ.get(PG_URL_ENV, DEFAULT_PG_URL))
    engine = _admin_engine(url)
    try:
        with engine.connect() as connection:
            connection.exec_driver_sql("SELECT 1")
    except OperationalError as exc:
        reason = (
            f"PostgreSQL not reachable at {url.render_as_string(hide_password=True)} "
            f"({str(exc.orig).strip().splitlines()[0] if exc.orig else exc}); start a server "
            f"or point {PG_URL_ENV} at one, e.g. {PG_URL_ENV}={DEFAULT_PG_URL}"
        )
        if os.environ.get(REQUIRE_PG_ENV, "") not in ("", "0"):
            pytest.fail(f"{reason} ({REQUIRE_PG_ENV} is set)")
        pytest.skip(reason)
    finally:
        engine.dispose()
    return url


@pytest.fixture(scope="session")
def pg_url(pg_server_url: URL) -> Iterator[str]:
    """URL (with password, if any) of a fresh database, dropped at the end of the session."""
    name = f"eldr_test_{secrets.token_hex(6)}"
    engine = _admin_engine(pg_server_url)
    try:
        with engine.connect() as connection:
            connection.exec_driver_sql(f'CREATE DATABASE "{name}"')
        yield pg_server_url.set(database=name).render_as_string(hide_password=False)
    finally:
        with engine.connect() as connection:
            # FORCE (PostgreSQL >= 13) ends sessions a test left open instead of failing.
            connection.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        engine.dispose()
