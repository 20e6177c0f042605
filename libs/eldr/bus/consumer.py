"""`Consumer`: a JetStream durable pull consumer, started by `Bus.consume`.

At-least-once: a handler that returns acks; `Retry` naks with a delay; any other exception
naks with backoff until the consumer's max_deliver, after which the message is
dead-lettered and terminated. Undecodable and refused (`Reject`, an identity mismatch)
messages are dead-lettered and terminated at once. A pull that the server refuses (status
503: the consumer has no leader; 409) or that cannot be sent is retried after a jittered
backoff (`PULL_BACKOFF_FIRST_S` to `PULL_BACKOFF_MAX_S`), never in a tight loop.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import time
from typing import TypeVar

import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription as NatsSubscription
from nats.js import JetStreamContext

from eldr.aio import wait_event
from eldr.bus.delivery import Delivery, Handler, Receiver, ReceiverBus, delivery_of
from eldr.bus.errors import Reject, Retry
from eldr.bus.transient import Backoff, pull_status_kind, transient_kind
from eldr.wire import Message, WireError

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)

PULL_BACKOFF_FIRST_S = 0.1
PULL_BACKOFF_MAX_S = 1.0
"""A refused pull (503: no consumer leader; 409) pauses pulling 0.1 s doubling to 1 s
(jittered) per refusal in a row: a consumer without a leader costs a router a few pulls in
its first second and one every 0.5-1 s after, instead of thousands a second, and pulls
again within a second of a new leader."""


class Consumer(Receiver[M, None]):
    """A durable pull consumer driven by standing pull requests (started by `Bus.consume`).

    The consumer keeps `outstanding` messages requested from the server, at most
    `max_concurrency - in_flight`, each pull request asking for at most `batch` and
    expiring after `fetch_timeout_s`. Messages arrive on a private inbox one by one and are
    handled as they come. The server answers an expired request with a 408 status carrying
    how many of it were not delivered, which keeps `outstanding` exact; a request whose
    status never comes (a reconnect) is forgotten a second after its expiry. A refused
    request (503: the consumer has no leader, during an election or without quorum; 409)
    or one that could not be sent pauses pulling for a jittered backoff (`PULL_BACKOFF`,
    doubling per refusal in a row), so the loop never spins; it is counted
    (`eldr_bus_transient_errors_total{op="pull"}`) and logged once per interval.
    """

    stop_order = 0

    def __init__(
        self,
        bus: ReceiverBus,
        stream: str,
        durable: str,
        message_type: type[M],
        handler: Handler[M],
        *,
        next_subject: str,
        max_deliver: int,
        batch: int,
        max_concurrency: int,
        error_backoff_s: float,
        identity: str | None = None,
    ) -> None:
        self._bus = bus
        self._identity = identity
        self.stream = stream
        self.durable = durable
        self._message_type = message_type
        self._handler = handler
        self._next_subject = next_subject
        self.max_deliver = max_deliver
        self._batch = batch
        self._max_concurrency = max_concurrency
        self._error_backoff_s = error_backoff_s
        self._stopping = asyncio.Event()
        self._wakeup = asyncio.Event()
        self._inflight: set[asyncio.Task[None]] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self._inbox = bus._nc.new_inbox()
        self._sub: NatsSubscription | None = None
        # Open pull requests, oldest first: [expiry (monotonic s), messages still owed].
        self._requests: collections.deque[list[float]] = collections.deque()
        self._pull_backoff = Backoff(PULL_BACKOFF_FIRST_S, PULL_BACKOFF_MAX_S, rng=bus.rng)
        self._pull_refusals = 0
        """Pull requests refused (or not sent) in a row."""
        self._pull_paused_until = 0.0
        """No pull request before this (monotonic s): the last ones were refused."""

    async def start(self) -> None:
        self._sub = await self._bus._nc.subscribe(self._inbox, cb=self._on_msg)
        self._loop_task = asyncio.create_task(
            self._run(), name=f"consume {self.stream}/{self.durable}"
        )

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    @property
    def outstanding(self) -> int:
        return int(sum(r[1] for r in self._requests))

    def _settle_request(self, delivered: int = 1) -> None:
        """`delivered` messages of the oldest open request arrived."""
        while delivered > 0 and self._requests:
            head = self._requests[0]
            take = min(delivered, int(head[1]))
            head[1] -= take
            delivered -= take
            if head[1] <= 0:
                self._requests.popleft()

    def _pull_refused(self, kind: str, detail: str) -> None:
        """A pull was refused or not sent: count it and pause pulling for a backoff."""
        self._pull_refusals += 1
        self._bus.metrics.transient_errors.labels("pull", kind).inc()
        self._bus.faults.failed(f"consumer {self.stream}/{self.durable}", kind, detail)
        self._pull_paused_until = time.monotonic() + self._pull_backoff.delay_s(self._pull_refusals)

    def _pull_served(self) -> None:
        if self._pull_refusals:
            self._pull_refusals = 0
            self._pull_paused_until = 0.0
            self._bus.faults.recovered(f"consumer {self.stream}/{self.durable}")

    async def _on_msg(self, msg: Msg) -> None:
        status = JetStreamContext.is_status_msg(msg)
        if status:
            if status != "100":  # 100 = idle heartbeat: nothing to account
                # 404/408: the oldest request ended with what it still owed; 503: no
                # consumer leader (an election, no quorum); 409: refused (max waiting,
                # leadership change, consumer deleted).
                if status in ("404", "408"):
                    self._pull_served()
                else:
                    description = (msg.headers or {}).get("Description", "")
                    self._pull_refused(
                        pull_status_kind(status), f"pull status {status} {description}"
                    )
                if self._requests:
                    self._requests.popleft()
            self._wakeup.set()
            return
        self._settle_request()
        self._pull_served()
        if self._stopping.is_set() and self._loop_task is None:
            return  # stopped: the server redelivers it after ack_wait
        task = asyncio.create_task(self._process(msg))
        self._inflight.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._inflight.discard(task)
        self._wakeup.set()

    async def _run(self) -> None:
        expires_s = self._bus.settings.fetch_timeout_s
        chunk_min = max(1, self._batch // 2)
        while not self._stopping.is_set():
            now = time.monotonic()
            while self._requests and self._requests[0][0] + 1.0 < now:
                self._requests.popleft()  # its status never came (reconnect): forget it
            free = self._max_concurrency - len(self._inflight) - self.outstanding
            paused_s = self._pull_paused_until - now
            if paused_s > 0:
                # The last pulls were refused: wait out the backoff (a handler finishing
                # does not end it; stopping does).
                await wait_event(self._stopping, paused_s)
                continue
            if free >= chunk_min or (free > 0 and not self._requests):
                n = min(free, self._batch)
                request = {"batch": n, "expires": int(expires_s * 1e9)}
                try:
                    await self._bus._nc.publish(
                        self._next_subject, json.dumps(request).encode(), reply=self._inbox
                    )
                except nats.errors.ConnectionClosedError:
                    log.info("consumer %s/%s: connection closed", self.stream, self.durable)
                    return
                except nats.errors.Error as exc:
                    self._pull_refused("disconnected", f"pull not sent: {exc}")
                    continue
                else:
                    self._requests.append([now + expires_s, float(n)])
                    continue
            self._wakeup.clear()
            await wait_event(self._wakeup, expires_s / 2)

    def _backoff_s(self, num_delivered: int) -> float:
        """Redelivery delay after a failed handler: `error_backoff_s` doubling per
        delivery, capped at 60 s, jittered (half to all of it)."""
        cap = min(self._error_backoff_s * 2 ** max(num_delivered - 1, 0), 60.0)
        return float(cap * (0.5 + 0.5 * self._bus.rng.random()))

    async def _process(self, msg: Msg) -> None:
        async def in_progress() -> None:
            await self._settle(msg, "in_progress")

        family = self._bus.subjects.family(msg.subject)
        await self._receive(msg, family, delivery_of(msg, in_progress=in_progress), self._handler)

    def _last_try(self, delivery: Delivery) -> bool:
        return self.max_deliver > 0 and delivery.num_delivered >= self.max_deliver

    async def _on_invalid(self, msg: Msg, family: str, delivery: Delivery, exc: WireError) -> None:
        log.warning(
            "invalid message %s seq %d on %s: %s",
            self.stream,
            delivery.stream_seq,
            msg.subject,
            exc,
        )
        await self._give_up(msg, delivery, str(exc))

    async def _on_refused(self, msg: Msg, family: str, delivery: Delivery, refusal: Reject) -> None:
        # Never redelivered: the same message would be refused again.
        stored = await self._bus._refuse(
            msg,
            family,
            refusal,
            stream=delivery.stream,
            stream_seq=delivery.stream_seq,
            num_delivered=delivery.num_delivered,
        )
        if stored:
            await self._settle(msg, "term")
        else:
            await self._settle(msg, "nak", delay_s=self._backoff_s(delivery.num_delivered))

    async def _on_failed(self, msg: Msg, family: str, delivery: Delivery, exc: Exception) -> None:
        metrics = self._bus.metrics
        if isinstance(exc, Retry):
            if self._last_try(delivery):
                metrics.rejected.labels(family, "exhausted").inc()
                await self._give_up(msg, delivery, f"retry limit reached: {exc.reason}")
            else:
                metrics.retried.labels(family).inc()
                await self._settle(msg, "nak", delay_s=exc.delay_s)
            return
        kind = transient_kind(exc)
        if kind is not None:
            # Expected in a cluster (an election, a node restart): counted, said once per
            # interval, no traceback.
            metrics.transient_errors.labels("handler", kind).inc()
            self._bus.faults.failed(f"handler for {family}", kind, str(exc))
        else:
            self._bus._log_failure(
                family,
                exc,
                "handler for %s seq %d (delivery %d) failed",
                msg.subject,
                delivery.stream_seq,
                delivery.num_delivered,
            )
        metrics.rejected.labels(family, "handler_error").inc()
        if self._last_try(delivery):
            metrics.rejected.labels(family, "exhausted").inc()
            await self._give_up(msg, delivery, f"{type(exc).__name__}: {exc}")
        else:
            metrics.retried.labels(family).inc()
            await self._settle(msg, "nak", delay_s=self._backoff_s(delivery.num_delivered))

    async def _on_handled(self, msg: Msg, delivery: Delivery, result: None) -> None:
        await self._settle(msg, "ack")

    async def _give_up(self, msg: Msg, delivery: Delivery, error: str) -> None:
        """Dead-letter and terminate; if dead-lettering fails keep the message (nak)."""
        stored = await self._bus._dead_letter(
            msg,
            error=error,
            stream=delivery.stream,
            stream_seq=delivery.stream_seq,
            num_delivered=delivery.num_delivered,
        )
        if stored:
            await self._settle(msg, "term")
        else:
            await self._settle(msg, "nak", delay_s=self._backoff_s(delivery.num_delivered))

    async def _settle(self, msg: Msg, how: str, delay_s: float | None = None) -> None:
        try:
            if how == "ack":
                await msg.ack()
            elif how == "nak":
                await msg.nak(delay=delay_s)
            elif how == "in_progress":
                await msg.in_progress()
            else:
                await msg.term()
        except nats.errors.Error as exc:
            # Connection trouble: the server redelivers after ack_wait (at-least-once).
            log.warning("could not %s %s: %s", how, msg.subject, exc)

    async def stop(self) -> None:
        """Stop requesting, let the open requests run out (their messages are handled),
        wait for the handlers in flight (they ack), unsubscribe."""
        self._stopping.set()
        self._wakeup.set()
        if self._loop_task is not None:
            await self._loop_task
        deadline = time.monotonic() + self._bus.settings.fetch_timeout_s + 0.5
        while self._requests and time.monotonic() < deadline:
            self._wakeup.clear()
            await wait_event(self._wakeup, 0.05)
        self._loop_task = None
        while self._inflight:
            await asyncio.gather(*list(self._inflight), return_exceptions=True)
        sub, self._sub = self._sub, None
        if sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()

    def cancel(self) -> None:
        self._stopping.set()
        if self._loop_task is not None:
            self._loop_task.cancel()
        for task in list(self._inflight):
            task.cancel()
