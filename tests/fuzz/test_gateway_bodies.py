"""Hostile HTTP bodies against the real gateway (issue 15, finding 9).

The gateway's own aiohttp application (`build_app`) on a local port, with its bus over the
in-memory NATS stand-in (`fakebus.py`) and upstream vLLM addresses where nothing listens
(a request that gets past the body checks ends in a 502 from the gateway, which is fine:
what is tested is what happens before). Before: 64 MiB bodies were accepted (a 60 MiB one
took the process to 457 MiB), there was no prompt limit, a 24 MB token list blocked the
event loop for about a second, deeply nested JSON got a 500, and a client could take as
long as it liked to send its body.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import tracemalloc
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass

import aiohttp
import pytest
from aiohttp import web

from eldr.dev.natsserver import free_port
from eldr.runtime import ServiceContext
from eldr_services.gateway.service import Gateway, build_app
from eldr_services.gateway.settings import GatewaySettings

from .fakebus import fake_bus

pytestmark = pytest.mark.slow

BODY_TIMEOUT_S = 0.5


@dataclass
class Running:
    gateway: Gateway
    url: str
    port: int


@pytest.fixture
async def gateway() -> AsyncIterator[Running]:
    nowhere = f"http://127.0.0.1:{free_port()}"
    settings = GatewaySettings(
        namespace="fuzz",
        instance_id="gw-fuzz",
        gateway_prefill=f"p0={nowhere}",
        gateway_decode=f"d0={nowhere}",
        gateway_body_timeout_s=BODY_TIMEOUT_S,
        gateway_connect_timeout_s=0.5,
        gateway_decision_timeout_s=0.05,
    )
    bus, _, registry = fake_bus("fuzz")
    ctx: ServiceContext[GatewaySettings] = ServiceContext(
        name="gateway",
        settings=settings,
        bus=bus,
        registry=registry,
        stack=AsyncExitStack(),
        stopping=asyncio.Event(),
    )
    async with aiohttp.ClientSession() as session:
        gw = Gateway(ctx, session)
        runner = web.AppRunner(build_app(gw), access_log=None)
        await runner.setup()
        port = free_port()
        site = web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        try:
            yield Running(gw, f"http://127.0.0.1:{port}", port)
        finally:
            await runner.cleanup()


async def post(url: str, data: bytes) -> tuple[int, dict]:
    async with (
        aiohttp.ClientSession() as client,
        client.post(
            url + "/v1/completions", data=data, headers={"Content-Type": "application/json"}
        ) as resp,
    ):
        text = await resp.text()
        try:
            payload = json.loads(text)
        except ValueError:
            payload = {"raw": text}
        return resp.status, payload


def refused(gw: Gateway, reason: str) -> float:
    return float(gw.metrics.refused_bodies.labels(reason)._value.get())


async def test_a_body_over_the_limit_is_refused_before_it_is_read(gateway: Running) -> None:
    limit = gateway.gateway.settings.gateway_max_body_bytes
    body = b'{"prompt": "' + b"x" * (limit + 1024) + b'"}'
    tracemalloc.start()
    try:
        status, payload = await post(gateway.url, body)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    print(f"\n{len(body) / 2**20:.1f} MiB body: {status}; peak allocated {peak / 2**20:.1f} MiB")
    assert status == 413
    assert "larger than" in payload["error"]["message"]
    assert refused(gateway.gateway, "too_large") == 1


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "must be a JSON object"),
        (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
        (
            b'{"model": "m", "prompt": "x", "tools": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
            "nested too deeply",
        ),
        (b'{"prompt": "x", "n": 1', "not JSON"),
        (b"\xff\xfe not utf-8", "not JSON"),
        (b'"just a string"', "must be a JSON object"),
        (b'{"prompt": "x", "stream": "yes"}', "'stream' must be a boolean"),
        (b'{"model": "m"}', "'prompt' is required"),
    ],
    ids=[
        "deep_array",
        "deep_prompt",
        "deep_field",
        "truncated",
        "not_utf8",
        "string",
        "stream",
        "no_prompt",
    ],
)
async def test_malformed_or_deeply_nested_json_is_a_400(
    gateway: Running, body: bytes, why: str
) -> None:
    status, payload = await post(gateway.url, body)
    assert status == 400, payload
    assert why in payload["error"]["message"]


async def test_prompts_over_the_limits_are_a_400(gateway: Running) -> None:
    s = gateway.gateway.settings
    tokens = json.dumps({"prompt": list(range(s.gateway_max_prompt_tokens + 10))}).encode()
    text = json.dumps({"prompt": "x" * (s.gateway_max_prompt_bytes + 10)}).encode()
    chat = json.dumps(
        {"messages": [{"role": "user", "content": "y" * (s.gateway_max_prompt_bytes + 10)}]}
    ).encode()
    for body, why in ((tokens, "token ids"), (text, "bytes"), (chat, "bytes")):
        url = gateway.url + ("/v1/chat/completions" if b"messages" in body else "/v1/completions")
        async with aiohttp.ClientSession() as client, client.post(url, data=body) as resp:
            payload = await resp.json()
        assert resp.status == 400, payload
        assert why in payload["error"]["message"]
    assert refused(gateway.gateway, "invalid") == 3


async def test_a_body_sent_too_slowly_is_a_408(gateway: Running) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\n\r\n" + b'{"prompt": "'
    )
    await writer.drain()
    started = time.monotonic()
    head = await asyncio.wait_for(reader.readline(), timeout=10)
    waited_s = time.monotonic() - started
    writer.close()
    print(f"\nslow body: {head.decode().strip()} after {waited_s:.2f} s")
    assert b" 408 " in head
    assert BODY_TIMEOUT_S <= waited_s < BODY_TIMEOUT_S + 2
    assert refused(gateway.gateway, "timeout") == 1


async def test_the_largest_accepted_prompt_does_not_stall_the_event_loop(gateway: Running) -> None:
    """A prompt of the most token ids allowed goes through the body checks (and on to an
    unreachable prefill: 502) while a ticker measures how late the event loop runs it.
    Before, a 24 MB token list was parsed into Python objects on the loop (about 1 s)."""
    s = gateway.gateway.settings
    body = json.dumps({"model": "m", "prompt": list(range(s.gateway_max_prompt_tokens - 1))})
    lags: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        while not stop.is_set():
            started = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - started - 0.001)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.05)
    lags.clear()
    status, _ = await post(gateway.url, body.encode())
    stop.set()
    await task
    print(
        f"\n{len(body) / 2**20:.1f} MiB body of {s.gateway_max_prompt_tokens - 1:,} token ids: "
        f"{status}; the event loop ran at most {max(lags) * 1e3:.1f} ms late"
    )
    assert status == 502  # past the checks, to the (absent) prefill
    assert max(lags) < 0.25


async def test_random_bodies_never_get_a_500(gateway: Running) -> None:
    rng = random.Random(15)
    pieces = [
        b"{",
        b"}",
        b"[",
        b"]",
        b'"prompt"',
        b":",
        b",",
        b'"x"',
        b"1",
        b"null",
        b"\\",
        b"\xff",
    ]
    statuses: dict[int, int] = {}
    for _ in range(300):
        body = b"".join(rng.choice(pieces) for _ in range(rng.randint(0, 40)))
        status, _ = await post(gateway.url, body)
        statuses[status] = statuses.get(status, 0) + 1
    print(f"\n300 random bodies: {statuses}")
    assert set(statuses) <= {400, 502}
