"""A gateway between stand-in vLLM servers, with a real nats-server and router (the tests
of `eldr_services.gateway` in tests/integration).

`StandInVllm` is a test double of a vLLM OpenAI server, not vLLM: as a prefill instance it
answers with `kv_transfer_params` and publishes the `PrefillDone` the capture plugin would
(request id and reply inbox from `vllm_xargs`); as a decode instance it answers (or
streams) a completion derived from the prompt and records what it was sent, and can fail,
stall or die mid-stream on demand. Real vLLM runs in tests/vllm (`make test-vllm`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import aiohttp
from aiohttp import web

from eldr.bus import Bus, Delivery
from eldr.bus.topology import DECISIONS
from eldr.settings import BusSettings, RetentionSettings
from eldr.wire import CaptureStatus, Decision, LoadReport, PrefillDone, RequestFinished
from eldr_services.gateway.service import setup as gateway_setup
from eldr_services.gateway.settings import GatewaySettings
from eldr_services.router.service import setup as router_setup
from eldr_services.router.settings import RouterSettings
from support.services import running_service


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class StandInVllm:
    """Test double of one vLLM OpenAI server (see the module docstring)."""

    def __init__(self, name: str, bus: Bus | None = None, failures: list[int] | None = None):
        self.name = name
        self.bus = bus
        self.failures = failures if failures is not None else [0]
        """Decode requests still to fail with a 500 (a list shared between instances)."""
        self.publish_prefill_done = True
        self.stream_pieces = 2
        """Chunks a streamed answer is cut into (one every `stream_gap_s`)."""
        self.stream_gap_s = 0.0
        self.break_after: int | None = None
        """Streamed: drop the connection after this many events (an upstream that dies)."""
        self.stall_s = 0.0
        """Wait this long before answering (a slow or hung engine)."""
        self.seen: list[tuple[str, dict[str, Any], str | None]] = []
        self.auth: list[str | None] = []
        """The Authorization header of every request, in order."""
        self.cancelled: list[str | None] = []
        """Request ids whose handler was cancelled: the caller closed the connection (vLLM
        aborts the request then)."""
        self.hung_up = asyncio.Event()
        """Set at the first cancelled handler."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/version", self.version)
        app.router.add_post("/tokenize", self.tokenize)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    async def version(self, _: web.Request) -> web.Response:
        return web.json_response({"version": f"stand-in {self.name}"})

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"tokens": list(range(len(body["prompt"]))), "by": self.name})

    async def handle(self, request: web.Request) -> web.StreamResponse:
        rid = request.headers.get("X-Request-Id")
        try:
            return await self._handle(request, rid)
        except asyncio.CancelledError:
            self.cancelled.append(rid)
            self.hung_up.set()
            raise

    async def _handle(self, request: web.Request, rid: str | None) -> web.StreamResponse:
        body = await request.json()
        self.seen.append((request.path, body, rid))
        self.auth.append(request.headers.get("Authorization"))
        await asyncio.sleep(self.stall_s)
        if body.get("prompt") == "refuse":
            return web.json_response({"error": {"message": "no", "type": "x"}}, status=400)
        kv = body.get("kv_transfer_params") or {}
        if kv.get("do_remote_decode"):
            return await self.prefill(body)
        if self.failures[0] > 0:
            self.failures[0] -= 1
            return web.Response(status=500, text="decode broke")
        text = f"{self.name}:{json.dumps(body.get('prompt') or body.get('messages'))}"
        if not body.get("stream"):
            return web.json_response(
                {
                    "id": "x",
                    "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 7},
                }
            )
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        n = self.stream_pieces
        cut = [len(text) * i // n for i in range(n + 1)]
        for i in range(n):
            if i == self.break_after:
                assert request.transport is not None
                request.transport.abort()  # the engine died mid-stream
                return out
            choice: dict[str, Any] = {"text": text[cut[i] : cut[i + 1]]}
            if i == n - 1:
                choice["finish_reason"] = "stop"
            await out.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            await asyncio.sleep(self.stream_gap_s)
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    async def prefill(self, body: dict[str, Any]) -> web.Response:
        xargs = body["vllm_xargs"]
        if self.bus is not None and self.publish_prefill_done:
            await self.bus.js_publish(
                self.bus.subjects.prefill_done(self.name),
                PrefillDone(
                    request_id=xargs["eldr_request_id"],
                    model="m",
                    prefill_worker=self.name,
                    ts_s=time.time(),
                    block_size=4096,  # the stand-in's prompts are shorter than one block
                    block_hashes=[],
                    n_prompt_tokens=prompt_length(body),
                    partial=None,
                    num_moe_layers=2,
                    num_experts=4,
                    reply_to=xargs["eldr_reply_to"],
                    client_request_id=xargs.get("eldr_client_request_id"),
                ),
            )
        return web.json_response(
            {
                "choices": [{"text": "x"}],
                "kv_transfer_params": {"remote_engine_id": self.name},
                "usage": {"prompt_tokens": 3, "completion_tokens": 1},
            }
        )

    async def say_capture(
        self, state: str, reason: str | None = None, kv_connector: str | None = "NixlConnector"
    ) -> None:
        """Publish the CaptureStatus the plugin in this engine would."""
        assert self.bus is not None
        await self.bus.publish(
            self.bus.subjects.capture(self.name),
            CaptureStatus(
                worker_id=self.name,
                incarnation="stand-in",
                seq=0,
                ts_s=time.time(),
                interval_s=60.0,
                prefill_capture=state,  # type: ignore[arg-type]
                decode_profiles="off",
                reason=reason,
                num_moe_layers=2,
                num_experts=4,
                kv_connector=kv_connector,
            ),
        )


def prompt_length(body: dict[str, Any]) -> int:
    """The stand-in's "prompt tokens": the prompt's length as JSON (so that a decision
    record shows which prompt it was made on)."""
    return len(json.dumps(body.get("prompt") or body.get("messages")))


def service(name: str, settings: Any, setup: Any) -> AbstractAsyncContextManager[None]:
    return running_service(name, settings, setup, stop_timeout_s=30)


@asynccontextmanager
async def load_reports(bus: Bus, workers: list[str]) -> AsyncIterator[None]:
    async def loop() -> None:
        seq = 0
        while True:
            seq += 1
            for w in workers:
                await bus.publish(
                    bus.subjects.load(w),
                    LoadReport(
                        worker_id=w,
                        incarnation="i",
                        seq=seq,
                        ts_s=time.time(),
                        running=0,
                        waiting=0,
                        kv_tokens=0,
                        kv_capacity_tokens=1000,
                        admitted=[],
                    ),
                )
            await asyncio.sleep(0.2)

    task = asyncio.create_task(loop())
    try:
        yield
    finally:
        task.cancel()


class Stack:
    """The stand-ins, the gateway's OpenAI URL and its metrics URL (/healthz, /readyz and
    /metrics, served by the runtime)."""

    def __init__(
        self,
        port: int,
        metrics_port: int,
        bus: Bus,
        prefill: StandInVllm,
        decoders: list[StandInVllm],
    ):
        self.url = f"http://127.0.0.1:{port}"
        self.metrics_url = f"http://127.0.0.1:{metrics_port}"
        self.bus = bus
        self.prefill = prefill
        self.decoders = decoders


@asynccontextmanager
async def gateway_stack(
    bus: Bus,
    bus_settings: BusSettings,
    retention: RetentionSettings,
    **gateway: Any,
) -> AsyncIterator[Stack]:
    """One prefill and two decode stand-ins (publishing on `bus`), a JSQ router and a
    gateway (`gateway`: settings over the defaults here) in front of them."""
    prefill = StandInVllm("prefill-0", bus)
    failures = [0]
    decoders = [
        StandInVllm("decode-0", bus, failures=failures),
        StandInVllm("decode-1", bus, failures=failures),
    ]
    for server in (prefill, *decoders):
        await server.start()
    base = bus_settings.model_dump() | retention.model_dump()
    port, metrics_port = free_port(), free_port()
    settings = GatewaySettings(
        **base,
        **{
            "gateway_host": "127.0.0.1",
            "gateway_port": port,
            "metrics_host": "127.0.0.1",
            "metrics_port": metrics_port,
            "gateway_prefill": f"prefill-0={prefill.url}",
            "gateway_decode": ",".join(f"{d.name}={d.url}" for d in decoders),
            "gateway_decision_timeout_s": 2.0,
            "gateway_health_interval_s": 0.2,
            "instance_id": "gw0",
            **gateway,
        },
    )
    router = RouterSettings(**base, policy="jsq", stale_after_s=2.0)
    try:
        async with (
            load_reports(bus, [d.name for d in decoders]),
            service("router", router, router_setup),
            service("gateway", settings, gateway_setup),
        ):
            yield Stack(port, metrics_port, bus, prefill, decoders)
    finally:
        for server in (prefill, *decoders):
            await server.stop()


async def decision_of(bus: Bus, request_id: str) -> Decision | None:
    stream = f"{bus.settings.namespace.upper()}_{DECISIONS}"
    return await bus.get_last(stream, bus.subjects.decision(request_id), Decision)


async def prefill_done_of(bus: Bus, request_id: str) -> PrefillDone:
    """The PrefillDone recorded for `request_id` (PREFILL stream, any prefill subject)."""
    found: list[PrefillDone] = []
    got = asyncio.Event()

    async def on(msg: PrefillDone, _: Delivery) -> None:
        if msg.request_id == request_id:
            found.append(msg)
            got.set()

    stream = f"{bus.settings.namespace.upper()}_PREFILL"
    reader = await bus.read_back(stream, bus.subjects.prefill_done_all, PrefillDone, on)
    try:
        await asyncio.wait_for(got.wait(), 10)
    finally:
        await reader.stop()
    return found[0]


def decoded_by(stack: Stack, request_id: str) -> list[StandInVllm]:
    return [d for d in stack.decoders if any(rid == request_id for _, _, rid in d.seen)]


def rid_of(resp: aiohttp.ClientResponse) -> str:
    """The gateway's own id of the request (what its records are under)."""
    return resp.headers["X-Eldr-Request-Id"]


class Finishes:
    """Every RequestFinished on the namespace, by request id."""

    def __init__(self) -> None:
        self.events: dict[str, list[tuple[str, RequestFinished]]] = {}
        self.changed = asyncio.Event()

    async def on(self, msg: RequestFinished, delivery: Delivery) -> None:
        self.events.setdefault(msg.request_id, []).append((delivery.subject, msg))
        self.changed.set()

    async def final(self, request_id: str, timeout_s: float = 10.0) -> RequestFinished:
        deadline = time.monotonic() + timeout_s
        while True:
            finals = [m for _, m in self.events.get(request_id, []) if m.reason != "moved"]
            if finals:
                await asyncio.sleep(0.2)  # a second final, if any, would be here by now
                finals = [m for _, m in self.events.get(request_id, []) if m.reason != "moved"]
                assert len(finals) == 1, finals
                return finals[0]
            self.changed.clear()
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"no finish event for {request_id}"
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), remaining)
