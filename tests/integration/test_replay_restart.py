"""Ordered replays survive a nats-server restart, including replays that started at a
time (the trainer's): nats-py re-creates the lost consumer from the last sequence seen."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest

from eldr.bus import Bus, Delivery, apply_topology, build_topology
from eldr.dev.natsserver import EmbeddedNats
from eldr.settings import BusSettings, RetentionSettings
from eldr.wire import LoadReport

pytestmark = pytest.mark.integration


def report(seq: int) -> LoadReport:
    return LoadReport(
        worker_id="w0",
        incarnation="i",
        seq=seq,
        ts_s=time.time(),
        running=0,
        waiting=0,
        kv_tokens=0,
        kv_capacity_tokens=1,
        admitted=[],
    )


@pytest.mark.parametrize("from_time", [False, True])
async def test_a_replay_resumes_after_the_server_restarts(tmp_path: Path, from_time: bool) -> None:
    namespace = f"r{uuid.uuid4().hex[:10]}"
    async with EmbeddedNats(store_dir=tmp_path / "store") as server:
        settings = BusSettings(
            nats_url=server.url,
            namespace=namespace,
            reconnect_wait_s=0.1,
            replay_heartbeat_s=0.5,
            request_timeout_s=2.0,
        )
        retention = RetentionSettings(
            **{f"{s}_max_bytes": 1 << 20 for s in ("blocks", "prefill", "decisions", "load")},
            profiles_max_bytes=1 << 20,
            finished_max_bytes=1 << 20,
            dlq_max_bytes=1 << 20,
            partitions_max_bytes=1 << 20,
        )
        bus = await Bus.connect(settings, "replayer")
        await apply_topology(bus, build_topology(namespace, retention))
        seen: list[int] = []

        async def on_report(msg: LoadReport, _: Delivery) -> None:
            seen.append(msg.seq)

        await bus.publish(bus.subjects.load("w0"), report(1))
        await bus.flush()
        reader = await bus.read_back(
            f"{namespace.upper()}_LOAD",
            bus.subjects.load_all,
            LoadReport,
            on_report,
            start_time_s=time.time() - 60 if from_time else None,
        )
        await reader.wait_caught_up(5)
        await asyncio.to_thread(server.kill)
        await asyncio.to_thread(server.start)
        deadline = time.monotonic() + 15
        while 99 not in seen and time.monotonic() < deadline:
            if bus.is_connected:
                await bus.publish(bus.subjects.load("w0"), report(99))
            await asyncio.sleep(0.5)
        await bus.close()
    assert seen[0] == 1
    assert 99 in seen, f"the replay stopped after the restart (saw {seen})"
