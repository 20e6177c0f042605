"""`eldr.vllm.pd` (the prefill -> decode handoff) and `eldr.vllm.load` (metrics, admissions)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eldr.vllm.load import (
    AdmissionTracker,
    MetricsError,
    StatsDisabledError,
    VllmLoad,
    parse_metrics,
)
from eldr.vllm.pd import (
    PREFILL_KV_PARAMS,
    XARG_CLIENT_REQUEST_ID,
    XARG_MAX_TOKENS,
    XARG_REPLY_TO,
    XARG_REQUEST_ID,
    BadRequestError,
    LeastOutstanding,
    check_body,
    client_request_id_from,
    connector_problem,
    decode_body,
    decode_candidates,
    new_request_id,
    openai_error,
    parse_instances,
    prefill_body,
    stream_error_event,
)
from eldr.wire import Decision
from support import messages


def decision(worker: str, band: list[str], scores: list[tuple[str, float]]) -> Decision:
    return messages.decision(
        "r", worker, policy="eldr", partition_version=1, scores=scores, band=band
    )


def test_prefill_body_asks_for_one_token_and_remote_decode() -> None:
    body = {"prompt": "hi", "max_tokens": 50, "stream": True, "stream_options": {"x": 1}}
    out = prefill_body(body, "rid-1", "_INBOX.g")
    assert out["max_tokens"] == 1
    assert out["stream"] is False
    assert "stream_options" not in out
    assert out["kv_transfer_params"] == dict(PREFILL_KV_PARAMS)
    assert out["vllm_xargs"] == {
        XARG_REQUEST_ID: "rid-1",
        XARG_REPLY_TO: "_INBOX.g",
        XARG_MAX_TOKENS: 50,
    }
    assert body["max_tokens"] == 50  # the client's body is untouched


def test_prefill_body_keeps_client_xargs_and_caps_max_completion_tokens() -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 9}
    out = prefill_body({**body, "vllm_xargs": {"mine": 3}}, "r", "i")
    assert out["max_completion_tokens"] == 1
    assert out["vllm_xargs"]["mine"] == 3
    assert out["vllm_xargs"][XARG_MAX_TOKENS] == 9


def test_decode_body_carries_the_prefill_kv_handle() -> None:
    out = decode_body({"prompt": "p", "max_tokens": 5}, {"remote_engine_id": "e"})
    assert out == {"prompt": "p", "max_tokens": 5, "kv_transfer_params": {"remote_engine_id": "e"}}


@pytest.mark.parametrize(
    ("body", "chat", "param"),
    [
        ([], False, None),
        ({}, False, "prompt"),
        ({"messages": []}, True, "messages"),
        ({"prompt": "x", "n": 2}, False, "n"),
        ({"prompt": "x", "n": 0}, False, "n"),
        ({"prompt": "x", "n": True}, False, "n"),
        ({"prompt": "x", "use_beam_search": True}, False, "use_beam_search"),
        ({"prompt": "x", "max_tokens": 0}, False, "max_tokens"),
        ({"prompt": "x", "max_completion_tokens": -1}, False, "max_completion_tokens"),
        ({"prompt": "x", "max_tokens": 2.5}, False, "max_tokens"),
        ({"prompt": "x", "max_tokens": 3, "min_tokens": 4}, False, "min_tokens"),
        ({"prompt": "x", "stream": "yes"}, False, "stream"),
        ({"prompt": "x", "kv_transfer_params": {}}, False, "kv_transfer_params"),
    ],
)
def test_invalid_bodies_are_refused_with_the_parameter(
    body: object, chat: bool, param: str
) -> None:
    with pytest.raises(BadRequestError) as info:
        check_body(body, chat=chat)
    assert info.value.param == param


def test_every_request_gets_a_fresh_id_and_the_clients_is_a_validated_label() -> None:
    assert new_request_id().startswith("eldr-")
    assert new_request_id() != new_request_id()
    assert client_request_id_from("abc-1") == "abc-1"
    assert client_request_id_from(None) is None
    with pytest.raises(BadRequestError):
        client_request_id_from("has space")


def test_the_clients_id_travels_as_a_label_and_its_own_eldr_xargs_are_dropped() -> None:
    body = {"prompt": "p", "vllm_xargs": {"eldr_reply_to": "decisions.x", "mine": 1}}
    out = prefill_body(body, "eldr-1", "_INBOX.g", client_request_id="client-7")
    assert out["vllm_xargs"] == {
        "mine": 1,
        XARG_REQUEST_ID: "eldr-1",
        XARG_REPLY_TO: "_INBOX.g",
        XARG_CLIENT_REQUEST_ID: "client-7",
    }
    assert decode_body(body, None, "eldr-1")["vllm_xargs"] == {"mine": 1, XARG_REQUEST_ID: "eldr-1"}
    assert decode_body(body, None)["vllm_xargs"] == {"mine": 1}


def test_error_bodies_have_vllms_shape() -> None:
    body = openai_error("bad", 400, param="n")
    assert body == {
        "error": {"message": "bad", "type": "BadRequestError", "param": "n", "code": 400}
    }
    assert openai_error("down", 503)["error"]["type"] == "ServiceUnavailableError"
    assert openai_error("gone", 502)["error"] == {
        "message": "gone",
        "type": "Bad Gateway",
        "param": None,
        "code": 502,
    }


def test_a_stream_that_failed_ends_with_an_error_event_and_done() -> None:
    event = stream_error_event("broke", 502)
    first, second, rest = event.split(b"\n\n")
    assert json.loads(first.removeprefix(b"data: "))["error"]["message"] == "broke"
    assert (second, rest) == (b"data: [DONE]", b"")


def test_the_prefill_leg_drops_what_cannot_apply_to_one_token() -> None:
    body = {"prompt": "p", "max_tokens": 9, "min_tokens": 4, "min_completion_tokens": 4}
    out = prefill_body(body, "r", "_INBOX.g")
    assert "min_tokens" not in out
    assert "min_completion_tokens" not in out
    assert out["max_tokens"] == 1
    assert body["min_tokens"] == 4


def test_candidates_follow_decision_then_band_then_scores_then_the_rest() -> None:
    d = decision("d2", ["d2", "d0"], [("d2", 0.9), ("d0", 0.8), ("d9", 0.7), ("d1", 0.5)])
    assert decode_candidates(d, ["d0", "d1", "d2", "d3"]) == ["d2", "d0", "d1", "d3"]
    assert decode_candidates(None, ["d0", "d1"]) == ["d0", "d1"]


def test_least_outstanding_round_robins_ties_and_skips_excluded() -> None:
    picker = LeastOutstanding(["a", "b", "c"])
    assert [picker.pick() for _ in range(3)] == ["a", "b", "c"]
    picker.acquire("a")
    picker.acquire("b")
    assert picker.pick() == "c"
    assert picker.pick(exclude=["c"]) in ("a", "b")
    picker.release("a")
    picker.release("a")
    assert picker.outstanding["a"] == 0


def test_parse_instances() -> None:
    assert parse_instances("p0=http://h:1, p1=http://h:2/", "x") == {
        "p0": "http://h:1",
        "p1": "http://h:2",
    }
    for bad in ("", "p0", "p 0=http://h:1", "p0=ftp://h", "p0=http://h:1,p0=http://h:2"):
        with pytest.raises(ValueError, match="x"):
            parse_instances(bad, "x")


METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="100"} 1.0
# TYPE vllm:request_success counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny"} 4.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 6.0
# TYPE process_start_time_seconds gauge
process_start_time_seconds 1.7e9
"""


