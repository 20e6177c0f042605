"""Receivers: the one receive sequence (`_Receiver`) and its four paths, started by the
`Receiving` methods of `Bus`.

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
import collections
import contextlib
import datetime as dt
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import nats
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription as NatsSubscription
from nats.js import JetStreamContext, api
from nats.micro.request import ERROR_CODE_HEADER, ERROR_HEADER

from eldr.aio import wait_event
from eldr.bus.connection import Handle, translated
from eldr.bus.deadletters import DeadLettering, one_line
from eldr.bus.errors import Reject, Retry
from eldr.bus.transient import Backoff, pull_status_kind, transient_kind
from eldr.wire import Message, WireError, decode, encode
from eldr.wire.base import MAX_TEXT_LEN

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)
R = TypeVar("R", bound=Message)
T = TypeVar("T")

REFUSED_CODE = "403"
"""Error code (`Nats-Service-Error-Code`) of a request a handler refused (`Reject`)."""
PULL_BACKOFF_FIRST_S = 0.1
PULL_BACKOFF_MAX_S = 1.0
"""A refused pull (503: no consumer leader; 409) pauses pulling 0.1 s doubling to 1 s
(jittered) per refusal in a row: a consumer without a leader costs a router a few pulls in
its first second and one every 0.5-1 s after, instead of thousands a second, and pulls
again within a second of a new leader."""


@dataclass(frozen=True)
class Delivery:
    """Where and how a message arrived."""

    subject: str
    stream: str | None = None
    """Stream of a JetStream message; None for core messages."""
    stream_seq: int | None = None
    num_delivered: int = 1
    """1 on first delivery; more on redeliveries."""
    timestamp_s: float | None = None
    """When JetStream stored the message (Unix seconds); None for core messages."""
    headers: Mapping[str, str] = field(default_factory=dict)
    in_progress: Callable[[], Awaitable[None]] | None = field(
        default=None, compare=False, repr=False
    )
    """`consume` only: tell JetStream the message is still being worked on, which restarts
    its ack wait (a handler that holds a message longer than the consumer's ack wait calls
    it more often than that, or the message is redelivered meanwhile). Never raises."""


@dataclass(frozen=True)
class Undecodable:
    """A stored message that a read-back could not decode, reported instead of dead-lettered
    (`Bus.read_back(on_undecodable=...)`, for readers that must not write, e.g. `eldr export`)."""

    subject: str
    stream: str
    stream_seq: int
    timestamp_s: float | None
    payload_size_bytes: int
    error: str


Handler = Callable[[M, Delivery], Awaitable[None]]
RequestHandler = Callable[[M], Awaitable[R]]


def check_identity(message: Message, subject: str, field_name: str | None) -> None:
    """Raise `Reject("identity_mismatch")` unless `message.<field_name>` is the last token
    of `subject` (the token the sender is permitted to publish on). None: no check."""
    if field_name is None:
        return
    claimed = getattr(message, field_name)
    token = subject.rsplit(".", 1)[-1]
    if claimed != token:
        raise Reject(
            "identity_mismatch",
            f"{type(message).__name__}.{field_name} is {str(claimed)[:80]!r} but it came on "
            f"{subject[:200]}",
        )


class Receiving(DeadLettering):
    """The bus's receiving side: serve, subscribe, consume, read back."""

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


class _Receiver(Handle, Generic[M, T]):
    """The one receive sequence of every path (`serve`, `subscribe`, `consume`, `read_back`):
    count, decode, check the sender's identity, run the handler (timed), then hand the
    outcome to the path. Each path says what an outcome means for it (ack or term, an
    error answer, a dead letter, a log line) by overriding the four hooks."""

    _bus: Receiving
    _message_type: type[M]
    _identity: str | None = None

    async def _receive(
        self,
        msg: Msg,
        family: str,
        delivery: Delivery,
        call: Callable[[M, Delivery], Awaitable[T]],
    ) -> None:
        bus = self._bus
        bus.metrics.received.labels(family).inc()
        try:
            message = bus._decode_inbound(msg.data, self._message_type, family)
        except WireError as exc:
            await self._on_invalid(msg, family, delivery, exc)
            return
        try:
            started = time.perf_counter()
            try:
                check_identity(message, msg.subject, self._identity)
                result = await call(message, delivery)
            finally:
                bus.metrics.handler_seconds.labels(family).observe(time.perf_counter() - started)
        except Reject as refusal:
            await self._on_refused(msg, family, delivery, refusal)
        except Exception as exc:
            # Inside the except block, so the hook can log the traceback.
            await self._on_failed(msg, family, delivery, exc)
        else:
            await self._on_handled(msg, delivery, result)

    async def _on_invalid(self, msg: Msg, family: str, delivery: Delivery, exc: WireError) -> None:
        """The bytes are not a valid message (already counted as too_large / invalid)."""
        log.warning("invalid message on %s: %s", msg.subject, exc)
        await self._bus._dead_letter(msg, error=str(exc))

    async def _on_refused(self, msg: Msg, family: str, delivery: Delivery, refusal: Reject) -> None:
        """The handler (or the identity check) refused the message."""
        await self._bus._refuse(msg, family, refusal)

    async def _on_failed(self, msg: Msg, family: str, delivery: Delivery, exc: Exception) -> None:
        """The handler raised anything else (called inside the except block)."""
        log.exception("handler for %s failed", msg.subject)
        self._bus.metrics.rejected.labels(family, "handler_error").inc()

    async def _on_handled(self, msg: Msg, delivery: Delivery, result: T) -> None:
        """The handler returned `result`."""


