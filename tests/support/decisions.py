"""Reading what the routers committed, for tests."""

from __future__ import annotations

import asyncio

from eldr.bus import Bus, Delivery
from eldr.bus.topology import DECISIONS
from eldr.wire import Decision


async def committed_decision(bus: Bus, rid: str, timeout_s: float = 20.0) -> Decision:
    """The decision committed for request `rid` (read from the DECISIONS stream, waiting up
    to `timeout_s` for it)."""
    got: list[Decision] = []
    done = asyncio.Event()

    async def on(msg: Decision, _: Delivery) -> None:
        if msg.request_id == rid:
            got.append(msg)
            done.set()

    stream = f"{bus.subjects.namespace.upper()}_{DECISIONS}"
    reader = await bus.read_back(stream, bus.subjects.decision(rid), Decision, on)
    try:
        await asyncio.wait_for(done.wait(), timeout_s)
    finally:
        await reader.stop()
    return got[0]
