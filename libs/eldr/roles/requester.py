"""The requester: what waits for a request's routing decision and says when it ended.

- `DecisionWaiters`: the decisions requests in flight wait for, delivered from the
  requester's decision inbox, with the DECISIONS stream as the second source when the reply
  does not come in time;
- `InFlight`: requests being served, refused once draining starts, and the wait for the
  last one to end;
- `FinishTracker`: the end of one request (any number of moves to another worker, then
  exactly one final reason) as `RequestFinished` events.

Played by the gateway (`eldr_services.gateway`) and by the simulated gateway
(`eldr.sim.traffic`). Transport stays with them: a waiter is handed each decision that
arrives, and the stream is read through the callable it is given. Clocks come in as
arguments.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Literal

from eldr.aio import wait_event
from eldr.wire import Decision, RequestFinished
from eldr.wire.messages import FinishReason

DecisionSource = Literal["inbox", "stream"]


@dataclass(frozen=True)
class Decided:
    """A request's decision as its requester got it."""

    decision: Decision
    """Possibly an expired record (`decision.assigned` False: the router took the event
    after its deadline and chose no worker): the requester then falls back as when there
    is no decision."""
    source: DecisionSource
    arrived_s: float | None
    """When it came on the inbox, by the waiters' clock (None: no clock, or read from the
    stream)."""


class DecisionWaiters:
    """Per request id, the future its routing decision is delivered to; with `clock`, each
    delivery is stamped with its arrival time (the decision latency the simulated gateway
    measures)."""

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self._clock = clock
        self._waiters: dict[str, asyncio.Future[tuple[Decision, float | None]]] = {}

    def __len__(self) -> int:
        return len(self._waiters)

    @contextlib.contextmanager
    def expecting(self, request_id: str) -> Iterator[asyncio.Future[tuple[Decision, float | None]]]:
        """Wait for `request_id`'s decision while in the block (enter it before the
        prefill is sent: the decision can come before its response)."""
        waiter: asyncio.Future[tuple[Decision, float | None]] = (
            asyncio.get_running_loop().create_future()
        )
        self._waiters[request_id] = waiter
        try:
            yield waiter
        finally:
            self._waiters.pop(request_id, None)

    def deliver(self, decision: Decision) -> bool:
        """A decision from the inbox; one nobody waits for (any more) is dropped (False)."""
        waiter = self._waiters.get(decision.request_id)
        if waiter is None or waiter.done():
            return False
        waiter.set_result((decision, None if self._clock is None else self._clock()))
        return True

    async def wait(
        self,
        request_id: str,
        waiter: asyncio.Future[tuple[Decision, float | None]],
        *,
        timeout_s: float,
        read_late: Callable[[str], Awaitable[Decision | None]],
    ) -> Decided | None:
        """The decision for `request_id` and where it came from: the inbox within
        `timeout_s`, else `read_late` (the DECISIONS stream; the reply may have been
        lost). None when there is none. An expired decision on the inbox is final (the
        stream holds the same record). `read_late`'s errors are the caller's."""
        with contextlib.suppress(TimeoutError):
            # The waiter outlives a timeout (shielded: a late delivery finds it done).
            async with asyncio.timeout(timeout_s):
                decision, arrived_s = await asyncio.shield(waiter)
            return Decided(decision, "inbox", arrived_s)
        late = await read_late(request_id)
        return None if late is None else Decided(late, "stream", None)


class InFlight:
    """Requests being served; once `drain` starts, new ones are refused."""

    def __init__(self) -> None:
        self.accepting = True
        self.count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> bool:
        """Count a request in (False while draining: refuse it)."""
        if not self.accepting:
            return False
        self.count += 1
        self._idle.clear()
        return True

    def leave(self) -> None:
        self.count -= 1
        if self.count == 0:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` until none is in flight; False if some still are."""
        await wait_event(self._idle, timeout_s)
        return self.count == 0

    async def drain(self, grace_s: float) -> None:
        """Refuse new requests and wait up to `grace_s` for those in flight."""
        self.accepting = False
        await self.wait_idle(grace_s)


class FinishTracker:
    """One request's finish events: any number of "moved", then exactly one final. Keyed
    by the requester's request id; the client's own id rides along as a label."""

    def __init__(
        self,
        request_id: str,
        gateway_id: str,
        wall_clock: Callable[[], float],
        client_request_id: str | None = None,
    ):
        self.request_id = request_id
        self.gateway_id = gateway_id
        self.client_request_id = client_request_id
        self._wall = wall_clock
        self.final: RequestFinished | None = None

    def moved(self, worker_id: str, to_worker: str) -> RequestFinished:
        return RequestFinished(
            request_id=self.request_id,
            gateway_id=self.gateway_id,
            ts_s=self._wall(),
            reason="moved",
            worker_id=worker_id,
            moved_to=to_worker,
            client_request_id=self.client_request_id,
        )

    def finished(
        self,
        worker_id: str | None,
        reason: FinishReason,
        *,
        output_tokens: int | None = None,
        decode_s: float | None = None,
    ) -> RequestFinished | None:
        """The final event, or None if one was made already."""
        if self.final is not None:
            return None
        self.final = RequestFinished(
            request_id=self.request_id,
            gateway_id=self.gateway_id,
            ts_s=self._wall(),
            reason=reason,
            worker_id=worker_id,
            output_tokens=output_tokens,
            decode_s=None if decode_s is None else max(0.0, decode_s),
            client_request_id=self.client_request_id,
        )
        return self.final


__all__ = ["Decided", "DecisionSource", "DecisionWaiters", "FinishTracker", "InFlight"]
