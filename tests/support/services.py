"""Running an ELDR service in-process for a test."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from eldr.runtime import run_service


@asynccontextmanager
async def running_service(
    name: str,
    settings: Any,
    setup: Any,
    *,
    ready_timeout_s: float = 20.0,
    stop_timeout_s: float = 20.0,
) -> AsyncIterator[None]:
    """Run service `name` (`run_service` with its `setup`) in this event loop, ready when
    the block starts; stopped (and its exit awaited) when the block ends."""
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(
        run_service(name, settings, setup, stop=stop, ready=ready, install_signal_handlers=False)
    )
    try:
        await asyncio.wait_for(ready.wait(), ready_timeout_s)
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, stop_timeout_s)
