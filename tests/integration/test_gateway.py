"""The gateway against a real nats-server and router, with stand-in vLLM servers.

`StandInVllm` is a test double of a vLLM OpenAI server, not vLLM: as a prefill instance it
answers with `kv_transfer_params` and publishes the `PrefillDone` the capture plugin would
(request id and reply inbox from `vllm_xargs`); as a decode instance it answers (or
streams) a completion derived from the prompt and records what it was sent. Real vLLM runs
in tests/vllm (`make test-vllm`).
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
import pytest
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

pytestmark = pytest.mark.integration


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
        self.seen: list[tuple[str, dict[str, Any], str | None]] = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append((request.path, body, request.headers.get("X-Request-Id")))
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

    async def say_capture(self, state: str, reason: str | None = None) -> None:
        """Publish the CaptureStatus the plugin in this (prefill) engine would."""
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
    def __init__(self, port: int, bus: Bus, prefill: StandInVllm, decoders: list[StandInVllm]):
        self.url = f"http://127.0.0.1:{port}"
        self.bus = bus
        self.prefill = prefill
        self.decoders = decoders


@pytest.fixture
def capture_grace_s() -> float:
    return 10.0


@pytest.fixture
async def stack(
    bus_factory: Any,
    bus_settings: BusSettings,
    retention: RetentionSettings,
    capture_grace_s: float,
) -> AsyncIterator[Stack]:
    bus = await bus_factory("stand-ins")
    prefill = StandInVllm("prefill-0", bus)
    failures = [0]
    decoders = [
        StandInVllm("decode-0", failures=failures),
        StandInVllm("decode-1", failures=failures),
    ]
    for server in (prefill, *decoders):
        await server.start()
    base = bus_settings.model_dump() | retention.model_dump()
    port = free_port()
    gateway = GatewaySettings(
        **base,
        gateway_host="127.0.0.1",
        gateway_port=port,
        gateway_prefill=f"prefill-0={prefill.url}",
        gateway_decode=",".join(f"{d.name}={d.url}" for d in decoders),
        gateway_decision_timeout_s=2.0,
        gateway_health_interval_s=0.2,
        gateway_capture_grace_s=capture_grace_s,
        instance_id="gw0",
    )
    router = RouterSettings(**base, policy="jsq", stale_after_s=2.0)
    async with (
        load_reports(bus, [d.name for d in decoders]),
        service("router", router, router_setup),
        service("gateway", gateway, gateway_setup),
    ):
        yield Stack(port, bus, prefill, decoders)
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
    replay = await bus.replay(stream, bus.subjects.prefill_done_all, PrefillDone, on)
    try:
        await asyncio.wait_for(got.wait(), 10)
    finally:
        await replay.stop()
    return found[0]


def decoded_by(stack: Stack, request_id: str) -> list[StandInVllm]:
    return [d for d in stack.decoders if any(rid == request_id for _, _, rid in d.seen)]


def rid_of(resp: aiohttp.ClientResponse) -> str:
    """The gateway's own id of the request (what its records are under)."""
    return resp.headers["X-Eldr-Request-Id"]


async def test_a_completion_goes_prefill_decision_decode_under_its_own_id(stack: Stack) -> None:
    async with aiohttp.ClientSession() as http:
        resp = await http.post(
            stack.url + "/v1/completions",
            json={"prompt": "hello", "max_tokens": 8},
            headers={"X-Request-Id": "client-42"},
        )
        body = await resp.json()
    assert resp.status == 200
    assert resp.headers["X-Request-Id"] == "client-42"
    rid = rid_of(resp)
    assert rid.startswith("eldr-")
    (_prefill_path, prefill_body, prefill_rid) = stack.prefill.seen[0]
    assert prefill_rid == rid
    assert prefill_body["max_tokens"] == 1
    assert prefill_body["vllm_xargs"]["eldr_request_id"] == rid
    assert prefill_body["vllm_xargs"]["eldr_client_request_id"] == "client-42"
    (decoder,) = decoded_by(stack, rid)
    _, decode_body, _ = decoder.seen[0]
    assert decode_body["kv_transfer_params"] == {"remote_engine_id": "prefill-0"}
    assert decode_body["max_tokens"] == 8
    assert body["choices"][0]["text"] == f'{decoder.name}:"hello"'
    recorded = await decision_of(stack.bus, rid)
    assert recorded is not None
    assert recorded.worker_id == decoder.name == resp.headers["X-Eldr-Decode-Worker"]
    assert recorded.client_request_id == "client-42"
    assert await decision_of(stack.bus, "client-42") is None  # a label, never a key


