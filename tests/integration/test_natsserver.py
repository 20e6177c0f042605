"""The embedded nats-server: start, restart on the same port and store, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from eldr.bus import Bus, apply_topology, build_topology
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
