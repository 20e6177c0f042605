"""Shared fixtures: one real nats-server (JetStream) per test session, a unique namespace
per test, and connected `Bus` objects.

The server starts lazily, on the first test that asks for it, so unit tests never open a
socket. Each test gets its own namespace, hence its own streams and subjects; the
streams are deleted when the test ends.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest
from prometheus_client import CollectorRegistry

from eldr.bus import Bus, Topology, build_topology, delete_topology
from eldr.dev.natsserver import EmbeddedNats
from eldr.settings import BusSettings, RetentionSettings

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
