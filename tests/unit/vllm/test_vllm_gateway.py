"""The gateway's bookkeeping (`eldr.vllm.gateway`) and its request shaping helpers in
`eldr.vllm.pd` (candidate order, response headers, outcome labels)."""

from __future__ import annotations

import json

import pytest

from eldr.core.workload.trace import ModelGeometry
from eldr.vllm.gateway import (
    CaptureWatch,
    SseRelay,
    StreamTally,
    UpstreamHealth,
    prompt_tokens_of,
    response_outcome,
    response_sources,
)
from eldr.vllm.pd import (
    DECODE_WORKER_HEADER,
    ELDR_REQUEST_ID_HEADER,
    REQUEST_ID_HEADER,
    LeastOutstanding,
    decode_order,
    request_outcome,
    response_headers,
)
from eldr.wire import CaptureStatus, Decision
from support import messages


def decision(request_id: str = "r", worker: str = "d1") -> Decision:
    return messages.decision(request_id, worker, ts_s=0.0, policy="eldr", partition_version=1)


# --- request shaping ---------------------------------------------------------------------


def test_with_a_decision_its_worker_goes_first() -> None:
    picker = LeastOutstanding(["d0", "d1", "d2"])
    assert decode_order(decision(worker="d2"), picker) == ["d2", "d0", "d1"]


def test_without_a_decision_the_least_loaded_decoder_goes_first() -> None:
    picker = LeastOutstanding(["d0", "d1", "d2"])
    picker.acquire("d0")
    picker.acquire("d1")
    assert decode_order(None, picker) == ["d2", "d0", "d1"]


def test_response_headers_drop_hop_headers_and_name_the_request_and_decoder() -> None:
    upstream = [
        ("Content-Type", "application/json"),
        ("Content-Length", "12"),
        ("X-A", "1"),
        ("x-request-id", "what vLLM echoes"),
    ]
    assert response_headers(upstream, "rid", "d1") == {
        "Content-Type": "application/json",
        "X-A": "1",
        REQUEST_ID_HEADER: "rid",
        ELDR_REQUEST_ID_HEADER: "rid",
        DECODE_WORKER_HEADER: "d1",
    }
    # The client's own id comes back as it sent it; the gateway's id beside it.
    headers = response_headers(upstream, "eldr-1", "d1", "client-7")
    assert (headers[REQUEST_ID_HEADER], headers[ELDR_REQUEST_ID_HEADER]) == ("client-7", "eldr-1")


@pytest.mark.parametrize(
    ("status", "outcome"),
    [
        (200, "ok"),
        (399, "ok"),
        (400, "client_error"),
        (498, "client_error"),
        (499, "aborted"),
        (502, "upstream_error"),
    ],
)
def test_request_outcome_by_status(status: int, outcome: str) -> None:
    assert request_outcome(status) == outcome


def test_one_response_source_per_prefill_instance() -> None:
    sources = response_sources(
        ["p0", "p1"], model_key="m", block_size=16, geometry=ModelGeometry.of_moe(2, 8, 2)
    )
    assert sorted(sources) == ["p0", "p1"]
    assert sources["p1"].state.config.worker_id == "p1"


# --- capture states ----------------------------------------------------------------------


def status(worker: str = "p0", state: str = "ok", interval_s: float = 2.0) -> CaptureStatus:
    return CaptureStatus(
        worker_id=worker,
        incarnation="i",
        seq=0,
        ts_s=1.0,
        interval_s=interval_s,
        prefill_capture=state,  # type: ignore[arg-type]
        decode_profiles="off",
    )


