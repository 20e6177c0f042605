"""The gateway's bookkeeping that is neither HTTP nor bus wiring (used by
`eldr_services.gateway`).

- `DecisionWaiters`: the routing decisions requests in flight wait for, delivered from the
  gateway's decision inbox, with the DECISIONS stream as the second source when the reply
  does not come in time;
- `InFlight`: client requests being served, refused once draining starts, and the wait
  for the last one to finish;
- `response_sources`: one `ResponseSource` per prefill instance, when the gateway
  publishes the prefill's routing itself (the routed_experts source).

The pure request shaping (bodies, candidate order, headers) is in `eldr.vllm.pd`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Literal

from eldr.bus.errors import BusError
from eldr.vllm.capture import CaptureConfig, Geometry
from eldr.vllm.sources import ResponseSource
from eldr.wire import Decision

log = logging.getLogger(__name__)

DecisionSource = Literal["inbox", "stream"]


class DecisionWaiters:
    """Per request id, the future its routing decision is delivered to."""

    def __init__(self) -> None:
        self._waiters: dict[str, asyncio.Future[Decision]] = {}

    def __len__(self) -> int:
        return len(self._waiters)

    @contextlib.contextmanager
    def expecting(self, request_id: str) -> Iterator[asyncio.Future[Decision]]:
        """Wait for `request_id`'s decision while in the block (enter it before the
        prefill is sent: the decision can come before its response)."""
        waiter: asyncio.Future[Decision] = asyncio.get_running_loop().create_future()
        self._waiters[request_id] = waiter
        try:
            yield waiter
        finally:
            self._waiters.pop(request_id, None)

    def deliver(self, decision: Decision) -> None:
        """A decision from the inbox; one nobody waits for (any more) is dropped."""
        waiter = self._waiters.get(decision.request_id)
        if waiter is not None and not waiter.done():
            waiter.set_result(decision)

    async def wait(
        self,
        request_id: str,
        waiter: asyncio.Future[Decision],
        *,
        timeout_s: float,
        read_late: Callable[[str], Awaitable[Decision | None]],
    ) -> tuple[Decision, DecisionSource]:
        """The decision for `request_id` and where it came from: the inbox within
        `timeout_s`, else `read_late` (the DECISIONS stream; the reply may have been
        lost). Raises LookupError when there is none."""
        with contextlib.suppress(TimeoutError):
            decision = await asyncio.wait_for(asyncio.shield(waiter), timeout=timeout_s)
            return decision, "inbox"
        try:
            late = await read_late(request_id)
        except BusError as exc:
            log.warning("decision of %s: stream read failed: %s", request_id, exc)
            late = None
        if late is None:
            raise LookupError(f"no decision for {request_id}")
        return late, "stream"


class InFlight:
    """Client requests being served; once `drain` starts, new ones are refused."""

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

    async def drain(self, grace_s: float) -> None:
        """Refuse new requests and wait up to `grace_s` for those in flight."""
        self.accepting = False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout=grace_s)


def response_sources(
    prefills: Iterable[str], *, model_key: str, block_size: int, geometry: Geometry
) -> dict[str, ResponseSource]:
    """Per prefill instance, the source that turns its responses' routed experts into
    block summaries and a PrefillDone published under that instance's id."""
    return {
        name: ResponseSource(CaptureConfig(name, model_key, block_size, geometry))
        for name in prefills
    }
