"""Shared fixtures: one real nats-server (JetStream) per test session, a unique namespace
per test, connected `Bus` objects, and a throwaway PostgreSQL database.

The server starts lazily, on the first test that asks for it, so unit tests never open a
socket. Each test gets its own namespace, hence its own streams and subjects; the
streams are deleted when the test ends.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest
from prometheus_client import CollectorRegistry
from sqlalchemy import URL, Engine, create_engine, make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.pool import NullPool

from eldr.bus import Bus, Topology, build_topology, delete_topology
from eldr.dev.natsserver import EmbeddedNats
from eldr.settings import BusSettings, RetentionSettings
from support.prereq import missing

BusFactory = Callable[..., Awaitable[Bus]]


@pytest.fixture(scope="session")
def nats_server() -> Iterator[EmbeddedNats]:
    """A nats-server with JetStream on a free port and a temporary store directory."""
    with EmbeddedNats() as server:
        yield server


@pytest.fixture
def namespace() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def bus_settings(nats_server: EmbeddedNats, namespace: str) -> BusSettings:
    """Settings for the session server and this test's namespace, with short timeouts."""
    return BusSettings(
        nats_url=nats_server.url,
        namespace=namespace,
        fetch_timeout_s=0.2,
        reconnect_wait_s=0.1,
        request_timeout_s=2.0,
        drain_timeout_s=10.0,
    )


@pytest.fixture
def retention() -> RetentionSettings:
    """Small limits: JetStream reserves each stream's max_bytes in the server's store."""
    mib = 1 << 20
    return RetentionSettings(
        blocks_max_bytes=16 * mib,
        prefill_max_bytes=16 * mib,
        decisions_max_bytes=16 * mib,
        load_max_bytes=16 * mib,
        profiles_max_bytes=16 * mib,
        finished_max_bytes=16 * mib,
        partitions_max_bytes=64 * mib,
        dlq_max_bytes=16 * mib,
        router_ack_wait_s=5.0,
        router_max_deliver=3,
    )


@pytest.fixture
def topology(namespace: str, retention: RetentionSettings) -> Topology:
    return build_topology(namespace, retention)


@pytest.fixture
async def bus_factory(bus_settings: BusSettings, topology: Topology) -> AsyncIterator[BusFactory]:
    """Connect extra buses (`await bus_factory(name, registry=...)`); all are drained at
    the end of the test, then the namespace's streams are deleted."""
    buses: list[Bus] = []

    async def connect(
        name: str = "test",
        *,
        registry: CollectorRegistry | None = None,
        settings: BusSettings | None = None,
    ) -> Bus:
        bus = await Bus.connect(settings or bus_settings, name, registry=registry)
        buses.append(bus)
        return bus

    yield connect
    for bus in buses:
        await bus.drain()
    cleaner = await Bus.connect(bus_settings, "cleanup")
    await delete_topology(cleaner, topology)
    await cleaner.drain()


@pytest.fixture
async def bus(bus_factory: BusFactory) -> Bus:
    return await bus_factory("test")


# --- PostgreSQL ---------------------------------------------------------------------------
# `pg_url` is the URL of a database created for this test session (`eldr_test_<hex>`) and
# dropped at its end, on the server named by ELDR_TEST_PG_URL (default
# postgresql+psycopg://postgres@127.0.0.1:5432/test; that database is only used to issue
# CREATE/DROP DATABASE, never written to). When the server cannot be reached, tests that use
# the fixture skip with the reason, or fail when ELDR_TEST_REQUIRE_PG=1 (set in .ci/run,
# where PostgreSQL must be there).

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
        missing(REQUIRE_PG_ENV, reason)
    finally:
        engine.dispose()
    return url


@contextlib.contextmanager
def _throwaway_database(server: URL) -> Iterator[str]:
    name = f"eldr_test_{secrets.token_hex(6)}"
    engine = _admin_engine(server)
    try:
        with engine.connect() as connection:
            connection.exec_driver_sql(f'CREATE DATABASE "{name}"')
        yield server.set(database=name).render_as_string(hide_password=False)
    finally:
        with engine.connect() as connection:
            # FORCE (PostgreSQL >= 13) ends sessions a test left open instead of failing.
            connection.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        engine.dispose()


@pytest.fixture(scope="session")
def pg_url(pg_server_url: URL) -> Iterator[str]:
    """URL (with password, if any) of a fresh database, dropped at the end of the session."""
    with _throwaway_database(pg_server_url) as url:
        yield url


@pytest.fixture(scope="module")
def module_pg_url(pg_server_url: URL) -> Iterator[str]:
    """Like `pg_url`, but a database of this test module's own (for tests that count
    partition versions from 1)."""
    with _throwaway_database(pg_server_url) as url:
        yield url
