"""End to end on real vLLM: gateway -> prefill vLLM (capture plugin) -> ELDR -> decode vLLM.

A prefill and a decode vLLM instance with a real KV connector, the signature and routing
services, the decode adapter (the decode instance's load, from its /metrics) and the
gateway. Completions and chat completions, streaming and not, through the gateway equal
what the decode instance answers directly (greedy decoding), and every request has a
decision record under the gateway's own id of it, labelled with the client's request id.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import aiohttp
import numpy as np
import pytest
from vllm_support import (
    DECODE_ID,
    MODEL_NAME,
    PREFILL_ID,
    SKIP_REASON,
    Engines,
    answer_tokens,
    free_port,
    post,
    post_for_headers,
    prefill_events,
    running,
    service_settings,
)

from eldr.bus import Bus
from eldr.bus.topology import DECISIONS
from eldr.settings import BusSettings
from eldr.wire import Decision
from eldr_services.decodeadapter.service import setup as adapter_setup
from eldr_services.decodeadapter.settings import DecodeAdapterSettings
from eldr_services.gateway.service import setup as gateway_setup
from eldr_services.gateway.settings import GatewaySettings
from eldr_services.router.service import setup as router_setup
from eldr_services.router.settings import RouterSettings
from eldr_services.signature.service import setup as signature_setup
from eldr_services.signature.settings import SignatureSettings

pytest.importorskip("vllm.version", reason=SKIP_REASON)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

CASES = [
    ("completions", False),
    ("completions", True),
    ("chat", False),
    ("chat", True),
]


def body_for(kind: str, stream: bool, run: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL_NAME,
        "max_tokens": 12,
        "temperature": 0,
        "stream": stream,
        "ignore_eos": True,
        # Random weights emit special tokens too: keep them in the text, and compare ids.
        "skip_special_tokens": False,
        "return_token_ids": True,
    }
    text = f"{run} {kind} {stream}: expert router prefill decode block cache token layer " * 3
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    return body


async def wait_ready(url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            try:
                async with http.get(url + "/readyz") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise AssertionError(f"{url} not ready")


async def test_gateway_disaggregated_answers_equal_direct_vllm_and_are_all_decided(
    engines: Engines,
) -> None:
    run = uuid.uuid4().hex[:8]
    port, metrics_port = free_port(), free_port()
    gateway_url = f"http://127.0.0.1:{port}"
    services = [
        ("signature", service_settings(engines, SignatureSettings), signature_setup),
        (
            "router",
            service_settings(
                engines,
                RouterSettings,
                policy="jsq",
                signature_timeout_s=5.0,
                assemble_wait_ms=3000,
                fetch_signature=True,
            ),
            router_setup,
        ),
        (
            "decodeadapter",
            service_settings(
                engines,
                DecodeAdapterSettings,
                adapter_worker_id=DECODE_ID,
                adapter_url=engines.decode.url,
                adapter_interval_s=0.2,
            ),
            adapter_setup,
        ),
        (
            "gateway",
            service_settings(
                engines,
                GatewaySettings,
                gateway_host="127.0.0.1",
                gateway_port=port,
                metrics_port=metrics_port,
                gateway_prefill=f"{PREFILL_ID}={engines.prefill.url}",
                gateway_decode=f"{DECODE_ID}={engines.decode.url}",
                gateway_decision_timeout_s=30.0,
            ),
            gateway_setup,
        ),
    ]
    got: dict[str, tuple[str, list[int]]] = {}
    """The gateway's request id -> (text, token ids), in CASES order."""
    client_id = f"e2e-{run}"
    async with (
        running(*services[0]),
        running(*services[1]),
        running(*services[2]),
        running(*services[3]),
    ):
        await wait_ready(f"http://127.0.0.1:{metrics_port}")  # the runtime's /readyz
        # All at once, all with one client X-Request-Id (issue 22's collision: it keyed
        # every record): each request still gets its own decision, on its own prompt.
        answers = await asyncio.gather(
            *(
                post_for_headers(
                    gateway_url + ("/v1/chat/completions" if kind == "chat" else "/v1/completions"),
                    body_for(kind, stream, run),
                    {"X-Request-Id": client_id},
                )
                for kind, stream in CASES
            )
        )
        for (kind, stream), (answer, headers) in zip(CASES, answers, strict=True):
            assert headers["X-Request-Id"] == client_id
            got[headers["X-Eldr-Request-Id"]] = answer_tokens(answer, kind == "chat", stream)
        assert len(got) == len(CASES)
        async with aiohttp.ClientSession() as http:
            models = await (await http.get(gateway_url + "/v1/models")).json()
        assert models["data"][0]["id"] == MODEL_NAME
    # Direct answers only now: the prompts must not be in any cache before the PD run.
    for (kind, stream), request_id in zip(CASES, got, strict=True):
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        direct = await post(engines.decode.url + path, body_for(kind, stream, run))
        assert got[request_id] == answer_tokens(direct, kind == "chat", stream), request_id
        assert len(got[request_id][1]) == 12  # the ids of every generated token
    events = await prefill_events(engines, set(got))
    bus = await Bus.connect(
        BusSettings(nats_url=engines.nats_url, namespace=engines.namespace), "e2e-check"
    )
    try:
        stream_name = f"{engines.namespace.upper()}_{DECISIONS}"
        for request_id in got:
            decision = await bus.get_last(stream_name, bus.subjects.decision(request_id), Decision)
            assert decision is not None, request_id
            assert decision.worker_id == DECODE_ID
            assert decision.client_request_id == client_id
            assert decision.signature is not None
            assert events[request_id].client_request_id == client_id  # from the plugin
            computed = events[request_id].computed
            assert computed is not None
            np.testing.assert_array_equal(
                decision.signature.to_dense(np.int64), computed.to_dense(np.int64)
            )
    finally:
        await bus.drain()