def test_parse_metrics_reads_vllm_load() -> None:
    load = parse_metrics(METRICS)
    assert (load.running, load.waiting, load.finished_total) == (3, 2, 10)
    assert load.kv_capacity_tokens == 3200
    assert load.kv_tokens == 800
    assert load.process_start_s == 1.7e9


def test_parse_metrics_refuses_a_page_without_vllm_gauges() -> None:
    with pytest.raises(MetricsError, match="num_requests_running"):
        parse_metrics("# TYPE x gauge\nx 1\n")


DISABLED_PAGE = Path(__file__).parents[2] / "data" / "vllm-0.32.0-metrics-disable-log-stats.txt"


def test_a_vllm_started_with_disable_log_stats_is_named_as_such() -> None:
    # The page real vLLM serves with --disable-log-stats (recorded; the file says how).
    with pytest.raises(StatsDisabledError, match="started with --disable-log-stats"):
        parse_metrics(DISABLED_PAGE.read_text())


def load(seen: int) -> VllmLoad:
    return VllmLoad(seen, 0, 0.0, 0, 0, None)


def test_admissions_follow_arrivals_oldest_decision_first() -> None:
    tracker = AdmissionTracker()
    assert tracker.admitted(load(5), 0.0) == []  # baseline
    tracker.assigned("r1", 0.0)
    tracker.assigned("r2", 0.0)
    tracker.assigned("r3", 0.0)
    assert tracker.admitted(load(7), 0.1) == ["r1", "r2"]
    assert tracker.admitted(load(7), 0.2) == []
    assert tracker.admitted(load(8), 0.3) == ["r3"]


