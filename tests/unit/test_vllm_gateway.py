"""The gateway's bookkeeping (`eldr.vllm.gateway`) and its request shaping helpers in
`eldr.vllm.pd` (candidate order, response headers, outcome labels)."""

from __future__ import annotations

import asyncio

import pytest

from eldr.bus import BusError
from eldr.vllm.capture import Geometry
from eldr.vllm.gateway import DecisionWaiters, InFlight, response_sources
from eldr.vllm.pd import (
    DECODE_WORKER_HEADER,
    REQUEST_ID_HEADER,
    LeastOutstanding,
    decode_order,
    request_outcome,
    response_headers,
)
from eldr.wire import Decision
from support import messages


def decision(request_id: str = "r", worker: str = "d1") -> Decision:
    return messages.decision(request_id, worker, ts_s=0.0, policy="eldr", partition_version=1)


async def never(_: str) -> Decision | None:
    raise AssertionError("the stream must not be read")


async def nothing(_: str) -> Decision | None:
    return None


# --- decisions ---------------------------------------------------------------------------


async def test_a_decision_from_the_inbox_is_returned_as_such() -> None:
    waiters = DecisionWaiters()
    with waiters.expecting("r") as waiter:
        waiters.deliver(decision("r", "d2"))
        got, source = await waiters.wait("r", waiter, timeout_s=1.0, read_late=never)
    assert (got.worker_id, source) == ("d2", "inbox")


async def test_a_late_decision_is_read_from_the_stream() -> None:
    waiters = DecisionWaiters()
    asked: list[str] = []

    async def from_stream(request_id: str) -> Decision | None:
        asked.append(request_id)
        return decision(request_id, "d3")

    with waiters.expecting("r") as waiter:
        got, source = await waiters.wait("r", waiter, timeout_s=0.01, read_late=from_stream)
    assert (got.worker_id, source, asked) == ("d3", "stream", ["r"])


async def test_no_decision_anywhere_is_a_lookup_error() -> None:
    waiters = DecisionWaiters()
    with waiters.expecting("r") as waiter, pytest.raises(LookupError, match="no decision for r"):
        await waiters.wait("r", waiter, timeout_s=0.01, read_late=nothing)


async def test_a_failed_stream_read_counts_as_no_decision() -> None:
    waiters = DecisionWaiters()

    async def broken(_: str) -> Decision | None:
        raise BusError("down")

    with waiters.expecting("r") as waiter, pytest.raises(LookupError):
        await waiters.wait("r", waiter, timeout_s=0.01, read_late=broken)


async def test_decisions_nobody_waits_for_are_dropped() -> None:
    waiters = DecisionWaiters()
    with waiters.expecting("r") as waiter:
        waiters.deliver(decision("other"))
        assert not waiter.done()
    assert len(waiters) == 0
    waiters.deliver(decision("r"))  # after the request finished: no error
    assert not waiter.done()


# --- in flight ---------------------------------------------------------------------------


async def test_draining_refuses_new_requests_and_waits_for_those_in_flight() -> None:
    requests = InFlight()
    assert requests.enter()
    drained = asyncio.create_task(requests.drain(grace_s=10.0))
    await asyncio.sleep(0)  # let the drain start
    assert not requests.enter()
    assert not drained.done()
    requests.leave()
    await asyncio.wait_for(drained, 1.0)
    assert requests.count == 0


async def test_draining_gives_up_after_the_grace_period() -> None:
    requests = InFlight()
    requests.enter()
    await asyncio.wait_for(requests.drain(grace_s=0.01), 1.0)
    assert requests.count == 1


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
    upstream = [("Content-Type", "application/json"), ("Content-Length", "12"), ("X-A", "1")]
    assert response_headers(upstream, "rid", "d1") == {
        "Content-Type": "application/json",
        "X-A": "1",
        REQUEST_ID_HEADER: "rid",
        DECODE_WORKER_HEADER: "d1",
    }


@pytest.mark.parametrize(
    ("status", "outcome"),
    [
        (200, "ok"),
        (399, "ok"),
        (400, "client_error"),
        (499, "client_error"),
        (502, "upstream_error"),
    ],
)
def test_request_outcome_by_status(status: int, outcome: str) -> None:
    assert request_outcome(status) == outcome


def test_one_response_source_per_prefill_instance() -> None:
    sources = response_sources(
        ["p0", "p1"], model_key="m", block_size=16, geometry=Geometry(2, 8, 2)
    )
    assert sorted(sources) == ["p0", "p1"]
    assert sources["p1"].state.config.worker_id == "p1"