async def test_two_requests_with_one_client_id_get_two_decisions_on_their_own_prompts(
    stack: Stack, finishes: Finishes
) -> None:
    """Issue 22's collision: with the client's X-Request-Id as the key, two concurrent
    requests sharing it made one decision record, the second was never routed on its own
    prompt, took over the first's inbox reply, and the same id later was served the old
    decision. Each request now has its own id; the client's is a label."""
    for decoder in stack.decoders:
        decoder.stream_pieces, decoder.stream_gap_s = 4, 0.05  # both in flight at once
    prompts = ["first prompt", "the second, longer prompt"]

    async def ask(http: aiohttp.ClientSession, prompt: str) -> tuple[str, str, str]:
        async with http.post(
            stack.url + "/v1/completions",
            json={"prompt": prompt, "max_tokens": 4, "stream": True},
            headers={"X-Request-Id": "same-id"},
        ) as resp:
            assert resp.status == 200
            assert resp.headers["X-Request-Id"] == "same-id"
            text = await resp.text()
            return rid_of(resp), resp.headers["X-Eldr-Decode-Worker"], text

    async with aiohttp.ClientSession() as http:
        answers = await asyncio.gather(*(ask(http, p) for p in prompts))
        # The same client id a while later: a new request, a new decision.
        later = await ask(http, "asked again later")
    for (rid, worker, text), prompt in zip(answers, prompts, strict=True):
        decision = await decision_of(stack.bus, rid)
        assert decision is not None
        assert decision.client_request_id == "same-id"
        assert decision.worker_id == worker
        assert decision.prompt_tokens == len(json.dumps(prompt))  # decided on its own prompt
        # Decoded on its own prompt, under its own id.
        ((_, decoded, _),) = [seen for d in stack.decoders for seen in d.seen if seen[2] == rid]
        assert decoded["prompt"] == prompt
        assert json.dumps(prompt) in "".join(
            json.loads(line[6:])["choices"][0]["text"]
            for line in text.splitlines()
            if line.startswith("data: {")
        )
        final = await finishes.final(rid)
        assert (final.reason, final.client_request_id, final.worker_id) == (
            "stop",
            "same-id",
            worker,
        )
    decision = await decision_of(stack.bus, later[0])
    assert decision is not None
    assert decision.prompt_tokens == len(json.dumps("asked again later"))
    assert len({rid for rid, _, _ in (*answers, later)}) == 3


async def test_streaming_chat_is_passed_through(stack: Stack) -> None:
    messages = [{"role": "user", "content": "hi"}]
    async with aiohttp.ClientSession() as http:
        resp = await http.post(
            stack.url + "/v1/chat/completions",
            json={"messages": messages, "stream": True},
            headers={"X-Request-Id": "chat-1"},
        )
        raw = (await resp.read()).decode()
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    chunks = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
    assert chunks[-1] == "[DONE]"
    text = "".join(json.loads(c)["choices"][0]["text"] for c in chunks[:-1])
    (decoder,) = decoded_by(stack, rid_of(resp))
    assert text == f"{decoder.name}:{json.dumps(messages)}"
    assert stack.prefill.seen[0][0] == "/v1/chat/completions"


async def test_a_failing_decoder_is_replaced_before_streaming(stack: Stack) -> None:
    stack.decoders[0].failures[0] = 1  # shared: whichever is tried first fails
    async with aiohttp.ClientSession() as http:
        resp = await http.post(
            stack.url + "/v1/completions",
            json={"prompt": "p"},
            headers={"X-Request-Id": "retry-1"},
        )
        body = await resp.json()
    assert resp.status == 200
    tried = decoded_by(stack, rid_of(resp))
    assert len(tried) == 2
    assert body["choices"][0]["text"].startswith(resp.headers["X-Eldr-Decode-Worker"])


