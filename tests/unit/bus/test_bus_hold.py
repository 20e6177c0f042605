"""`eldr.bus.hold_while`: a consumed message held while its handler cannot act yet."""

from __future__ import annotations

import asyncio
import time

import pytest

from eldr.bus import Delivery, hold_while


class UnavailableError(Exception):
    pass


class Attempts:
    """Fails with `UnavailableError` until `ready` is set; counts the tries."""

    def __init__(self) -> None:
        self.ready = False
        self.tries = 0
        self.tried = asyncio.Event()

    def __call__(self) -> str:
        self.tries += 1
        self.tried.set()
        if not self.ready:
            raise UnavailableError("not yet")
        return "done"


def delivery(progress: list[float] | None = None) -> Delivery:
    async def in_progress() -> None:
        if progress is not None:
            progress.append(time.monotonic())

    return Delivery(subject="s", stream="S", stream_seq=1, in_progress=in_progress)


async def test_an_attempt_that_succeeds_at_once_is_not_held() -> None:
    attempts = Attempts()
    attempts.ready = True
    result = await hold_while(
        attempts,
        UnavailableError,
        delivery=delivery(),
        wake=asyncio.Event(),
        hold_s=5.0,
        progress_every_s=1.0,
        stopping=asyncio.Event(),
    )
    assert (result, attempts.tries) == ("done", 1)


async def test_a_wake_up_retries_the_attempt() -> None:
    attempts, wake = Attempts(), asyncio.Event()
    held = asyncio.create_task(
        hold_while(
            attempts,
            UnavailableError,
            delivery=delivery(),
            wake=wake,
            hold_s=30.0,
            progress_every_s=10.0,
            stopping=asyncio.Event(),
        )
    )
    await attempts.tried.wait()
    attempts.ready = True
    wake.set()
    assert await asyncio.wait_for(held, timeout=5.0) == "done"
    assert attempts.tries == 2


async def test_after_hold_s_the_last_failure_is_raised() -> None:
    attempts = Attempts()
    started = time.monotonic()
    with pytest.raises(UnavailableError, match="not yet"):
        await hold_while(
            attempts,
            UnavailableError,
            delivery=delivery(),
            wake=asyncio.Event(),
            hold_s=0.2,
            progress_every_s=10.0,
            stopping=asyncio.Event(),
        )
    assert 0.2 <= time.monotonic() - started < 5.0


async def test_a_stopping_service_gives_up_at_once() -> None:
    stopping = asyncio.Event()
    stopping.set()
    with pytest.raises(UnavailableError):
        await hold_while(
            Attempts(),
            UnavailableError,
            delivery=delivery(),
            wake=asyncio.Event(),
            hold_s=30.0,
            progress_every_s=10.0,
            stopping=stopping,
        )


async def test_a_passed_deadline_ends_the_hold_with_none() -> None:
    attempts = Attempts()
    result = await hold_while(
        attempts,
        UnavailableError,
        delivery=delivery(),
        wake=asyncio.Event(),
        hold_s=30.0,
        progress_every_s=10.0,
        stopping=asyncio.Event(),
        deadline_s=time.time() + 0.1,
    )
    assert result is None
    assert attempts.tries >= 2  # tried again when the deadline came


async def test_a_long_hold_keeps_telling_jetstream_it_is_in_progress() -> None:
    progress: list[float] = []
    with pytest.raises(UnavailableError):
        await hold_while(
            Attempts(),
            UnavailableError,
            delivery=delivery(progress),
            wake=asyncio.Event(),
            hold_s=0.5,
            progress_every_s=0.1,
            stopping=asyncio.Event(),
        )
    assert 3 <= len(progress) <= 5
