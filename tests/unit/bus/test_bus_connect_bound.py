"""The bound on a first connect: it ends on time even when the connecting coroutine
swallows a cancellation (as nats-py's connect loop can while it closes a failed attempt)."""

from __future__ import annotations

import asyncio
import time

import pytest

from eldr.bus.connection import finish_within, stop_task


class Stubborn:
    """A coroutine that retries forever and swallows the first `swallow` cancellations."""

    def __init__(self, swallow: int) -> None:
        self.swallow = swallow
        self.swallowed = 0

    async def run(self) -> None:
        while True:
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                if self.swallowed >= self.swallow:
                    raise
                self.swallowed += 1


async def test_a_connect_that_swallows_a_cancel_still_ends_on_time() -> None:
    stubborn = Stubborn(swallow=2)
    task = asyncio.ensure_future(stubborn.run())
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await finish_within(task, 0.1)
    assert time.monotonic() - started < 0.5
    assert await stop_task(task, 1.0)
    assert task.cancelled()
    assert stubborn.swallowed == 2  # cancelled again until it gave up
    # asyncio.wait_for would have waited for the first cancel to be honoured: forever.


async def test_a_task_that_never_ends_is_given_up_after_the_grace() -> None:
    stubborn = Stubborn(swallow=10**9)
    task = asyncio.ensure_future(stubborn.run())
    await asyncio.sleep(0.02)  # inside its loop (a task cancelled before it starts just ends)
    started = time.monotonic()
    assert not await stop_task(task, 0.2)
    assert 0.15 < time.monotonic() - started < 1.0
    assert stubborn.swallowed >= 3  # cancelled again every 50 ms
    stubborn.swallow = 0  # the test's own cleanup: the next cancel ends it
    assert await stop_task(task, 1.0)


async def test_a_result_or_an_error_comes_through() -> None:
    async def ok() -> int:
        return 7

    async def fails() -> None:
        raise ConnectionRefusedError("no")

    assert await finish_within(asyncio.ensure_future(ok()), 1.0) == 7
    failing = asyncio.ensure_future(fails())
    with pytest.raises(ConnectionRefusedError):
        await finish_within(failing, 1.0)
    assert await stop_task(failing, 0.1)  # already done; its error retrieved, not raised
