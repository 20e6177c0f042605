"""Receivers: the `Receiving` side of `Bus` (serve, subscribe, consume, read back) and the
core receivers, `Service` (request/reply) and `Subscription`. The one receive sequence
every path runs and what it delivers are in `eldr.bus.delivery`; the durable pull consumer
in `eldr.bus.consumer`; the ordered read-back in `eldr.bus.readback`.

Every inbound message is size-checked and decoded with `eldr.wire.decode` before a
handler sees it; handlers receive typed messages and a `Delivery` (no nats types).
Delivery contracts:

- `consume` (`Consumer`, a JetStream durable pull consumer): at-least-once. A handler that
  returns acks; `Retry` naks with a delay; any other exception naks with backoff until the
  consumer's max_deliver, after which the message is dead-lettered and terminated.
  Undecodable messages are dead-lettered and terminated at once. A pull that the server
  refuses (status 503: the consumer has no leader; 409) or that cannot be sent is retried
  after a jittered backoff, never in a tight loop.
- `read_back` (`ReadBack`, an ordered ephemeral consumer): every message of the filter from
  a start point, in stream order, then live ones; a failing handler is logged and skipped.
- `serve` (`Service`, core request/reply): handlers run concurrently (bounded); invalid
  requests are dead-lettered and answered with an error, handler failures are answered
  with an error, both in the NATS service protocol's headers (`nats.micro`:
  `Nats-Service-Error`, `Nats-Service-Error-Code`). `request` turns such answers into
  `RemoteError`.
- `subscribe` (`Subscription`, core): at-most-once, one message at a time in arrival order.

Refusals: a handler that raises `Reject(reason)` refuses a well-formed message for what
it claims; every path counts it (`eldr_bus_messages_rejected_total{family, reason}`),
logs it, dead-letters it (`eldr.bus.deadletters`) and, for `consume`, terminates it (never
a redelivery); `serve` answers error code 403. `subscribe`, `consume` and `read_back` take
`identity=FIELD`: a message whose FIELD is not the last token of the subject it came on
(the token its sender is permitted to publish on: `load.<worker>` for
`LoadReport.worker_id`) is refused as `identity_mismatch` before the handler sees it, so a
worker can speak only for itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from collections.abc import Callable
from typing import Generic, TypeVar

import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription as NatsSubscription
from nats.js import api
from nats.micro.request import ERROR_CODE_HEADER, ERROR_HEADER

from eldr.bus.connection import translated
from eldr.bus.consumer import Consumer
from eldr.bus.deadletters import DeadLettering, one_line
from eldr.bus.delivery import Delivery, Handler, Receiver, RequestHandler, Undecodable
from eldr.bus.errors import Reject
from eldr.bus.readback import ReadBack
from eldr.wire import Message, WireError, decode, encode

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)
R = TypeVar("R", bound=Message)

REFUSED_CODE = "403"
"""Error code (`Nats-Service-Error-Code`) of a request a handler refused (`Reject`)."""


class Receiving(DeadLettering):
    """The bus's receiving side: serve, subscribe, consume, read back. It is the
    `ReceiverBus` (`eldr.bus.delivery`) its receivers use."""

    async def serve(
        self,
        subject: str,
        queue: str | None,
        request_type: type[M],
        handler: RequestHandler[M, R],
        *,
        max_concurrency: int = 64,
    ) -> Service:
        """Answer requests on `subject` with `handler`'s reply.

        `queue`: a queue group (one member answers each request) or None (every
        subscriber answers). Up to `max_concurrency` handlers run at once.
        """
        service: Service = Service(self, subject, request_type, handler, max_concurrency)
        with translated(f"subscribe to {subject}"):
            service.sub = await self._nc.subscribe(subject, queue=queue or "", cb=service.on_msg)
        await self._sync()  # requests sent after serve() returns reach this server
        self._handles.append(service)
        log.info("serving %s (queue %s)", subject, queue)
        return service

    async def subscribe(
        self,
        subject: str,
        message_type: type[M],
        handler: Handler[M],
        *,
        queue: str | None = None,
        identity: str | None = None,
    ) -> Subscription:
        """Core subscription: `handler(message, delivery)` for each valid message, one at a
        time, in arrival order. Invalid messages are counted and dead-lettered; with
        `identity`, so is a message whose field of that name is not the subject's last
        token (module docstring)."""
        subscription: Subscription = Subscription(
            self, subject, message_type, handler, identity=identity
        )
        with translated(f"subscribe to {subject}"):
            subscription.sub = await self._nc.subscribe(
                subject, queue=queue or "", cb=subscription.on_msg
            )
        await self._sync()  # messages published after this returns reach the handler
        self._handles.append(subscription)
        return subscription

    # --- JetStream consumers ---------------------------------------------------------

    async def consume(
        self,
        stream: str,
        durable: str,
        message_type: type[M],
        handler: Handler[M],
        *,
        batch: int = 16,
        max_concurrency: int = 16,
        error_backoff_s: float = 1.0,
        identity: str | None = None,
    ) -> Consumer:
        """Consume the existing durable pull consumer `durable` of `stream`.

        Keeps standing pull requests open for up to `max_concurrency` messages (requested in
        chunks of at most `batch`), so each message is handled the moment the server
        delivers it rather than when a batch fills. Failed handlers are redelivered after
        `error_backoff_s * 2**(deliveries - 1)` (capped at 60 s). `identity`: as for
        `subscribe` (a mismatch is dead-lettered and terminated).
        """
        if batch < 1 or max_concurrency < 1:
            raise ValueError("batch and max_concurrency must be >= 1")
        with translated(f"bind consumer {stream}/{durable}"):
            info = await self._js.consumer_info(stream, durable)
        consumer: Consumer = Consumer(
            self,
            stream,
            durable,
            message_type,
            handler,
            next_subject=f"{self._js._prefix}.CONSUMER.MSG.NEXT.{stream}.{durable}",
            max_deliver=info.config.max_deliver or -1,
            batch=batch,
            max_concurrency=max_concurrency,
            error_backoff_s=error_backoff_s,
            identity=identity,
        )
        with translated(f"subscribe to the pull inbox of {stream}/{durable}"):
            await consumer.start()
        self._handles.append(consumer)
        log.info("consuming %s/%s (max_deliver %s)", stream, durable, consumer.max_deliver)
        return consumer

    async def read_back(
        self,
        stream: str,
        subject_filter: str,
        message_type: type[M],
        handler: Handler[M],
        *,
        start_seq: int | None = None,
        start_time_s: float | None = None,
        stop_at_end: bool = False,
        on_undecodable: Callable[[Undecodable], None] | None = None,
        identity: str | None = None,
    ) -> ReadBack:
        """Deliver the messages of `stream` matching `subject_filter` in order, from
        `start_seq` or `start_time_s` (default: the first), then live ones.

        The returned `ReadBack` sets `caught_up` once the messages present at the start have
        been handled; with `stop_at_end` it then stops (and sets `finished`). A message
        that does not decode is counted (`rejected`, reason `invalid` / `too_large`) and
        dead-lettered, or, with `on_undecodable`, handed to that callback instead: nothing
        is published (read-only readers). `identity`: as for `subscribe`; a refused message
        (that or `Reject` from the handler) is counted and dead-lettered (only counted with
        `on_undecodable`).
        """
        if start_seq is not None and start_time_s is not None:
            raise ValueError("give start_seq or start_time_s, not both")
        config = api.ConsumerConfig(deliver_policy=api.DeliverPolicy.ALL)
        if start_seq is not None:
            config.deliver_policy = api.DeliverPolicy.BY_START_SEQUENCE
            config.opt_start_seq = start_seq
        elif start_time_s is not None:
            config.deliver_policy = api.DeliverPolicy.BY_START_TIME
            config.opt_start_time = dt.datetime.fromtimestamp(start_time_s, tz=dt.UTC)
        reader: ReadBack = ReadBack(
            self,
            stream,
            subject_filter,
            message_type,
            handler,
            stop_at_end,
            on_undecodable,
            identity=identity,
        )
        with translated(f"read back {stream} {subject_filter}"):
            reader.sub = await self._js.subscribe(
                subject_filter,
                stream=stream,
                cb=reader.on_msg,
                ordered_consumer=True,
                config=config,
                idle_heartbeat=self._settings.replay_heartbeat_s,
            )
            info = await reader.sub.consumer_info()
        # nats-py re-creates an ordered consumer that stopped delivering (a server restart
        # loses it) from its first request, switched to "deliver from sequence N". A start
        # time left in that request makes the server refuse it (error 10094): the read-back
        # would stop for good (found by tests/faults: the trainer stopped learning).
        jsi = getattr(getattr(reader.sub, "_sub", None), "_jsi", None)
        ccreq = getattr(jsi, "_ccreq", None)
        if ccreq is not None:
            ccreq.opt_start_time = None
        reader.check_initially_caught_up(
            num_pending=info.num_pending or 0,
            delivered=info.delivered.consumer_seq if info.delivered else 0,
        )
        self._handles.append(reader)
        return reader

    # --- internals shared by the receivers -------------------------------------------

    def _decode_inbound(self, data: bytes, message_type: type[M], family: str) -> M:
        """Decode or raise WireError, counting the rejection."""
        if len(data) > self._settings.max_payload_bytes:
            self.metrics.rejected.labels(family, "too_large").inc()
        try:
            return decode(data, message_type, self._settings.max_payload_bytes)
        except WireError:
            if len(data) <= self._settings.max_payload_bytes:
                self.metrics.rejected.labels(family, "invalid").inc()
            raise

    async def _respond(self, reply: str, data: bytes, headers: dict[str, str] | None) -> None:
        try:
            await self._nc.publish(reply, data, headers=headers)
        except nats.errors.Error as exc:
            log.warning("could not answer on %s: %s", reply, exc)


class Service(Receiver[M, bytes], Generic[M, R]):
    """A request/reply server started by `Bus.serve`."""

    stop_order = 2

    def __init__(
        self,
        bus: Receiving,
        subject: str,
        request_type: type[M],
        handler: RequestHandler[M, R],
        max_concurrency: int,
    ) -> None:
        self._bus = bus
        self.subject = subject
        self._message_type = request_type
        self._handler = handler
        self._family = bus.subjects.family(subject)
        self._slots = asyncio.Semaphore(max_concurrency)
        self._tasks: set[asyncio.Task[None]] = set()
        self.sub: NatsSubscription | None = None

    async def on_msg(self, msg: Msg) -> None:
        # Runs in the subscription's single task: waiting for a slot here applies
        # backpressure instead of piling up unbounded handler tasks.
        await self._slots.acquire()
        task = asyncio.create_task(self._handle(msg))
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._slots.release()

    async def _handle(self, msg: Msg) -> None:
        await self._receive(msg, self._family, Delivery(subject=msg.subject), self._answer)

    async def _answer(self, request: M, delivery: Delivery) -> bytes:
        # Encoding belongs to the handler's outcome: a reply that does not encode is a 500.
        return encode(await self._handler(request))

    async def _error_answer(self, msg: Msg, text: str, code: str) -> None:
        if msg.reply:
            await self._bus._respond(
                msg.reply, b"", {ERROR_HEADER: one_line(text), ERROR_CODE_HEADER: code}
            )

    async def _on_invalid(self, msg: Msg, family: str, delivery: Delivery, exc: WireError) -> None:
        log.warning("invalid request on %s: %s", msg.subject, exc)
        await self._error_answer(msg, str(exc), "400")
        await self._bus._dead_letter(msg, error=str(exc))

    async def _on_refused(self, msg: Msg, family: str, delivery: Delivery, refusal: Reject) -> None:
        await self._error_answer(msg, str(refusal), REFUSED_CODE)
        await self._bus._refuse(msg, family, refusal)

    async def _on_failed(self, msg: Msg, family: str, delivery: Delivery, exc: Exception) -> None:
        log.exception("request handler for %s failed", msg.subject)
        self._bus.metrics.rejected.labels(family, "handler_error").inc()
        await self._error_answer(msg, f"{type(exc).__name__}: {exc}", "500")

    async def _on_handled(self, msg: Msg, delivery: Delivery, result: bytes) -> None:
        if msg.reply:
            await self._bus._respond(msg.reply, result, None)

    async def stop(self) -> None:
        """Stop taking requests; answer the ones already received."""
        if self.sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await self.sub.drain()  # type: ignore[no-untyped-call]
            self.sub = None
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def cancel(self) -> None:
        for task in list(self._tasks):
            task.cancel()


class Subscription(Receiver[M, None]):
    """A core subscription started by `Bus.subscribe`."""

    stop_order = 2

    def __init__(
        self,
        bus: Receiving,
        subject: str,
        message_type: type[M],
        handler: Handler[M],
        *,
        identity: str | None = None,
    ) -> None:
        self._bus = bus
        self.subject = subject
        self._message_type = message_type
        self._handler = handler
        self._identity = identity
        self._family = bus.subjects.family(subject)
        self.sub: NatsSubscription | None = None

    async def on_msg(self, msg: Msg) -> None:
        delivery = Delivery(subject=msg.subject, headers=msg.headers or {})
        await self._receive(msg, self._bus.subjects.family(msg.subject), delivery, self._handler)

    async def stop(self) -> None:
        """Stop receiving; handle the messages already received."""
        if self.sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await self.sub.drain()  # type: ignore[no-untyped-call]
            self.sub = None