def _delivery(msg: Msg, **extra: Any) -> Delivery:
    """A JetStream message's `Delivery` (from its ack-reply metadata)."""
    meta = msg.metadata
    return Delivery(
        subject=msg.subject,
        stream=meta.stream,
        stream_seq=meta.sequence.stream,
        num_delivered=meta.num_delivered,
        timestamp_s=meta.timestamp.timestamp(),
        headers=msg.headers or {},
        **extra,
    )


class Service(_Receiver[M, bytes], Generic[M, R]):
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


class Subscription(_Receiver[M, None]):
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


class Consumer(_Receiver[M, None]):
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
        bus: Receiving,
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
        await self._receive(msg, family, _delivery(msg, in_progress=in_progress), self._handler)

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


class ReadBack(_Receiver[M, None]):
    """An ordered read of a stream started by `Bus.read_back`."""

    stop_order = 1

    def __init__(
        self,
        bus: Receiving,
        stream: str,
        subject_filter: str,
        message_type: type[M],
        handler: Handler[M],
        stop_at_end: bool,
        on_undecodable: Callable[[Undecodable], None] | None = None,
        *,
        identity: str | None = None,
    ) -> None:
        self._bus = bus
        self._on_undecodable = on_undecodable
        self._identity = identity
        self.stream = stream
        self.subject_filter = subject_filter
        self._message_type = message_type
        self._handler = handler
        self._stop_at_end = stop_at_end
        self.caught_up = asyncio.Event()
        """Set once the messages present when the read-back started have been handled."""
        self.finished = asyncio.Event()
        """Set when the read-back stopped (stop_at_end, or `stop()`)."""
        self.handled = 0
        self.last_stream_seq = 0
        self.sub: JetStreamContext.PushSubscription | None = None
        self._stop_task: asyncio.Task[None] | None = None

    def check_initially_caught_up(self, *, num_pending: int, delivered: int) -> None:
        if num_pending == 0 and delivered <= self.handled:
            self._mark_caught_up()

    def _mark_caught_up(self) -> None:
        if self.caught_up.is_set():
            return
        self.caught_up.set()
        log.info(
            "read-back of %s %s caught up at seq %d (%d handled)",
            self.stream,
            self.subject_filter,
            self.last_stream_seq,
            self.handled,
        )
        if self._stop_at_end and self._stop_task is None:
            self.finished.set()  # later messages are ignored from now on
            self._stop_task = asyncio.create_task(self.stop())

    async def wait_caught_up(self, timeout_s: float | None = None) -> None:
        """Wait until `caught_up` (raises TimeoutError after `timeout_s`)."""
        async with asyncio.timeout(timeout_s):
            await self.caught_up.wait()

    async def on_msg(self, msg: Msg) -> None:
        if self.finished.is_set():
            return
        delivery = _delivery(msg)
        self.last_stream_seq = delivery.stream_seq or 0
        family = self._bus.subjects.family(msg.subject)
        await self._receive(msg, family, delivery, self._handler)
        self.handled += 1
        if msg.metadata.num_pending == 0:
            self._mark_caught_up()

    async def _on_invalid(self, msg: Msg, family: str, delivery: Delivery, exc: WireError) -> None:
        if self._on_undecodable is None:
            log.warning(
                "read-back %s seq %d: invalid message: %s", self.stream, delivery.stream_seq, exc
            )
            await self._bus._dead_letter(
                msg,
                error=str(exc),
                stream=delivery.stream,
                stream_seq=delivery.stream_seq,
                num_delivered=delivery.num_delivered,
            )
            return
        log.debug("read-back %s seq %d: invalid message: %s", self.stream, delivery.stream_seq, exc)
        self._on_undecodable(
            Undecodable(
                subject=msg.subject,
                stream=delivery.stream or self.stream,
                stream_seq=delivery.stream_seq or 0,
                timestamp_s=delivery.timestamp_s,
                payload_size_bytes=len(msg.data),
                error=one_line(str(exc), MAX_TEXT_LEN),
            )
        )

    async def _on_refused(self, msg: Msg, family: str, delivery: Delivery, refusal: Reject) -> None:
        await self._bus._refuse(
            msg,
            family,
            refusal,
            stream=delivery.stream,
            stream_seq=delivery.stream_seq,
            num_delivered=delivery.num_delivered,
            dead_letter=self._on_undecodable is None,
        )

    async def _on_failed(self, msg: Msg, family: str, delivery: Delivery, exc: Exception) -> None:
        log.exception("read-back handler for %s seq %d failed", msg.subject, delivery.stream_seq)
        self._bus.metrics.rejected.labels(family, "handler_error").inc()

    async def stop(self) -> None:
        """Stop delivering (the server deletes the ephemeral consumer)."""
        self.finished.set()
        sub, self.sub = self.sub, None
        if sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()

    def cancel(self) -> None:
        self.finished.set()
