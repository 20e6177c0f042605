"""The one receive sequence (`Receiver`) that every path of the bus (`serve`, `subscribe`,
`consume`, `read_back`) runs an inbound message through, and what it delivers.

`Receiver._receive` counts the message, size-checks and decodes it with `eldr.wire.decode`
(`ReceiverBus._decode_inbound`), checks the sender's identity (`check_identity`), runs the
handler (timed) and hands the outcome to the path's hooks. Handlers receive typed messages
and a `Delivery` (no nats types; `delivery_of` builds a JetStream message's); a read-back
reports a message it could not decode as `Undecodable`. `Handler` and `RequestHandler` are
the handlers' types.

`ReceiverBus` is what the receivers use of the bus (its metrics, subjects, faults, jitter,
settings and client, decoding, dead letters, refusals, failure logs and answers), a
protocol the bus's `Receiving` side satisfies: this module, `eldr.bus.consumer` and
`eldr.bus.readback` do not import the bus, which imports them.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from eldr.bus.connection import Handle
from eldr.bus.errors import Reject
from eldr.bus.metrics import BusMetrics
from eldr.bus.topology import Subjects
from eldr.bus.transient import FaultLog
from eldr.settings import BusSettings
from eldr.wire import Message, WireError

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)
R = TypeVar("R", bound=Message)
T = TypeVar("T")


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


class ReceiverBus(Protocol):
    """What the receivers use of the bus (`Bus` satisfies it through `Receiving`)."""

    @property
    def metrics(self) -> BusMetrics: ...

    @property
    def subjects(self) -> Subjects: ...

    @property
    def faults(self) -> FaultLog: ...

    @property
    def rng(self) -> random.Random: ...

    @property
    def settings(self) -> BusSettings: ...

    @property
    def _nc(self) -> NatsClient: ...

    def _decode_inbound(self, data: bytes, message_type: type[M], family: str) -> M:
        """Decode or raise WireError, counting the rejection."""

    async def _dead_letter(
        self,
        msg: Msg,
        *,
        error: str,
        stream: str | None = None,
        stream_seq: int | None = None,
        num_delivered: int = 0,
    ) -> bool:
        """Publish a DeadLetter for `msg`; False if that failed."""

    async def _refuse(
        self,
        msg: Msg,
        family: str,
        refusal: Reject,
        *,
        stream: str | None = None,
        stream_seq: int | None = None,
        num_delivered: int = 0,
        dead_letter: bool = True,
    ) -> bool:
        """Count, log and dead-letter a refused message; False if the dead letter could not
        be stored."""

    def _log_failure(self, family: str, exc: Exception, message: str, *args: object) -> None:
        """Log a handler failure with its traceback (rate-limited)."""

    async def _respond(self, reply: str, data: bytes, headers: dict[str, str] | None) -> None:
        """Answer a request on `reply`."""


class Receiver(Handle, Generic[M, T]):
    """The one receive sequence of every path (`serve`, `subscribe`, `consume`, `read_back`):
    count, decode, check the sender's identity, run the handler (timed), then hand the
    outcome to the path. Each path says what an outcome means for it (ack or term, an
    error answer, a dead letter, a log line) by overriding the four hooks."""

    _bus: ReceiverBus
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


def delivery_of(msg: Msg, **extra: Any) -> Delivery:
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