async def test_client_errors_are_openai_shaped(stack: Stack) -> None:
    async with aiohttp.ClientSession() as http:
        bad = await http.post(stack.url + "/v1/completions", json={"prompt": "x", "n": 3})
        refused = await http.post(stack.url + "/v1/completions", json={"prompt": "refuse"})
        not_json = await http.post(stack.url + "/v1/completions", data=b"{")
        assert bad.status == 400
        assert (await bad.json())["error"]["param"] == "n"
        assert refused.status == 400
        assert (await refused.json())["error"]["message"] == "no"
        assert not_json.status == 400
        assert "error" in await not_json.json()


async def test_without_a_decision_the_least_loaded_decoder_serves(stack: Stack) -> None:
    stack.prefill.publish_prefill_done = False
    async with aiohttp.ClientSession() as http:
        resp = await http.post(
            stack.url + "/v1/completions", json={"prompt": "p"}, headers={"X-Request-Id": "nd"}
        )
        assert resp.status == 200
        metrics = await (await http.get(stack.url + "/metrics")).text()
    assert 'eldr_gateway_decisions_total{source="fallback"} 1.0' in metrics
    assert await decision_of(stack.bus, rid_of(resp)) is None


async def test_models_health_and_readiness(stack: Stack) -> None:
    async with aiohttp.ClientSession() as http:
        models = await http.get(stack.url + "/v1/models")
        assert (await models.json())["data"][0]["id"] == "m"
        assert (await http.get(stack.url + "/healthz")).status == 200
        ready = await http.get(stack.url + "/readyz")
        assert ready.status == 200
        assert (await ready.json())["upstreams"] is True


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


@pytest.fixture
async def finishes(stack: Stack) -> Finishes:
    seen = Finishes()
    await stack.bus.subscribe(stack.bus.subjects.finished_all, RequestFinished, seen.on)
    return seen


async def test_every_request_ends_in_exactly_one_finish_event(
    stack: Stack, finishes: Finishes
) -> None:
    async with aiohttp.ClientSession() as http:
        whole = await http.post(
            stack.url + "/v1/completions",
            json={"prompt": "a", "max_tokens": 7},
            headers={"X-Request-Id": "f-whole"},
        )
        assert whole.status == 200
        streamed = await http.post(
            stack.url + "/v1/completions",
            json={"prompt": "b", "stream": True, "return_token_ids": True},
            headers={"X-Request-Id": "f-stream"},
        )
        await streamed.read()
        refused = await http.post(
            stack.url + "/v1/completions",
            json={"prompt": "refuse"},
            headers={"X-Request-Id": "f-refused"},
        )
        assert refused.status == 400
    final = await finishes.final(rid_of(whole))
    assert (final.reason, final.output_tokens, final.gateway_id) == ("length", 7, "gw0")
    assert final.worker_id == whole.headers["X-Eldr-Decode-Worker"]
    assert final.decode_s is not None
    assert final.client_request_id == "f-whole"
    (subject, _), *_ = finishes.events[rid_of(whole)]
    assert subject == stack.bus.subjects.finished("gw0")
    final = await finishes.final(rid_of(streamed))
    assert (final.reason, final.worker_id) == ("stop", streamed.headers["X-Eldr-Decode-Worker"])
    # Refused by the prefill (a 4xx): it never reached a decode worker.
    final = await finishes.final(rid_of(refused))
    assert (final.reason, final.worker_id, final.client_request_id) == ("error", None, "f-refused")


async def test_a_retried_request_leaves_its_first_worker_in_a_moved_event(
    stack: Stack, finishes: Finishes
) -> None:
    stack.decoders[0].failures[0] = 1  # shared: whichever is tried first fails
    async with aiohttp.ClientSession() as http:
        resp = await http.post(
            stack.url + "/v1/completions", json={"prompt": "p"}, headers={"X-Request-Id": "mv"}
        )
        assert resp.status == 200
    final = await finishes.final(rid_of(resp))
    moves = [m for _, m in finishes.events[rid_of(resp)] if m.reason == "moved"]
    (move,) = moves
    decision = await decision_of(stack.bus, rid_of(resp))
    assert decision is not None
    assert move.worker_id == decision.worker_id
    assert move.moved_to == final.worker_id == resp.headers["X-Eldr-Decode-Worker"]
    assert final.worker_id != decision.worker_id


