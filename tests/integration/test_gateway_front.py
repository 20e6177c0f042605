"""The gateway as an OpenAI front door (issue 22, item 6), against stand-in vLLM servers
(`support.gateway_stack`: test doubles of vLLM, not vLLM) with a real nats-server and
router: upstream failures mid-stream, timeouts, client hang-ups, keys, what the prefill leg
carries, validation before any prefill, vLLM-shaped errors, the pass-through endpoints,
dead engines out of rotation. The same front door over real vLLM with the official
`openai` client: tests/vllm/test_openai_client.py."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from eldr.settings import BusSettings, RetentionSettings
from eldr.wire import RequestFinished
from support.gateway_stack import Finishes, Stack, decoded_by, gateway_stack, rid_of

pytestmark = pytest.mark.integration


@pytest.fixture
def gateway_extra() -> dict[str, Any]:
    """Gateway settings of a test (parametrize it indirectly)."""
    return {}


@pytest.fixture
async def stack(
    bus_factory: Any,
    bus_settings: BusSettings,
    retention: RetentionSettings,
    gateway_extra: dict[str, Any],
) -> AsyncIterator[Stack]:
    bus = await bus_factory("stand-ins")
    async with gateway_stack(bus, bus_settings, retention, **gateway_extra) as stack:
        yield stack


@pytest.fixture
async def finishes(stack: Stack) -> Finishes:
    seen = Finishes()
    await stack.bus.subscribe(stack.bus.subjects.finished_all, RequestFinished, seen.on)
    return seen


async def metric(stack: Stack, line: str) -> bool:
    async with aiohttp.ClientSession() as http:
        text = await (await http.get(stack.metrics_url + "/metrics")).text()
    return line in text.splitlines()


def events(raw: str) -> list[str]:
    return [line[6:] for line in raw.splitlines() if line.startswith("data: ")]


# --- streams that fail after HTTP 200 ----------------------------------------------------


async def test_a_decode_that_dies_mid_stream_ends_in_vllms_error_event(
    stack: Stack, finishes: Finishes
) -> None:
    for decoder in stack.decoders:
        decoder.stream_pieces, decoder.break_after = 6, 2
    async with aiohttp.ClientSession() as http:
        resp = await http.post(stack.url + "/v1/completions", json={"prompt": "p", "stream": True})
        raw = await resp.text()
    assert resp.status == 200
    *chunks, error, done = events(raw)
    assert len(chunks) == 2
    assert all("choices" in json.loads(c) for c in chunks)
    body = json.loads(error)["error"]
    assert (body["type"], body["code"]) == ("Bad Gateway", 502)
    assert "broke off the stream" in body["message"]
    assert done == "[DONE]"
    assert (await finishes.final(rid_of(resp))).reason == "error"
    assert await metric(stack, 'eldr_gateway_stream_errors_total{reason="upstream_broken"} 1.0')


@pytest.mark.parametrize(
    "gateway_extra",
    [{"gateway_upstream_idle_timeout_s": 0.4, "gateway_upstream_timeout_s": 1.0}],
)
async def test_a_long_healthy_stream_is_not_cut_and_a_silent_one_is(stack: Stack) -> None:
    # 20 events 0.1 s apart: 2 s, longer than the 1 s bound on a whole answer, never
    # silent for 0.4 s.
    for decoder in stack.decoders:
        decoder.stream_pieces, decoder.stream_gap_s = 20, 0.1
    async with aiohttp.ClientSession() as http:
        resp = await http.post(stack.url + "/v1/completions", json={"prompt": "p", "stream": True})
        raw = await resp.text()
        assert events(raw)[-1] == "[DONE]"
        assert "error" not in raw
        for decoder in stack.decoders:
            decoder.stream_gap_s = 0.8  # now silent for longer than 0.4 s
        resp = await http.post(stack.url + "/v1/completions", json={"prompt": "p", "stream": True})
        raw = await resp.text()
    *_, error, done = events(raw)
    assert "silent for 0.4 s" in json.loads(error)["error"]["message"]
    assert done == "[DONE]"
    assert await metric(stack, 'eldr_gateway_stream_errors_total{reason="idle_timeout"} 1.0')


# --- a client that goes away -------------------------------------------------------------


async def test_a_client_that_gives_up_on_a_whole_answer_aborts_the_decode(
    stack: Stack, finishes: Finishes
) -> None:
    for decoder in stack.decoders:
        decoder.stall_s = 30.0  # a long non-streamed generation
    async with aiohttp.ClientSession() as http:
        with pytest.raises(TimeoutError):
            await http.post(
                stack.url + "/v1/completions",
                json={"prompt": "p", "max_tokens": 800},
                timeout=aiohttp.ClientTimeout(total=1.0),
            )
    waits = [asyncio.ensure_future(d.hung_up.wait()) for d in stack.decoders]
    await asyncio.wait(waits, timeout=5, return_when=asyncio.FIRST_COMPLETED)
    for wait in waits:
        wait.cancel()
    ((worker, cancelled),) = [(d.name, rid) for d in stack.decoders for rid in d.cancelled]
    final = await finishes.final(cancelled)
    assert (final.reason, final.worker_id) == ("abort", worker)  # its adapter counts it
    assert await metric(stack, "eldr_gateway_client_aborts_total 1.0")


async def test_a_client_that_gives_up_during_the_prefill_aborts_it(
    stack: Stack, finishes: Finishes
) -> None:
    stack.prefill.stall_s = 30.0
    async with aiohttp.ClientSession() as http:
        with pytest.raises(TimeoutError):
            await http.post(
                stack.url + "/v1/completions",
                json={"prompt": "p"},
                timeout=aiohttp.ClientTimeout(total=1.0),
            )
    await asyncio.wait_for(stack.prefill.hung_up.wait(), 5)
    (cancelled,) = stack.prefill.cancelled
    assert cancelled is not None
    final = await finishes.final(cancelled)
    assert (final.reason, final.worker_id) == ("abort", None)
    assert not any(d.seen for d in stack.decoders)


# --- keys --------------------------------------------------------------------------------


async def test_the_clients_authorization_reaches_both_legs(stack: Stack) -> None:
    async with aiohttp.ClientSession() as http:
        resp = await http.post(
            stack.url + "/v1/completions",
            json={"prompt": "p"},
            headers={"Authorization": "Bearer client-key"},
        )
        assert resp.status == 200
        models = await http.get(stack.url + "/v1/models", headers={"Authorization": "Bearer x"})
        assert models.status == 200
    (decoder,) = decoded_by(stack, rid_of(resp))
    assert stack.prefill.auth == ["Bearer client-key"]
    assert decoder.auth == ["Bearer client-key"]


@pytest.mark.parametrize(
    "gateway_extra",
    [{"gateway_api_keys": "k1, k2", "gateway_upstream_api_key": "engine-key"}],
)
async def test_gateway_keys_are_checked_as_vllm_checks_them(stack: Stack) -> None:
    async with aiohttp.ClientSession() as http:
        refused = [
            await http.post(stack.url + "/v1/completions", json={"prompt": "p"}, headers=h)
            for h in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic k1"})
        ]
        for resp in refused:
            assert resp.status == 401
            assert await resp.json() == {"error": "Unauthorized"}  # vLLM's own answer
        ok = await http.post(
            stack.url + "/v1/completions",
            json={"prompt": "p"},
            headers={"Authorization": "Bearer k2"},
        )
        assert ok.status == 200
        assert (await http.get(stack.url + "/health")).status == 200  # not guarded
    # The engines get the gateway's upstream key, not the client's.
    assert stack.prefill.auth == ["Bearer engine-key"]
    assert await metric(stack, "eldr_gateway_unauthorized_total 3.0")


# --- what the prefill leg carries, and what is refused before it -------------------------


async def test_min_tokens_goes_to_the_decode_leg_only(stack: Stack) -> None:
    body = {"prompt": "p", "max_tokens": 9, "min_tokens": 5, "min_completion_tokens": 5}
    async with aiohttp.ClientSession() as http:
        resp = await http.post(stack.url + "/v1/completions", json=body)
        assert resp.status == 200
    (_, prefill_leg, _) = stack.prefill.seen[0]
    assert (prefill_leg["max_tokens"], "min_tokens" in prefill_leg) == (1, False)
    assert "min_completion_tokens" not in prefill_leg
    (decoder,) = decoded_by(stack, rid_of(resp))
    (_, decode_leg, _) = decoder.seen[0]
    assert (decode_leg["max_tokens"], decode_leg["min_tokens"]) == (9, 5)


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"n": 2}, "n", "does not support `n > 1`"),
        ({"use_beam_search": True}, "use_beam_search", "does not support beam search"),
        ({"max_tokens": 0}, "max_tokens", "max_tokens must be at least 1, got 0."),
        ({"max_tokens": "8"}, "max_tokens", "`max_tokens` must be an integer"),
        (
            {"max_tokens": 4, "min_tokens": 6},
            "min_tokens",
            "min_tokens must be less than or equal to max_tokens=4, got 6.",
        ),
        ({"min_tokens": -1}, "min_tokens", "min_tokens must be greater than or equal to 0"),
    ],
)
async def test_a_request_vllm_would_refuse_is_refused_before_any_prefill(
    stack: Stack, body: dict[str, Any], param: str, message: str
) -> None:
    async with aiohttp.ClientSession() as http:
        resp = await http.post(stack.url + "/v1/completions", json={"prompt": "p", **body})
        error = (await resp.json())["error"]
    assert resp.status == 400
    assert (error["type"], error["code"], error["param"]) == ("BadRequestError", 400, param)
    assert message in error["message"]
    assert stack.prefill.seen == []


async def test_the_gateways_own_errors_are_shaped_as_vllms(stack: Stack) -> None:
    async with aiohttp.ClientSession() as http:
        missing = await http.get(stack.url + "/v1/nothing")
        wrong_method = await http.get(stack.url + "/v1/completions")
        not_json = await http.post(stack.url + "/v1/completions", data=b"{")
        bodies = [await r.json() for r in (missing, wrong_method, not_json)]
    assert (missing.status, bodies[0]) == (
        404,
        {"error": {"message": "Not Found", "type": "Not Found", "param": None, "code": 404}},
    )
    assert wrong_method.status == 405
    assert bodies[1]["error"]["type"] == "Method Not Allowed"
    assert bodies[1]["error"]["code"] == 405
    assert not_json.status == 400
    assert (bodies[2]["error"]["type"], bodies[2]["error"]["code"]) == ("BadRequestError", 400)


# --- what vllm bench serve and the openai SDK call besides completions ------------------


async def test_health_version_and_tokenize_are_answered(stack: Stack) -> None:
    async with aiohttp.ClientSession() as http:
        health = await http.get(stack.url + "/health")
        version = await (await http.get(stack.url + "/version")).json()
        tokens = await (
            await http.post(stack.url + "/tokenize", json={"model": "m", "prompt": "abc"})
        ).json()
    assert (health.status, await health.text()) == (200, "")
    assert version == {"version": "stand-in prefill-0"}
    assert tokens == {"tokens": [0, 1, 2], "by": "prefill-0"}


# --- dead engines ------------------------------------------------------------------------


async def test_a_dead_decode_instance_leaves_the_rotation(stack: Stack) -> None:
    dead, alive = stack.decoders
    await dead.stop()
    async with aiohttp.ClientSession() as http:
        first = await http.post(stack.url + "/v1/completions", json={"prompt": "p"})
        assert first.status == 200  # retried on the other (connection refused: no re-prefill)
        assert first.headers["X-Eldr-Decode-Worker"] == alive.name
        answers = [
            await http.post(stack.url + "/v1/completions", json={"prompt": "p"}) for _ in range(6)
        ]
    assert [a.headers["X-Eldr-Decode-Worker"] for a in answers] == [alive.name] * 6
    assert len(stack.prefill.seen) == 7  # no prefill ran twice
    assert await metric(
        stack, 'eldr_gateway_upstream_healthy{instance="decode-0",role="decode"} 0.0'
    )
    assert await metric(stack, "eldr_gateway_decode_retries_total 1.0")  # the first only


async def test_a_dead_prefill_instance_is_a_fast_503_not_a_502(stack: Stack) -> None:
    await stack.prefill.stop()
    async with aiohttp.ClientSession() as http:
        started = time.monotonic()
        answers = [
            await http.post(stack.url + "/v1/completions", json={"prompt": "p"}) for _ in range(3)
        ]
        health = await http.get(stack.url + "/health")
    assert time.monotonic() - started < 2.0
    assert answers[0].status == 502  # the request that found it dead
    for resp in answers[1:]:
        error = (await resp.json())["error"]
        assert (resp.status, error["type"]) == (503, "ServiceUnavailableError")
        assert "no prefill instance is healthy (prefill-0 down)" in error["message"]
    assert health.status == 503
    assert await metric(stack, 'eldr_gateway_no_healthy_upstream_total{role="prefill"} 2.0')


async def test_a_retry_after_a_decode_that_took_the_request_runs_the_prefill_again(
    stack: Stack,
) -> None:
    stack.decoders[0].failures[0] = 1  # the first decode attempt answers 500
    async with aiohttp.ClientSession() as http:
        resp = await http.post(stack.url + "/v1/completions", json={"prompt": "p"})
        assert resp.status == 200
    rid = rid_of(resp)
    assert [seen_rid for _, _, seen_rid in stack.prefill.seen] == [rid, rid]
    assert await metric(stack, "eldr_gateway_reprefills_total 1.0")


# --- KV connectors the gateway cannot drive ---------------------------------------------


async def test_an_instance_whose_connector_the_gateway_cannot_drive_is_refused(
    stack: Stack,
) -> None:
    mooncake, other = stack.decoders
    await mooncake.say_capture("off", kv_connector="MooncakeConnector")
    await asyncio.sleep(0.3)
    async with aiohttp.ClientSession() as http:
        answers = [
            await http.post(stack.url + "/v1/completions", json={"prompt": "p"}) for _ in range(4)
        ]
    assert [a.headers["X-Eldr-Decode-Worker"] for a in answers] == [other.name] * 4
    assert mooncake.seen == []
    refused = 'eldr_gateway_connector_refused{instance="decode-0",role="decode"}'
    assert await metric(stack, f"{refused} 1.0")
    # Restarted with NIXL: back in rotation (its next probe passes).
    await mooncake.say_capture("off", kv_connector="NixlConnector")
    await asyncio.sleep(0.5)
    assert await metric(stack, f"{refused} 0.0")
    assert await metric(
        stack, 'eldr_gateway_upstream_healthy{instance="decode-0",role="decode"} 1.0'
    )


async def test_a_prefill_instance_without_a_connector_is_refused(stack: Stack) -> None:
    await stack.prefill.say_capture("ok", kv_connector=None)
    await asyncio.sleep(0.3)
    async with aiohttp.ClientSession() as http:
        resp = await http.post(stack.url + "/v1/completions", json={"prompt": "p"})
        error = (await resp.json())["error"]
    assert resp.status == 503
    assert "no prefill instance is healthy" in error["message"]
    assert stack.prefill.seen == []