def test_capture_states_wait_through_the_grace_period_then_name_the_problem() -> None:
    states = CaptureWatch(["p0", "p1"], started_s=100.0, grace_s=5.0)
    assert states.problem("p0", 101.0) is None  # not heard yet, but a status is due
    assert states.problem("p0", 106.0) == "no_capture_status"
    assert states.update(status("p0"), 106.0)
    assert states.problem("p0", 107.0) is None
    assert states.problem("p0", 106.0 + 3 * 2.0 + 0.1) == "capture_stale"
    states.update(status("p0", "failed"), 110.0)
    assert states.problem("p0", 110.5) == "capture_failed"
    states.update(status("p0", "off"), 111.0)
    assert states.problem("p0", 111.5) == "capture_off"
    assert not states.update(status("elsewhere"), 111.0)
    assert states.last("elsewhere") is None


def test_the_prompt_tokens_come_from_the_usage() -> None:
    assert prompt_tokens_of({"usage": {"prompt_tokens": 40}}) == 40
    assert prompt_tokens_of({"usage": None}) == 0


# --- the end of each request --------------------------------------------------------------


def sse(*events: object) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


def test_a_stream_tally_finds_the_finish_reason_and_tokens_across_chunk_cuts() -> None:
    stream = sse(
        {"choices": [{"text": "a", "token_ids": [5]}]},
        {"choices": [{"text": "b", "token_ids": [6, 7]}]},
        {"choices": [{"text": "", "finish_reason": "length", "token_ids": []}]},
    )
    for cut in range(1, len(stream)):
        tally = StreamTally()
        tally.feed(stream[:cut])
        tally.feed(stream[cut:])
        assert (tally.finish_reason, tally.output_tokens) == ("length", 3)
    usage = StreamTally()
    usage.feed(
        sse({"choices": [{"text": "a"}]}, {"choices": [], "usage": {"completion_tokens": 9}})
    )
    assert (usage.finish_reason, usage.output_tokens) == (None, 9)
    garbage = StreamTally()
    garbage.feed(b"data: {not json\n\nevent: x\n\n")
    assert (garbage.finish_reason, garbage.output_tokens) == (None, None)


def test_whole_responses_give_their_reason_and_tokens() -> None:
    body = {"choices": [{"finish_reason": "stop"}], "usage": {"completion_tokens": 4}}
    assert response_outcome(json.dumps(body).encode()) == ("stop", 4)
    assert response_outcome(b'{"choices": [{"finish_reason": "length"}]}') == ("length", None)
    assert response_outcome(b"not json") == ("stop", None)


def test_an_sse_relay_passes_whole_events_and_holds_back_a_broken_one() -> None:
    relay = SseRelay()
    first = b'data: {"choices": [{"text": "a"}]}\n\n'
    second = b'data: {"choices": [{"text": "b", "finish_reason": "length"}]}\n\n'
    stream = first + second
    assert relay.feed(stream[:10]) == b""
    assert relay.feed(stream[10 : len(first) + 5]) == first
    assert relay.dropped_bytes == 5  # the upstream broke here: nothing half-sent
    assert relay.feed(stream[len(first) + 5 :] + b"data: [DONE]") == second
    assert relay.flush() == b"data: [DONE]"
    assert (relay.tally.finish_reason, relay.tally.chunks) == ("length", 2)


def test_vllms_own_error_event_ends_a_stream_as_an_error() -> None:
    tally = StreamTally()
    tally.feed(b'data: {"choices": [{"text": "a"}]}\n\n')
    tally.feed(b'data: {"error": {"message": "x", "type": "InternalServerError"}}\n\n')
    assert tally.finish_reason == "error"


def test_an_instance_leaves_the_rotation_when_found_down_and_comes_back_on_a_probe() -> None:
    health = UpstreamHealth([("prefill", "p0"), ("decode", "d0"), ("decode", "d1")])
    assert not health.ready("decode")  # healthy by default, ready only once probed
    assert health.mark("decode", "d0", True, probe=True) is False  # no change
    assert health.ready("decode")
    assert health.mark("decode", "d0", False) is True
    assert health.names("decode", healthy=True) == ["d1"]
    assert not health.ready("decode")  # d1 was never probed
    assert health.mark("decode", "d0", True, probe=True) is True
    assert health.healthy("decode", "d0")
    assert not health.healthy("decode", "unknown")
