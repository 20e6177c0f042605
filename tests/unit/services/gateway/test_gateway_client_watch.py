"""`unless_client_leaves` and `eldr.aio.wait_event`: the waits that see a client leave, or
a cancellation arrive, without depending on one cancellation getting through (a real
aiohttp server on localhost)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from eldr.aio import wait_event
from eldr_services.gateway.front import ClientGone, unless_client_leaves

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self) -> None:
        self.url = ""
        self.outcome: list[str] = []
        self.work_cancelled = asyncio.Event()

    async def slow_work(self, seconds: float) -> str:
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            self.work_cancelled.set()
            raise
        return "answer"

    async def handle(self, request: web.Request) -> web.Response:
        seconds = float(request.query["s"])
        try:
            answer = await unless_client_leaves(request, self.slow_work(seconds), poll_s=0.05)
        except ClientGone:
            self.outcome.append("gone")
            raise
        self.outcome.append(answer)
        return web.Response(text=answer)


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    server = Server()
    app = web.Application()
    app.router.add_post("/", server.handle)
    # aiohttp's default: a client that disconnects does not cancel the handler, which is
    # what a lost cancellation leaves behind; only the watch can see the client leave.
    runner = web.AppRunner(app, handler_cancellation=False)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    server.url = f"http://127.0.0.1:{port}/"
    try:
        yield server
    finally:
        await runner.cleanup()


async def test_the_work_is_cancelled_when_the_client_leaves(server: Server) -> None:
    async with aiohttp.ClientSession() as http:
        with pytest.raises(TimeoutError):
            await http.post(server.url, params={"s": "30"}, timeout=aiohttp.ClientTimeout(0.3))
    async with asyncio.timeout(5):
        await server.work_cancelled.wait()
    await asyncio.sleep(0.1)
    assert server.outcome == ["gone"]


async def test_a_client_that_stays_gets_the_answer(server: Server) -> None:
    async with aiohttp.ClientSession() as http:
        resp = await http.post(server.url, params={"s": "0.2"})
        assert await resp.text() == "answer"
    assert server.outcome == ["answer"]
    assert not server.work_cancelled.is_set()


async def test_cancelling_the_wait_cancels_the_work() -> None:
    """The handler's own cancellation (the usual way a hang-up arrives) reaches the work."""
    cancelled = asyncio.Event()

    async def work() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    class Open:  # the connection of a client that stays
        def is_closing(self) -> bool:
            return False

    request: Any = SimpleNamespace(transport=Open())
    waiting = asyncio.create_task(unless_client_leaves(request, work(), poll_s=0.05))
    await asyncio.sleep(0.1)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert cancelled.is_set()


async def test_wait_event_returns_whether_the_event_is_set() -> None:
    event = asyncio.Event()
    assert not await wait_event(event, 0.01)
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await wait_event(event, 5.0)
    assert await wait_event(event, 0.0)  # already set: no wait


async def test_wait_event_keeps_a_cancellation_that_comes_with_the_event() -> None:
    event = asyncio.Event()
    waiting = asyncio.create_task(wait_event(event, 10.0))
    await asyncio.sleep(0)
    event.set()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
