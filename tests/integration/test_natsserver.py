"""The embedded nats-server: start, restart on the same port and store, clear errors."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from eldr.bus import Bus, apply_topology, build_topology
from eldr.dev import natsserver
from eldr.dev.natsserver import EmbeddedNats, NatsServerError
from eldr.settings import BusSettings, RetentionSettings

pytestmark = pytest.mark.integration


async def test_restart_keeps_port_and_streams(retention: RetentionSettings) -> None:
    async with EmbeddedNats() as server:
        url = server.url
        settings = BusSettings(nats_url=url, namespace="restart")
        bus = await Bus.connect(settings, "before")
        await apply_topology(bus, build_topology("restart", retention))
        await bus.drain()

        server.restart()
        bus = await Bus.connect(settings, "after")
        changes = await apply_topology(bus, build_topology("restart", retention))
        await bus.drain()
    assert server.url == url
    assert {c.action for c in changes} == {"unchanged"}


def test_stop_removes_the_temporary_store() -> None:
    server = EmbeddedNats().start()
    store = server.store_dir
    server.stop()
    assert not store.exists()


def test_a_bad_config_fails_with_the_server_log(tmp_path: Path) -> None:
    config = tmp_path / "bad.conf"
    config.write_text("this is { not a valid config")
    server = EmbeddedNats(config_file=config)
    try:
        with pytest.raises(NatsServerError, match="exited with status") as info:
            server.start()
    finally:
        server.stop()
    assert "Parse error" in str(info.value)


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port another process holds (a listening socket of this test)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def test_a_chosen_port_taken_before_the_server_binds_it_is_chosen_again(
    taken_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    picks = iter([taken_port])  # the first pick is taken by the time the server binds it
    real = natsserver.free_port
    monkeypatch.setattr(
        natsserver, "free_port", lambda host="127.0.0.1": next(picks, None) or real(host)
    )
    server = EmbeddedNats()
    try:
        server.start()
        assert server.port != taken_port
        assert server.running
        assert "address already in use" in server.log_tail()
    finally:
        server.stop()


def test_a_given_port_that_is_taken_fails_with_the_server_log(taken_port: int) -> None:
    server = EmbeddedNats(port=taken_port)
    try:
        with pytest.raises(NatsServerError, match="address already in use"):
            server.start()
    finally:
        server.stop()
    assert server.port == taken_port
