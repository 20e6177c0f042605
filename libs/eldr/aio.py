"""Waits with a time limit that never lose a cancellation.

Python 3.11's `asyncio.wait_for` returns the awaited result when its caller is cancelled
in the same moment that the result arrives: the cancellation is lost (gh-86296, fixed in
3.12 by building `wait_for` on `asyncio.timeout`). A gateway handler lost its client's
hang-up that way and decoded a whole answer nobody read. `asyncio.timeout` keeps the
cancellation, so the project waits with it (ruff bans `asyncio.wait_for`, TID251):

- `wait_event`: wait for an `asyncio.Event`, at most so long (the stop and wake-up waits);
- for any other awaitable, `async with asyncio.timeout(t): await ...` in place.
"""

from __future__ import annotations

import asyncio
import contextlib


async def wait_event(event: asyncio.Event, timeout_s: float | None) -> bool:
    """Wait until `event` is set, at most `timeout_s` seconds (None: no limit); whether it
    is set. A cancellation of the caller always propagates."""
    if event.is_set():
        return True
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            await event.wait()
    return event.is_set()
