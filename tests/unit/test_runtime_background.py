"""`ServiceContext.spawn` and `.every`: the one way services run background work."""

from __future__ import annotations

import asyncio
import logging
from contextlib import AsyncExitStack
from typing import Any, cast

import pytest
from prometheus_client import CollectorRegistry

from eldr.bus import Bus
from eldr.runtime import ServiceContext
from eldr.settings import CommonSettings


def context(stack: AsyncExitStack) -> ServiceContext[CommonSettings]:
    return ServiceContext(
        name="svc",
        settings=CommonSettings(),
        bus=cast(Bus, object()),  # not used by the background helpers
        registry=CollectorRegistry(),
        stack=stack,
        stopping=asyncio.Event(),
    )


async def test_every_ticks_at_a_fixed_rate_until_the_service_closes() -> None:
    ticks: list[float] = []
    loop = asyncio.get_running_loop()

    async def tick() -> None:
        ticks.append(loop.time())

    async with AsyncExitStack() as stack:
        ctx = context(stack)
        started = loop.time()
        background = ctx.every("t", 0.05, tick, until="close")
        await asyncio.sleep(0.32)
        ctx.stopping.set()  # "close": the stop signal alone does not end it
        await asyncio.sleep(0.1)
        assert not background.task.done()
    assert background.task.cancelled()
    assert 7 <= len(ticks) <= 10
    assert ticks[0] - started < 0.05  # the first tick comes at once (first_after_s=0)


async def test_every_until_stop_ends_at_the_stop_signal() -> None:
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        ticks += 1

    async with AsyncExitStack() as stack:
        ctx = context(stack)
        background = ctx.every("t", 10.0, tick, first_after_s=10.0, until="stop")
        await asyncio.sleep(0.01)
        ctx.stopping.set()
        await asyncio.wait_for(background.task, timeout=1.0)
    assert ticks == 0


async def test_a_failing_tick_is_logged_and_the_next_one_comes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ticks = 0
    third = asyncio.Event()

    async def tick() -> None:
        nonlocal ticks
        ticks += 1
        if ticks == 1:
            raise RuntimeError("first tick fails")
        if ticks == 3:
            third.set()

    async with AsyncExitStack() as stack:
        ctx = context(stack)
        ctx.set_ready()
        with caplog.at_level(logging.ERROR, logger="eldr.runtime"):
            ctx.every("t", 0.01, tick, until="close")
            await asyncio.wait_for(third.wait(), timeout=5.0)
        assert ctx.ready_event.is_set()
    assert "svc: t failed" in caplog.text
    assert "first tick fails" in caplog.text


async def test_a_crashed_task_is_logged_and_the_service_is_not_ready(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def work() -> None:
        raise RuntimeError("boom")

    async with AsyncExitStack() as stack:
        ctx = context(stack)
        ctx.set_ready()
        with caplog.at_level(logging.ERROR, logger="eldr.runtime"):
            background = ctx.spawn("w", work)
            await background.wait()
            await asyncio.sleep(0)  # the done callback runs
        assert not ctx.ready_event.is_set()
    assert "background task w failed" in caplog.text


async def test_stop_cancels_and_waits_and_closing_stops_what_is_left() -> None:
    started = asyncio.Event()
    ended: list[str] = []

    def forever(name: str) -> Any:
        async def work() -> None:
            started.set()
            try:
                await asyncio.Event().wait()
            finally:
                ended.append(name)

        return work

    async with AsyncExitStack() as stack:
        ctx = context(stack)
        first = ctx.spawn("first", forever("first"))
        ctx.spawn("second", forever("second"))
        await started.wait()
        await first.stop()
        assert ended == ["first"]
        await first.stop()  # idempotent
    assert sorted(ended) == ["first", "second"]
