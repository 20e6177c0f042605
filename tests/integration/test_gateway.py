"""The gateway against a real nats-server and router, with stand-in vLLM servers
(`support.gateway_stack`: test doubles of vLLM, not vLLM; real vLLM runs in tests/vllm):
the request flow, decisions, retries, finish events, capture fallbacks."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from eldr.roles.requester import DecisionWaiters
from eldr.settings import BusSettings, RetentionSettings
from eldr.wire import RequestFinished
from support.gateway_stack import (
    Finishes,
    Stack,
    decision_of,
    decoded_by,
    gateway_stack,
    prefill_done_of,
    rid_of,
)

pytestmark = pytest.mark.integration


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
    async with gateway_stack(
        bus, bus_settings, retention, gateway_capture_grace_s=capture_grace_s
    ) as stack:
        yield stack


@pytest.fixture
async def finishes(stack: Stack) -> Finishes:
    seen = Finishes()
    await stack.bus.subscribe(stack.bus.subjects.finished_all, RequestFinished, seen.on)
    return seen


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
        metrics = await (await http.get(stack.metrics_url + "/metrics")).text()
    assert 'eldr_gateway_decisions_total{source="fallback"} 1.0' in metrics
    assert await decision_of(stack.bus, rid_of(resp)) is None


async def test_models_health_and_readiness(stack: Stack) -> None:
    """vLLM's /health on the OpenAI port; the runtime's /healthz and /readyz (with the
    gateway's upstreams check) on the metrics port, and only there."""
    async with aiohttp.ClientSession() as http:
        models = await http.get(stack.url + "/v1/models")
        assert (await models.json())["data"][0]["id"] == "m"
        assert (await http.get(stack.url + "/health")).status == 200
        healthz = await http.get(stack.metrics_url + "/healthz")
        assert await healthz.json() == {"service": "gateway", "instance": "gw0"}
        ready = await http.get(stack.metrics_url + "/readyz")
        assert ready.status == 200
        assert (await ready.json())["upstreams"] is True
        for path in ("/healthz", "/readyz", "/metrics"):
            assert (await http.get(stack.url + path)).status == 404, path


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


async def test_a_client_whose_hang_up_was_lost_gets_no_decode(
    stack: Stack, finishes: Finishes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The handler's cancellation can be lost (Python 3.11's wait_for lost it when the
    decision came in the same moment, and a whole answer was decoded for nobody): the
    gateway still sees the closed connection before the decode and starts none."""
    real_wait = DecisionWaiters.wait

    async def deaf_wait(self: DecisionWaiters, *args: Any, **kwargs: Any) -> Any:
        deadline = time.monotonic() + 1.0
        while True:
            try:  # a wait that swallows the hang-up, and answers after the client left
                await asyncio.sleep(max(0.0, deadline - time.monotonic()))
                break
            except asyncio.CancelledError:
                continue
        return await real_wait(self, *args, **kwargs)

    monkeypatch.setattr(DecisionWaiters, "wait", deaf_wait)
    async with aiohttp.ClientSession() as http:
        with pytest.raises(TimeoutError):
            await http.post(
                stack.url + "/v1/completions",
                json={"prompt": "left"},
                headers={"X-Request-Id": "left"},
                timeout=aiohttp.ClientTimeout(total=0.3),
            )
    deadline = time.monotonic() + 10
    while not any(m.client_request_id == "left" for ms in finishes.events.values() for _, m in ms):
        assert time.monotonic() < deadline, "no finish event"
        await asyncio.sleep(0.05)
    (request_id,) = [
        rid for rid, ms in finishes.events.items() if ms[0][1].client_request_id == "left"
    ]
    final = await finishes.final(request_id)
    assert (final.reason, final.worker_id) == ("abort", None)
    assert [d.name for d in decoded_by(stack, request_id)] == []
    assert len(stack.prefill.seen) == 1  # the prefill ran; no decode started after it


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
        metrics = await (await http.get(stack.metrics_url + "/metrics")).text()
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
        metrics = await (await http.get(stack.metrics_url + "/metrics")).text()
    assert time.monotonic() - started < 1.5
    decision = await decision_of(stack.bus, rid_of(resp))
    assert decision is not None
    assert (await prefill_done_of(stack.bus, rid_of(resp))).capture == "unavailable"
    assert 'eldr_gateway_capture_fallbacks_total{reason="no_capture_status"} 1.0' in metrics
