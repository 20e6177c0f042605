"""`ReadBack`: an ordered read of a stream (an ordered ephemeral consumer), started by
`Bus.read_back`.

Every message of the filter from a start point, in stream order, then live ones; a failing
handler is logged and skipped. A message that does not decode is dead-lettered, or handed
to `on_undecodable` as an `Undecodable` (read-only readers publish nothing); a refused one
(`Reject`, an identity mismatch) is counted and dead-lettered (only counted with
`on_undecodable`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TypeVar

import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from eldr.bus.deadletters import one_line
from eldr.bus.delivery import Delivery, Handler, Receiver, ReceiverBus, Undecodable, delivery_of
from eldr.bus.errors import Reject
from eldr.wire import Message, WireError
from eldr.wire.base import MAX_TEXT_LEN

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)


class ReadBack(Receiver[M, None]):
    """An ordered read of a stream started by `Bus.read_back`."""

    stop_order = 1

    def __init__(
        self,
        bus: ReceiverBus,
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
        delivery = delivery_of(msg)
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