async def test_a_client_that_breaks_off_a_stream_ends_in_an_abort(
    stack: Stack, finishes: Finishes
) -> None:
    for decoder in stack.decoders:
        decoder.stream_pieces, decoder.stream_gap_s = 40, 0.05
    async with aiohttp.ClientSession() as http:
        resp = await http.post(
            stack.url + "/v1/completions",
            json={"prompt": "long", "stream": True},
            headers={"X-Request-Id": "ab"},
        )
        await resp.content.readany()  # the first chunk, then hang up
        resp.close()
    final = await finishes.final(rid_of(resp))
    assert final.reason == "abort"
    assert final.worker_id in {d.name for d in stack.decoders}


async def test_a_prefill_whose_capture_failed_is_routed_load_only_at_once(
    stack: Stack, finishes: Finishes
) -> None:
    stack.prefill.publish_prefill_done = False  # a broken plugin publishes nothing
    await stack.prefill.say_capture("failed", "MoE layer 3 wrote no rows")
    await asyncio.sleep(0.2)
    started = time.monotonic()
    async with aiohttp.ClientSession() as http:
        resp = await http.post(
            stack.url + "/v1/completions", json={"prompt": "p"}, headers={"X-Request-Id": "nc"}
        )
        assert resp.status == 200
        metrics = await (await http.get(stack.url + "/metrics")).text()
    # The decision timeout is 2 s: the fallback did not wait for it.
    assert time.monotonic() - started < 1.5
    decision = await decision_of(stack.bus, rid_of(resp))
    assert decision is not None
    assert decision.worker_id == resp.headers["X-Eldr-Decode-Worker"]
    assert decision.signature is None
    event = await prefill_done_of(stack.bus, rid_of(resp))
    assert event.client_request_id == "nc"
    assert (event.capture, event.attrs) == ("unavailable", {"eldr_capture": "capture_failed"})
    assert event.n_prompt_tokens == 3  # from the prefill's usage
    assert 'eldr_gateway_capture_fallbacks_total{reason="capture_failed"} 1.0' in metrics
    assert 'eldr_gateway_prefill_capture{instance="prefill-0"} 0.0' in metrics
    assert 'eldr_gateway_decisions_total{source="inbox"} 1.0' in metrics
    # Capture back: requests wait for the plugin's own PrefillDone again.
    stack.prefill.publish_prefill_done = True
    await stack.prefill.say_capture("ok")
    await asyncio.sleep(0.2)
    async with aiohttp.ClientSession() as http:
        resp = await http.post(
            stack.url + "/v1/completions", json={"prompt": "p"}, headers={"X-Request-Id": "ok"}
        )
        assert resp.status == 200
    decision = await decision_of(stack.bus, rid_of(resp))
    assert decision is not None
    assert decision.fallback is None


@pytest.mark.parametrize("capture_grace_s", [0.0])
async def test_a_prefill_that_never_reports_capture_is_routed_load_only(stack: Stack) -> None:
    stack.prefill.publish_prefill_done = False  # no plugin at all
    started = time.monotonic()
    async with aiohttp.ClientSession() as http:
        resp = await http.post(
            stack.url + "/v1/completions", json={"prompt": "p"}, headers={"X-Request-Id": "ns"}
        )
        assert resp.status == 200
        metrics = await (await http.get(stack.url + "/metrics")).text()
    assert time.monotonic() - started < 1.5
    decision = await decision_of(stack.bus, rid_of(resp))
    assert decision is not None
    assert (await prefill_done_of(stack.bus, rid_of(resp))).capture == "unavailable"
    assert 'eldr_gateway_capture_fallbacks_total{reason="no_capture_status"} 1.0' in metrics
