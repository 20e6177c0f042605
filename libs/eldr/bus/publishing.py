"""Publishing and commit: core and JetStream publishes, `commit_once` (the first of
several writers wins) with the reads it stands on, and requests (hedged, or answered by
several servers) with the error answers they may get."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Generic, TypeVar

import nats
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import api
from nats.micro.request import ERROR_CODE_HEADER, ERROR_HEADER

from eldr.bus.connection import Connection, translated
from eldr.bus.errors import AlreadyExists, NotFoundError, RemoteError, Retry
from eldr.wire import Message, WireError, decode, encode

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)
R = TypeVar("R", bound=Message)


LEGACY_ERROR_HEADERS = ("Eldr-Error", "Eldr-Error-Code")
"""The (description, code) headers services answered errors with before they used the NATS
service protocol's (`nats.micro`: `ERROR_HEADER`, `ERROR_CODE_HEADER`). Still read, so a
client understands a service of the previous release during a rolling upgrade."""
HEDGE_MIN_REMAINING_S = 0.001
"""A hedged request sends no copy with less time left than this (it could not be
answered)."""


@dataclass(frozen=True)
class PublishAck:
    stream: str
    seq: int
    duplicate: bool
    """The stream already had a message with this msg_id (within the duplicate window)."""


@dataclass(frozen=True)
class Committed(Generic[M]):
    """What `Bus.commit_once` left on the subject."""

    record: M
    first: bool
    """True: the given record was committed; False: an earlier one was there (`record`)."""


@dataclass(frozen=True)
class ConsumerState:
    num_pending: int
    """Messages matching the consumer not yet delivered."""
    num_ack_pending: int
    """Delivered but neither acked nor terminated."""
    num_redelivered: int
    delivered_stream_seq: int
    ack_floor_stream_seq: int


@dataclass(frozen=True)
class StreamState:
    messages: int
    size_bytes: int
    first_seq: int
    last_seq: int


class Publishing(Connection):
    """The bus's sending side: publish, commit once, request; and the stream reads."""

    # --- publishing ------------------------------------------------------------------

    async def publish(self, subject: str, message: Message) -> None:
        """Core publish (fire and forget; recorded by a stream if one covers `subject`)."""
        data = encode(message)
        with translated(f"publish to {subject}"):
            await self._nc.publish(subject, data)
        self.metrics.published.labels(self.subjects.family(subject), "core").inc()

    async def js_publish(
        self,
        subject: str,
        message: Message,
        *,
        msg_id: str | None = None,
        expected_last_subject_seq: int | None = None,
        timeout_s: float | None = None,
    ) -> PublishAck:
        """Publish to a stream and wait for its ack.

        `msg_id` de-duplicates within the stream's duplicate window;
        `expected_last_subject_seq=0` publishes only if `subject` has no message yet,
        else raises `AlreadyExists`.
        """
        return await self.publish_raw(
            subject,
            encode(message),
            jetstream=True,
            msg_id=msg_id,
            expected_last_subject_seq=expected_last_subject_seq,
            timeout_s=timeout_s,
        )

    async def commit_once(
        self, stream: str, subject: str, record: M, *, timeout_s: float | None = None
    ) -> Committed[M]:
        """Make `record` the one record of `subject` in `stream`: published only if the
        subject has none yet (`expected_last_subject_seq=0`), so of several writers (router
        replicas, redeliveries of one event) the first wins. Returns the record that
        stands: `record` with `first=True`, or the earlier one with `first=False`.

        Safe to call again after it failed (a timeout during a leader election: the write
        may have been stored and only its answer lost): a stored record with the same bytes
        as `record` is this writer's own, so `first=True` (`Bus.retrying` does that).

        Raises `Retry` (redelivered in 0.1 s) when another record won but is gone by the
        time it is read (retention dropped it in between: decide again later).
        """
        data = encode(record)
        try:
            await self.publish_raw(subject, data, expected_last_subject_seq=0, timeout_s=timeout_s)
        except AlreadyExists:
            stored = await self._get_last_raw(stream, subject, timeout_s=timeout_s)
            if stored is None:
                raise Retry(
                    f"{type(record).__name__.lower()} vanished after a conflict", delay_s=0.1
                ) from None
            if stored == data:
                return Committed(record, first=True)  # ours: an earlier try's answer was lost
            existing = decode(stored, type(record), self._settings.max_payload_bytes)
            return Committed(existing, first=False)
        return Committed(record, first=True)

    async def publish_raw(
        self,
        subject: str,
        data: bytes,
        *,
        jetstream: bool = True,
        msg_id: str | None = None,
        expected_last_subject_seq: int | None = None,
        timeout_s: float | None = None,
    ) -> PublishAck:
        """Publish bytes as they are (replay tooling, tests). Core publishes return a
        PublishAck with stream "" and seq 0."""
        family = self.subjects.family(subject)
        if not jetstream:
            with translated(f"publish to {subject}"):
                await self._nc.publish(subject, data)
            self.metrics.published.labels(family, "core").inc()
            return PublishAck(stream="", seq=0, duplicate=False)
        headers: dict[str, str] = {}
        if msg_id is not None:
            headers[api.Header.MSG_ID] = msg_id
        if expected_last_subject_seq is not None:
            headers[api.Header.EXPECTED_LAST_SUBJECT_SEQUENCE] = str(expected_last_subject_seq)
        with translated(f"publish to stream subject {subject}"):
            ack = await self._js.publish(
                subject,
                data,
                timeout=timeout_s or self._settings.request_timeout_s,
                headers=headers or None,
            )
        self.metrics.published.labels(family, "jetstream").inc()
        return PublishAck(stream=ack.stream, seq=ack.seq, duplicate=bool(ack.duplicate))

    # --- reads -----------------------------------------------------------------------

    async def get_last(self, stream: str, subject: str, message_type: type[M]) -> M | None:
        """The last message on `subject` in `stream`, decoded; None if there is none.

        Raises WireError if the stored message is not a valid `message_type`.
        """
        data = await self._get_last_raw(stream, subject)
        if data is None:
            return None
        return decode(data, message_type, self._settings.max_payload_bytes)

    async def _get_last_raw(
        self, stream: str, subject: str, *, timeout_s: float | None = None
    ) -> bytes | None:
        """The bytes of the last message on `subject` in `stream`; None if there is none."""
        try:
            with translated(f"get last message of {subject} in {stream}"):
                async with asyncio.timeout(timeout_s):
                    raw = await self._js.get_last_msg(stream, subject, direct=True)
        except NotFoundError:
            return None
        return raw.data or b""

    async def stream_state(self, stream: str) -> StreamState:
        with translated(f"stream info {stream}"):
            info = await self._js.stream_info(stream)
        state = info.state
        return StreamState(
            messages=state.messages,
            size_bytes=state.bytes,
            first_seq=state.first_seq,
            last_seq=state.last_seq,
        )

    async def consumer_state(self, stream: str, durable: str) -> ConsumerState:
        with translated(f"consumer info {stream}/{durable}"):
            info = await self._js.consumer_info(stream, durable)
        return ConsumerState(
            num_pending=info.num_pending or 0,
            num_ack_pending=info.num_ack_pending or 0,
            num_redelivered=info.num_redelivered or 0,
            delivered_stream_seq=info.delivered.stream_seq if info.delivered else 0,
            ack_floor_stream_seq=info.ack_floor.stream_seq if info.ack_floor else 0,
        )

    # --- request / reply -------------------------------------------------------------

    async def request(
        self,
        subject: str,
        message: Message,
        reply_type: type[R],
        *,
        timeout_s: float | None = None,
        hedge_after_s: float | None = None,
    ) -> R:
        """Send a request and wait for one reply.

        `hedge_after_s`: while no reply has come, send the request again every this many
        seconds (to a queue group: each copy goes to a member the server picks, so a member
        that does not answer, e.g. on a hung server, costs one hedge delay, not the whole
        timeout); the first reply of any copy is taken, within `timeout_s` overall.

        Raises BusTimeoutError, NoRespondersError, RemoteError (the server answered with an
        error) or WireError (the reply is not a valid `reply_type`).
        """
        timeout = timeout_s or self._settings.request_timeout_s
        data = encode(message)
        family = self.subjects.family(subject)
        with translated(f"request on {subject}"):
            if hedge_after_s is None or hedge_after_s >= timeout:
                response = await self._nc.request(subject, data, timeout=timeout)
                self.metrics.published.labels(family, "core").inc()
            else:
                response = await self._hedged_request(subject, data, timeout, hedge_after_s)
        raise_remote_error(response)
        return decode(response.data, reply_type, self._settings.max_payload_bytes)

    async def _hedged_request(
        self, subject: str, data: bytes, timeout_s: float, hedge_after_s: float
    ) -> Msg:
        """The first answer to copies of a request sent every `hedge_after_s` (nats errors
        raised as they are: the caller translates them)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        family = self.subjects.family(subject)
        tries: set[asyncio.Future[Msg]] = set()
        last_error: BaseException | None = None
        try:
            while True:
                remaining = deadline - loop.time()
                if remaining <= HEDGE_MIN_REMAINING_S:
                    raise last_error or nats.errors.TimeoutError()
                if tries:
                    self.metrics.hedged.labels(family).inc()
                tries.add(asyncio.ensure_future(self._nc.request(subject, data, timeout=remaining)))
                self.metrics.published.labels(family, "core").inc()
                done, tries = await asyncio.wait(
                    tries, timeout=min(hedge_after_s, remaining), return_when="FIRST_COMPLETED"
                )
                for task in done:
                    error = task.exception()
                    if error is None:
                        return task.result()
                    if isinstance(error, nats.errors.NoRespondersError):
                        raise error  # nobody serves the subject: another copy cannot help
                    last_error = error
        finally:
            for task in tries:
                task.cancel()

    async def request_many(
        self,
        subject: str,
        message: Message,
        reply_type: type[R],
        *,
        timeout_s: float | None = None,
        max_replies: int | None = None,
    ) -> list[R | RemoteError]:
        """Send a request that several servers answer (e.g. every router replica) and
        collect the replies that arrive within `timeout_s` (or until `max_replies`)."""
        timeout = timeout_s or self._settings.request_timeout_s
        inbox = self._nc.new_inbox()
        replies: list[R | RemoteError] = []
        with translated(f"request on {subject}"):
            sub = await self._nc.subscribe(inbox)
            try:
                await self._nc.publish(subject, encode(message), reply=inbox)
                deadline = time.monotonic() + timeout
                while max_replies is None or len(replies) < max_replies:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    try:
                        response = await sub.next_msg(timeout=remaining)
                    except TimeoutError:
                        break
                    if is_no_responders(response):
                        break
                    try:
                        raise_remote_error(response)
                        replies.append(
                            decode(response.data, reply_type, self._settings.max_payload_bytes)
                        )
                    except RemoteError as exc:
                        replies.append(exc)
                    except WireError as exc:
                        log.warning("request_many on %s: invalid reply skipped: %s", subject, exc)
            finally:
                with contextlib.suppress(nats.errors.Error):
                    await sub.unsubscribe()
        return replies


def is_no_responders(msg: Msg) -> bool:
    return not msg.data and bool(msg.headers) and msg.headers.get("Status") == "503"  # type: ignore[union-attr]


def raise_remote_error(msg: Msg) -> None:
    """Raise `RemoteError` if `msg` is an error answer: the NATS service protocol's headers
    (`Nats-Service-Error`: a one-line description; `Nats-Service-Error-Code`: 400 the
    request was invalid, 403 refused, 500 the handler failed), or the older ones."""
    headers = msg.headers
    if not headers:
        return
    for text_header, code_header in ((ERROR_HEADER, ERROR_CODE_HEADER), LEGACY_ERROR_HEADERS):
        if text_header in headers:
            code_text = headers.get(code_header, "500")
            code = int(code_text) if code_text.isdigit() else 500
            raise RemoteError(code, headers[text_header])
