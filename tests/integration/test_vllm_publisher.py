"""The capture plugin's background publisher against a real nats-server (no vLLM)."""

from __future__ import annotations

import asyncio
import threading
import time

import nats
import numpy as np
import pytest
from nats.aio.msg import Msg

from eldr.bus import Bus, apply_topology
from eldr.bus import Topology as BusTopology
from eldr.core.workload.trace import ModelGeometry
from eldr.settings import BusSettings
from eldr.vllm.capture import CaptureConfig, CaptureState, StepResult
from eldr.vllm.publisher import BackgroundPublisher
from eldr.wire import BlockSummaryBatch, Message, PrefillDone, decode

pytestmark = pytest.mark.integration


def step(rid: str, n: int = 10) -> StepResult:
    state = CaptureState(CaptureConfig("prefill-0", "m", 4, ModelGeometry.of_moe(2, 4, 1)))
    rng = np.random.default_rng(0)
    state.add_request(rid, rng.integers(0, 100, n), 0, 0.0, request_id=rid)
    ids = rng.integers(0, 4, size=(n, 2, 1)).astype(np.int16)
    return state.on_step([rid], [n], np.arange(n), ids, 1.0, time.time())


async def test_steps_are_published_blocks_first_from_a_foreign_thread(
    bus: Bus, bus_settings: BusSettings, topology: BusTopology
) -> None:
    await apply_topology(bus, topology)
    got: list[Message] = []
    both = asyncio.Event()
    kinds: dict[str, type[BlockSummaryBatch] | type[PrefillDone]] = {
        bus.subjects.blocks_all.removesuffix("*"): BlockSummaryBatch,
        bus.subjects.prefill_done_all.removesuffix("*"): PrefillDone,
    }

    async def on_message(msg: Msg) -> None:
        for prefix, kind in kinds.items():
            if msg.subject.startswith(prefix):
                got.append(decode(msg.data, kind))
        if sum(isinstance(m, PrefillDone) for m in got) == 2:
            both.set()

    # One subscription for both subjects: the client runs each subscription's handler in
    # its own task, so only within one is the arrival order the publish order.
    watcher = await nats.connect(bus_settings.nats_url)
    await watcher.subscribe(f"{bus.subjects.namespace}.>", cb=on_message)
    await watcher.flush()
    publisher = BackgroundPublisher(bus_settings, "capture-test", max_queued_steps=8)
    # The engine's thread is not the event loop's: submit from another thread.
    worker = threading.Thread(target=lambda: [publisher.submit(step(r)) for r in ("a", "b")])
    worker.start()
    worker.join()
    await asyncio.wait_for(both.wait(), 20)
    await asyncio.to_thread(publisher.close)
    await watcher.close()
    order = [type(m).__name__ for m in got]
    assert order == ["BlockSummaryBatch", "PrefillDone", "BlockSummaryBatch", "PrefillDone"]
    assert publisher.stats.published_done == 2
    assert publisher.stats.dropped == 0


def test_a_full_queue_drops_without_blocking() -> None:
    unreachable = BusSettings(nats_url="nats://127.0.0.1:9", startup_wait_s=60)
    publisher = BackgroundPublisher(unreachable, "capture-test", max_queued_steps=1)
    started = time.monotonic()
    accepted = [publisher.submit(step(f"r{i}")) for i in range(5)]
    assert time.monotonic() - started < 1.0
    assert accepted[0] is True
    assert publisher.stats.dropped >= 3
    assert publisher.stats.dropped + publisher.stats.submitted == 5
    publisher.close(timeout_s=2.0)
