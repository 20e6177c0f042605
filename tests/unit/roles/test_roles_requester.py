"""The requester's role (`eldr.roles.requester`): decision waiters, in-flight count, finish
events, as the gateway and the simulated gateway play it."""

from __future__ import annotations

import asyncio

import pytest

from eldr.bus import BusError
from eldr.roles.requester import DecisionWaiters, FinishTracker, InFlight
from eldr.wire import Decision
from eldr.wire.messages import NO_WORKER
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
        assert waiters.deliver(decision("r", "d2"))
        got = await waiters.wait("r", waiter, timeout_s=1.0, read_late=never)
    assert got is not None
    assert (got.decision.worker_id, got.source, got.arrived_s) == ("d2", "inbox", None)


async def test_with_a_clock_a_delivery_is_stamped_with_its_arrival() -> None:
    waiters = DecisionWaiters(clock=lambda: 7.5)
    with waiters.expecting("r") as waiter:
        waiters.deliver(decision("r"))
        got = await waiters.wait("r", waiter, timeout_s=1.0, read_late=never)
    assert got is not None
    assert got.arrived_s == 7.5


async def test_a_late_decision_is_read_from_the_stream() -> None:
    waiters = DecisionWaiters(clock=lambda: 1.0)
    asked: list[str] = []

    async def from_stream(request_id: str) -> Decision | None:
        asked.append(request_id)
        return decision(request_id, "d3")

    with waiters.expecting("r") as waiter:
        got = await waiters.wait("r", waiter, timeout_s=0.01, read_late=from_stream)
    assert got is not None
    assert (got.decision.worker_id, got.source, got.arrived_s, asked) == (
        "d3",
        "stream",
        None,
        ["r"],
    )


async def test_no_decision_anywhere_is_none() -> None:
    waiters = DecisionWaiters()
    with waiters.expecting("r") as waiter:
        assert await waiters.wait("r", waiter, timeout_s=0.01, read_late=nothing) is None


async def test_an_expired_decision_on_the_inbox_is_final_and_says_so() -> None:
    """The stream holds the same record: it is not read; the caller sees no worker."""
    waiters = DecisionWaiters()
    expired = messages.decision("r", NO_WORKER, ts_s=0.0, outcome="expired")
    with waiters.expecting("r") as waiter:
        waiters.deliver(expired)
        got = await waiters.wait("r", waiter, timeout_s=1.0, read_late=never)
    assert got is not None
    assert (got.source, got.decision.assigned) == ("inbox", False)


async def test_a_failed_stream_read_is_the_callers() -> None:
    """The gateway counts it as no decision, the simulator as the request's error."""
    waiters = DecisionWaiters()

    async def broken(_: str) -> Decision | None:
        raise BusError("down")

    with waiters.expecting("r") as waiter, pytest.raises(BusError):
        await waiters.wait("r", waiter, timeout_s=0.01, read_late=broken)


@pytest.mark.parametrize("turns", [0, 1])
async def test_a_cancellation_that_comes_with_the_decision_is_kept(turns: int) -> None:
    """The client's hang-up (its handler's cancellation) in the same moment as the decision
    ends the wait. Python 3.11's wait_for returned the decision and lost the cancellation
    (turns = 1 here), and the gateway decoded a whole answer for nobody."""
    waiters = DecisionWaiters()
    with waiters.expecting("r") as waiter:
        wait = asyncio.create_task(waiters.wait("r", waiter, timeout_s=10.0, read_late=never))
        await asyncio.sleep(0)  # the wait is in
        assert waiters.deliver(decision("r"))
        for _ in range(turns):
            await asyncio.sleep(0)
        wait.cancel()
        with pytest.raises(asyncio.CancelledError):
            await wait


async def test_decisions_nobody_waits_for_are_dropped() -> None:
    waiters = DecisionWaiters()
    with waiters.expecting("r") as waiter:
        assert not waiters.deliver(decision("other"))
        assert not waiter.done()
    assert len(waiters) == 0
    assert not waiters.deliver(decision("r"))  # after the request finished: no error
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


async def test_waiting_for_idle_keeps_accepting() -> None:
    requests = InFlight()
    assert await requests.wait_idle(0.01)
    requests.enter()
    assert not await requests.wait_idle(0.01)
    assert requests.enter()
    requests.leave()
    requests.leave()
    assert await requests.wait_idle(0.01)


# --- the end of each request --------------------------------------------------------------


def test_a_finish_tracker_makes_one_final_event_after_any_moves() -> None:
    tracker = FinishTracker("r", "gw", lambda: 5.0)
    move = tracker.moved("d0", "d1")
    assert (move.reason, move.worker_id, move.moved_to) == ("moved", "d0", "d1")
    final = tracker.finished("d1", "stop", output_tokens=3, decode_s=-1.0)
    assert final is not None
    assert (final.reason, final.worker_id, final.decode_s) == ("stop", "d1", 0.0)
    assert tracker.finished("d1", "error") is None
    assert tracker.final is final