def test_an_arrival_seen_before_its_decision_is_credited() -> None:
    tracker = AdmissionTracker(credit_ttl_s=2.0)
    tracker.admitted(load(0), 0.0)
    assert tracker.admitted(load(1), 0.1) == []
    tracker.assigned("late", 0.5)
    assert tracker.admitted(load(1), 0.6) == ["late"]


def test_undelivered_assignments_expire() -> None:
    tracker = AdmissionTracker(pending_ttl_s=1.0, credit_ttl_s=0.1)
    tracker.admitted(load(0), 0.0)
    tracker.assigned("lost", 0.0)
    assert tracker.admitted(load(0), 5.0) == []
    assert len(tracker) == 0
    assert tracker.admitted(load(1), 5.1) == []


def test_the_prefill_request_carries_the_gateways_decision_budget() -> None:
    from eldr.vllm.pd import XARG_DECISION_BUDGET, prefill_body

    body = {"prompt": "x", "vllm_xargs": {XARG_DECISION_BUDGET: 999}}
    assert prefill_body(body, "r", "_INBOX.x", 0.25)["vllm_xargs"][XARG_DECISION_BUDGET] == 0.25
    # Only the gateway sets it: a client's own value does not reach the engine.
    assert XARG_DECISION_BUDGET not in prefill_body(body, "r", "_INBOX.x")["vllm_xargs"]


def test_the_prompt_stays_raw_json_and_is_forwarded_verbatim() -> None:
    import msgspec

    from eldr.vllm.pd import encode_body, parse_body, prefill_body

    data = b'{"model": "m", "prompt": [1, 2,  3], "max_tokens": 7, "stream": false}'
    body = parse_body(data, chat=False)
    assert isinstance(body["prompt"], msgspec.Raw)
    assert body["max_tokens"] == 7
    out = msgspec.json.decode(encode_body(prefill_body(body, "r", "_INBOX.x")))
    assert out["prompt"] == [1, 2, 3]
    assert out["max_tokens"] == 1
    assert b"[1, 2,  3]" in encode_body(body)  # the client's bytes, as they came
    chat = parse_body(b'{"messages": [{"role": "user", "content": "hi"}]}', chat=True)
    assert isinstance(chat["messages"], msgspec.Raw)


def test_aborted_requests_count_as_arrivals() -> None:
    # vLLM counts a request its API server aborted in none of running, waiting or
    # request_success: without the gateway's abort events, the abort hides an arrival.
    tracker = AdmissionTracker()
    tracker.admitted(load(2), 0.0)  # two running
    tracker.assigned("r1", 0.1)
    tracker.abort()  # one of the two was aborted ...
    # ... and r1 arrived in the same interval: the page shows 2 again.
    assert tracker.admitted(load(2), 0.2) == ["r1"]
    tracker.reset()  # a restarted instance: its counters (and the aborts) start again
    assert tracker.aborted == 0


def test_connectors_the_gateway_drives_and_why_not_the_others() -> None:
    assert connector_problem("NixlConnector") is None
    assert connector_problem("ExampleConnector") is None
    mooncake = connector_problem("MooncakeConnector")
    assert mooncake is not None
    assert "transfer id" in mooncake
    assert "NixlConnector (pull)" in mooncake
    assert "no KV connector" in (connector_problem(None) or "")
    assert "cannot drive" in (connector_problem("SomeNewConnector") or "")
