"""`Bus`: the one NATS client of the project.

Every inbound message is size-checked and decoded with `eldr.wire.decode` before a
handler sees it; handlers receive typed messages and a `Delivery` (no nats types).
Delivery contracts:

- `consume` (JetStream durable pull consumer): at-least-once. A handler that returns
  acks; `Retry` naks with a delay; any other exception naks with backoff until the
  consumer's max_deliver, after which the message is dead-lettered and terminated.
  Undecodable messages are dead-lettered and terminated at once. A pull that the server
  refuses (status 503: the consumer has no leader; 409) or that cannot be sent is retried
  after a jittered backoff, never in a tight loop.
- `replay` (ordered ephemeral consumer): every message of the filter from a start point,
  in stream order, then live ones; a failing handler is logged and skipped.
- `serve` (core request/reply): handlers run concurrently (bounded); invalid requests
  are dead-lettered and answered with an error header; handler failures are answered
  with an error header. `request` turns such answers into `RemoteError`.
- `subscribe` (core): at-most-once, one message at a time in arrival order.

Refusals: a handler that raises `Reject(reason)` refuses a well-formed message for what
it claims; every path counts it (`eldr_bus_messages_rejected_total{family, reason}`),
logs it (at most once per `REFUSAL_LOG_INTERVAL_S` per family and reason, with the number
left unsaid), dead-letters it and, for `consume`, terminates it (never a redelivery);
`serve` answers error code 403. `subscribe`, `consume` and `replay` take `identity=FIELD`:
a message whose FIELD is not the last token of the subject it came on (the token its
sender is permitted to publish on: `load.<worker>` for `LoadReport.worker_id`) is refused
as `identity_mismatch` before the handler sees it, so a worker can speak only for itself.

Expected faults of a cluster (a leader election, a node restart: timeouts, no responders,
503) are told apart from failures, counted and logged once per interval
(`eldr.bus.transient`); `Bus.retrying` retries an operation through them, and
`commit_once` can be retried safely (its own earlier write, whose answer was lost, is
recognised as its own).

`drain()` shuts down gracefully: consumers stop fetching, in-flight handlers finish and
ack, then the connection drains (pending publishes and acks flushed) and closes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime as dt
import hashlib
import io
import json
import logging
import math
import random
import re
import ssl
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription as NatsSubscription
from nats.js import JetStreamContext, api
from prometheus_client import CollectorRegistry

from eldr.bus.errors import (
    AlreadyExists,
    BusError,
    BusTimeoutError,
    DisconnectedError,
    NoRespondersError,
    NotFoundError,
    Reject,
    RemoteError,
    Retry,
    UnavailableError,
)
from eldr.bus.metrics import BusMetrics
from eldr.bus.topology import Subjects
from eldr.bus.transient import Backoff, FaultLog, pull_status_kind, transient_kind
from eldr.settings import BusSettings
from eldr.wire import DeadLetter, Message, WireError, decode, encode
from eldr.wire.base import MAX_DEAD_LETTER_PAYLOAD_BYTES, MAX_HEADERS, MAX_TEXT_LEN

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)
R = TypeVar("R", bound=Message)
T = TypeVar("T")

ERROR_HEADER = "Eldr-Error"
"""Header of an error answer from `serve`: a one-line description."""
ERROR_CODE_HEADER = "Eldr-Error-Code"
"""400: the request was invalid; 500: the handler failed."""
WRONG_LAST_SEQUENCE = 10071
"""JetStream err_code of a failed `Nats-Expected-Last-Subject-Sequence` check."""
CORE_DLQ_TOKEN = "core"
"""DLQ subject token for messages that did not come from a stream."""
_MAX_ERROR_HEADER_LEN = 1000
REFUSAL_LOG_INTERVAL_S = 10.0
"""At most one log line per subject family and refusal reason per this many seconds (a
misbehaving worker refused at 10 reports/s must not flood the log)."""
REFUSED_CODE = "403"
"""`Eldr-Error-Code` of a request a handler refused (`Reject`)."""
RETRY_BACKOFF_FIRST_S = 0.05
RETRY_BACKOFF_MAX_S = 0.5
"""`Bus.retrying`'s default backoff: an operation retried through an election tries again
within half a second of the new leader (a try costs one small request)."""
HEDGE_MIN_REMAINING_S = 0.001
"""A hedged request sends no copy with less time left than this (it could not be
answered)."""
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
    """A stored message that a replay could not decode, reported instead of dead-lettered
    (`Bus.replay(on_undecodable=...)`, for readers that must not write, e.g. `eldr export`)."""

    subject: str
    stream: str
    stream_seq: int
    timestamp_s: float | None
    payload_size_bytes: int
    error: str


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
class ObjectRef:
    bucket: str
    name: str
    size_bytes: int
    sha256: str
    """Hex SHA-256 of the stored bytes (what `PartitionAnnouncement.sha256` carries)."""


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


Handler = Callable[[M, Delivery], Awaitable[None]]
RequestHandler = Callable[[M], Awaitable[R]]


@contextlib.contextmanager
def _translated(what: str) -> Iterator[None]:
    """Turn nats exceptions into `eldr.bus.errors` ones."""
    try:
        yield
    except nats.js.errors.NotFoundError as exc:
        raise NotFoundError(f"{what}: {exc}") from exc
    except nats.js.errors.ServiceUnavailableError as exc:
        raise UnavailableError(f"{what}: {exc.description or 'JetStream unavailable'}") from exc
    except nats.js.errors.APIError as exc:
        if exc.err_code == WRONG_LAST_SEQUENCE:
            raise AlreadyExists(f"{what}: {exc.description}") from exc
        raise BusError(f"{what}: {exc}") from exc
    except (nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError) as exc:
        raise NoRespondersError(f"{what}: no responders") from exc
    except TimeoutError as exc:  # nats.errors.TimeoutError is an asyncio.TimeoutError
        raise BusTimeoutError(f"{what}: timed out") from exc
    except (
        nats.errors.ConnectionReconnectingError,
        nats.errors.StaleConnectionError,
        nats.errors.OutboundBufferLimitError,
    ) as exc:
        raise DisconnectedError(f"{what}: {type(exc).__name__}") from exc
    except nats.errors.Error as exc:
        raise BusError(f"{what}: {exc}") from exc


def redact_url(url: object) -> str:
    """`url` (one or several, comma-separated; a string or a parsed URL) without any
    user name, password or token in it: `nats://***@host:4222`. For logs and errors."""
    text = url.geturl() if hasattr(url, "geturl") else str(url)
    return ",".join(
        _USERINFO_RE.sub(r"\1***@", part.strip()) for part in text.split(",") if part.strip()
    )


_USERINFO_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^@/]*@")


def is_reply_inbox(subject: str, allowed_prefixes: Sequence[str]) -> bool:
    """Whether `subject` is an inbox under one of `allowed_prefixes` (`_INBOX`,
    `_INBOX.eldr.prefill`): the prefix, then at least one more token, no wildcards, no
    spaces. A service answering a subject a message names (`PrefillDone.reply_to`) checks
    it with this first, so a message cannot make it publish anywhere else."""
    if not subject or len(subject) > 512 or any(c in subject for c in " \t\r\n*>"):
        return False
    tokens = subject.split(".")
    if any(not t for t in tokens):
        return False
    for prefix in allowed_prefixes:
        head = prefix.split(".")
        if len(tokens) > len(head) and tokens[: len(head)] == head:
            return True
    return False


async def finish_within(task: asyncio.Future[Any], timeout_s: float) -> Any:
    """`task`'s result if it finishes within `timeout_s`, else TimeoutError (the task is
    left running: `stop_task` ends it). Unlike `asyncio.wait_for`, this does not wait for
    the task to honour its cancellation: nats-py's connect loop can swallow a cancel (its
    `_close` catches CancelledError while it waits for its reconnect task), and a
    `wait_for` around it then never returned (a bad-credentials test hung for 300 s)."""
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if task not in done:
        raise TimeoutError(f"not done within {timeout_s:g} s")
    return task.result()


async def stop_task(task: asyncio.Future[Any], grace_s: float) -> bool:
    """Cancel `task` until it ends (a cancel it swallows is sent again every 50 ms), for at
    most `grace_s`; True if it ended. Its outcome is retrieved, never raised."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    while not task.done() and loop.time() < deadline:
        task.cancel()
        await asyncio.wait({task}, timeout=0.05)
    if task.done() and not task.cancelled():
        task.exception()  # retrieved: no "exception was never retrieved" warning
    return task.done()


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


def _one_line(text: str, limit: int = _MAX_ERROR_HEADER_LEN) -> str:
    return " ".join(text.split())[:limit]


def _tls_context(settings: BusSettings) -> ssl.SSLContext | None:
    if settings.tls_ca_file is None and settings.tls_cert_file is None:
        return None
    context = ssl.create_default_context(
        cafile=str(settings.tls_ca_file) if settings.tls_ca_file else None
    )
    if settings.tls_cert_file is not None and settings.tls_key_file is not None:
        context.load_cert_chain(str(settings.tls_cert_file), str(settings.tls_key_file))
    return context


def _connect_options(settings: BusSettings, name: str) -> dict[str, Any]:
    options: dict[str, Any] = {
        "servers": [url.strip() for url in settings.nats_url.split(",") if url.strip()],
        "name": name,
        "allow_reconnect": True,
        "connect_timeout": settings.connect_timeout_s,
        "reconnect_time_wait": settings.reconnect_wait_s,
        "max_reconnect_attempts": settings.max_reconnect_attempts,
        "ping_interval": settings.ping_interval_s,
        "max_outstanding_pings": settings.max_outstanding_pings,
        "drain_timeout": settings.drain_timeout_s,
        "inbox_prefix": settings.inbox_prefix,
    }
    if settings.user is not None:
        options["user"] = settings.user
        if settings.password is not None:
            options["password"] = settings.password.get_secret_value()
    if settings.token is not None:
        options["token"] = settings.token.get_secret_value()
    if settings.nkeys_seed_file is not None:
        options["nkeys_seed"] = str(settings.nkeys_seed_file)
    if settings.creds_file is not None:
        options["user_credentials"] = str(settings.creds_file)
    tls = _tls_context(settings)
    if tls is not None:
        options["tls"] = tls
        if settings.tls_hostname is not None:
            options["tls_hostname"] = settings.tls_hostname
    return options


class Bus:
    """A connected NATS client with typed publish, request, serve and consume.

    Create with `await Bus.connect(settings, name)`; end with `await bus.drain()` (or use
    `async with`). Not thread-safe: use it from the event loop that connected it.
    """

    def __init__(
        self,
        nc: NatsClient,
        settings: BusSettings,
        metrics: BusMetrics,
        faults: FaultLog | None = None,
    ) -> None:
        self._nc = nc
        self._js: JetStreamContext = nc.jetstream(timeout=settings.request_timeout_s)
        self._settings = settings
        self.metrics = metrics
        self.subjects = Subjects(settings.namespace)
        self._handles: list[_Handle] = []
        self._object_stores: dict[str, Any] = {}
        self._drained = False
        self._no_echo = False
        self._refusal_log: dict[tuple[str, str], list[float]] = {}
        """(family, reason) -> [last logged (monotonic s), refusals not logged since]."""
        self.faults = faults or FaultLog(log)
        """Transient faults (an election, a reconnect), said once per interval."""
        self._failure_log: dict[tuple[str, str], list[float]] = {}
        """(family, exception type) -> [last traceback logged, failures not logged since]."""
        self.rng = random.Random()
        """Jitter of this client's backoffs."""

    # --- lifecycle -------------------------------------------------------------------

    @classmethod
    async def connect(
        cls,
        settings: BusSettings,
        name: str,
        *,
        registry: CollectorRegistry | None = None,
        no_echo: bool = False,
    ) -> Bus:
        """Connect to `settings.nats_url` as client `name`, reconnecting forever by default.

        Metrics go to `registry` (a fresh private one if None; never the global one).
        `no_echo`: the server does not deliver this connection's own publishes to its own
        subscriptions (a router follows every replica's decisions but needs not its own).
        """
        nc = NatsClient()
        faults = FaultLog(log)

        async def on_error(exc: Exception) -> None:
            # A node going away makes every reconnect attempt fail until one succeeds: one
            # line per kind and interval, not one per attempt.
            faults.failed(f"nats client {name}", type(exc).__name__, str(exc) or repr(exc))

        async def on_disconnected() -> None:
            if nc.is_closed or nc.is_draining:
                log.debug("nats client %s disconnected (closing)", name)
            else:
                log.warning("nats client %s disconnected", name)

        async def on_reconnected() -> None:
            faults.recovered(f"nats client {name}")
            log.info("nats client %s reconnected to %s", name, redact_url(nc.connected_url))

        async def on_closed() -> None:
            log.info("nats client %s closed", name)

        options = {**_connect_options(settings, name), "no_echo": no_echo}
        connecting = asyncio.ensure_future(
            nc.connect(
                **options,
                error_cb=on_error,
                disconnected_cb=on_disconnected,
                reconnected_cb=on_reconnected,
                closed_cb=on_closed,
            )
        )
        try:
            with _translated(f"connect to {redact_url(settings.nats_url)}"):
                # nats-py retries the first connect like a reconnect (forever by default).
                await finish_within(connecting, settings.startup_wait_s)
        except BaseException:
            # Bounded: a client stuck between failed attempts (bad credentials) can take
            # its time to close, and the caller is owed the original error now.
            await stop_task(connecting, settings.connect_timeout_s)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), timeout=settings.connect_timeout_s)
            raise
        server_info: Mapping[str, Any] = getattr(nc, "_server_info", None) or {}
        if settings.require_auth and not server_info.get("auth_required"):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), timeout=settings.connect_timeout_s)
            raise BusError(
                f"NATS at {redact_url(nc.connected_url)} does not require authentication and "
                "ELDR_REQUIRE_AUTH is set: install NATS with its users "
                "(deploy/nats/values-auth.yaml, docs/DEPLOY.md) instead of running on an "
                "open bus"
            )
        log.info("nats client %s connected to %s", name, redact_url(nc.connected_url))
        bus = cls(
            nc, settings, BusMetrics(registry or CollectorRegistry(auto_describe=True)), faults
        )
        bus._no_echo = no_echo
        return bus

    async def __aenter__(self) -> Bus:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.drain()

    @property
    def settings(self) -> BusSettings:
        return self._settings

    @property
    def inbox_prefix(self) -> str:
        """This connection's inbox prefix (`BusSettings.inbox_prefix`): every inbox it
        creates, and so every reply it may receive, is under it."""
        return self._settings.inbox_prefix

    def new_inbox(self) -> str:
        """A fresh inbox of this connection (`<inbox_prefix>.<unique id>`), for a reply
        subject that others answer on (`PrefillDone.reply_to`). Never build one by hand:
        under the generated permissions only this prefix may be subscribed to."""
        return self._nc.new_inbox()

    @property
    def is_connected(self) -> bool:
        return bool(self._nc.is_connected)

    async def drain(self) -> None:
        """Graceful shutdown: stop consumers and let in-flight handlers finish (and ack),
        stop subscriptions, then drain and close the connection. Idempotent."""
        if self._drained:
            return
        self._drained = True
        handles = sorted(self._handles, key=lambda h: h.stop_order)
        try:
            await asyncio.wait_for(
                self._stop_handles(handles), timeout=self._settings.drain_timeout_s
            )
        except TimeoutError:
            log.error(
                "bus drain: handlers still running after %.1f s; cancelled, their messages "
                "will be redelivered",
                self._settings.drain_timeout_s,
            )
            for handle in handles:
                handle.cancel()
        if self._nc.is_closed:
            return
        if self._nc.is_connected:
            # Make sure the acks of the handlers just finished reached the server.
            with contextlib.suppress(BusError):
                await self._sync()
        try:
            await self._nc.drain()
        except (nats.errors.ConnectionReconnectingError, nats.errors.ConnectionClosedError):
            await self._nc.close()

    async def _stop_handles(self, handles: list[_Handle]) -> None:
        # Consumers first (their handlers may still publish), then replays, then core
        # subscriptions; handles of one kind stop together.
        for order in sorted({h.stop_order for h in handles}):
            await asyncio.gather(*(h.stop() for h in handles if h.stop_order == order))

    async def close(self) -> None:
        """Close at once: in-flight work is abandoned and unacked messages redelivered."""
        self._drained = True
        for handle in self._handles:
            handle.cancel()
        if not self._nc.is_closed:
            await self._nc.close()

    async def flush(self) -> None:
        """Wait until the server has processed everything this client sent so far."""
        await self._sync()

    async def _sync(self) -> None:
        """A round trip through the client's outgoing buffer.

        nats-py's `flush()` writes its PING straight to the socket, ahead of commands
        still buffered (SUB, PUB), so its PONG does not prove the server saw them. A
        message to our own inbox goes through the same buffer, so its echo does.
        """
        if self._no_echo:
            # Our own messages do not come back: ask the server something instead (the
            # request goes through the same buffer, so its answer proves the same).
            with _translated("sync with the server"):
                await self._nc.request(
                    f"{self._js._prefix}.INFO", b"", timeout=self._settings.request_timeout_s
                )
            return
        inbox = self._nc.new_inbox()
        with _translated("sync with the server"):
            sub = await self._nc.subscribe(inbox)
            try:
                await self._nc.publish(inbox, b"")
                await sub.next_msg(timeout=self._settings.request_timeout_s)
            finally:
                with contextlib.suppress(nats.errors.Error):
                    await sub.unsubscribe()

    # --- publishing ------------------------------------------------------------------

    async def publish(self, subject: str, message: Message) -> None:
        """Core publish (fire and forget; recorded by a stream if one covers `subject`)."""
        data = encode(message)
        with _translated(f"publish to {subject}"):
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

    def note_fault(self, op: str, exc: BaseException, detail: str) -> bool:
        """If `exc` is an expected fault of a cluster (`transient_kind`), count it
        (`eldr_bus_transient_errors_total{op, kind}`), say it at most once per interval and
        return True; else False (the caller reports it as it would any failure)."""
        kind = transient_kind(exc)
        if kind is None:
            return False
        self.metrics.transient_errors.labels(op, kind).inc()
        self.faults.failed(op, kind, detail)
        return True

    async def retrying(
        self,
        op: str,
        call: Callable[[], Awaitable[T]],
        *,
        give_up_s: float,
        backoff: Backoff | None = None,
        keepalive: Callable[[], Awaitable[None]] | None = None,
        keepalive_every_s: float = math.inf,
        stopping: asyncio.Event | None = None,
    ) -> T:
        """`call()`'s result, retried while it fails with an expected fault of a cluster
        (`eldr.bus.transient.transient_kind`: a timeout, no responders, 503, a reconnect)
        after a jittered backoff (`backoff`, default 50 ms doubling to 0.5 s), for at most
        `give_up_s` or until `stopping` is set; then the last error is raised. Every
        failure is counted (`eldr_bus_transient_errors_total{op, kind}`) and logged at most
        once per interval; a success after failures logs one line. `keepalive` (a consumed
        message's `Delivery.in_progress`) is awaited at least every `keepalive_every_s`
        while retrying, so JetStream keeps the message with this consumer: an election
        does not spend one of its deliveries. Other errors are raised at once."""
        backoff = backoff or Backoff(RETRY_BACKOFF_FIRST_S, RETRY_BACKOFF_MAX_S, rng=self.rng)
        loop = asyncio.get_running_loop()
        give_up = loop.time() + give_up_s
        next_keepalive = loop.time() + keepalive_every_s
        attempt = 0
        while True:
            try:
                result = await call()
            except BusError as exc:
                kind = transient_kind(exc)
                if kind is None:
                    raise
                attempt += 1
                self.metrics.transient_errors.labels(op, kind).inc()
                self.faults.failed(op, kind, str(exc))
                now = loop.time()
                if now >= give_up or (stopping is not None and stopping.is_set()):
                    raise
                if keepalive is not None and now >= next_keepalive:
                    await keepalive()
                    next_keepalive = loop.time() + keepalive_every_s
                wait_s = min(backoff.delay_s(attempt), max(0.0, give_up - now))
                if keepalive is not None:
                    wait_s = min(wait_s, max(0.0, next_keepalive - now))
                if stopping is None:
                    await asyncio.sleep(wait_s)
                else:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stopping.wait(), timeout=wait_s)
                continue
            if attempt:
                self.faults.recovered(op)
            return result

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
            with _translated(f"publish to {subject}"):
                await self._nc.publish(subject, data)
            self.metrics.published.labels(family, "core").inc()
            return PublishAck(stream="", seq=0, duplicate=False)
        headers: dict[str, str] = {}
        if msg_id is not None:
            headers[api.Header.MSG_ID] = msg_id
        if expected_last_subject_seq is not None:
            headers[api.Header.EXPECTED_LAST_SUBJECT_SEQUENCE] = str(expected_last_subject_seq)
        with _translated(f"publish to stream subject {subject}"):
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
            with _translated(f"get last message of {subject} in {stream}"):
                if timeout_s is None:
                    raw = await self._js.get_last_msg(stream, subject, direct=True)
                else:
                    raw = await asyncio.wait_for(
                        self._js.get_last_msg(stream, subject, direct=True), timeout_s
                    )
        except NotFoundError:
            return None
        return raw.data or b""

    async def stream_state(self, stream: str) -> StreamState:
        with _translated(f"stream info {stream}"):
            info = await self._js.stream_info(stream)
        state = info.state
        return StreamState(
            messages=state.messages,
            size_bytes=state.bytes,
            first_seq=state.first_seq,
            last_seq=state.last_seq,
        )

    async def consumer_state(self, stream: str, durable: str) -> ConsumerState:
        with _translated(f"consumer info {stream}/{durable}"):
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
        with _translated(f"request on {subject}"):
            if hedge_after_s is None or hedge_after_s >= timeout:
                response = await self._nc.request(subject, data, timeout=timeout)
                self.metrics.published.labels(family, "core").inc()
            else:
                response = await self._hedged_request(subject, data, timeout, hedge_after_s)
        _raise_remote_error(response)
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
        with _translated(f"request on {subject}"):
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
                    if _is_no_responders(response):
                        break
                    try:
                        _raise_remote_error(response)
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
        with _translated(f"subscribe to {subject}"):
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
        with _translated(f"subscribe to {subject}"):
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
        with _translated(f"bind consumer {stream}/{durable}"):
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
        with _translated(f"subscribe to the pull inbox of {stream}/{durable}"):
            await consumer.start()
        self._handles.append(consumer)
        log.info("consuming %s/%s (max_deliver %s)", stream, durable, consumer.max_deliver)
        return consumer

    async def replay(
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
    ) -> Replay:
        """Deliver the messages of `stream` matching `subject_filter` in order, from
        `start_seq` or `start_time_s` (default: the first), then live ones.

        The returned `Replay` sets `caught_up` once the messages present at the start have
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
        replay: Replay = Replay(
            self,
            stream,
            subject_filter,
            message_type,
            handler,
            stop_at_end,
            on_undecodable,
            identity=identity,
        )
        with _translated(f"replay {stream} {subject_filter}"):
            replay.sub = await self._js.subscribe(
                subject_filter,
                stream=stream,
                cb=replay.on_msg,
                ordered_consumer=True,
                config=config,
                idle_heartbeat=self._settings.replay_heartbeat_s,
            )
            info = await replay.sub.consumer_info()
        # nats-py re-creates an ordered consumer that stopped delivering (a server restart
        # loses it) from its first request, switched to "deliver from sequence N". A start
        # time left in that request makes the server refuse it (error 10094): the replay
        # would stop for good (found by tests/faults: the trainer stopped learning).
        jsi = getattr(getattr(replay.sub, "_sub", None), "_jsi", None)
        ccreq = getattr(jsi, "_ccreq", None)
        if ccreq is not None:
            ccreq.opt_start_time = None
        replay.check_initially_caught_up(
            num_pending=info.num_pending or 0,
            delivered=info.delivered.consumer_seq if info.delivered else 0,
        )
        self._handles.append(replay)
        return replay

    # --- object store ----------------------------------------------------------------

    async def _bucket(self, bucket: str) -> Any:
        store = self._object_stores.get(bucket)
        if store is None:
            with _translated(f"object store {bucket}"):
                store = await self._js.object_store(bucket)
            self._object_stores[bucket] = store
        return store

    async def object_put(self, bucket: str, name: str, message: Message) -> ObjectRef:
        """Store `message` as object `name` (replacing any previous one)."""
        data = encode(message)
        store = await self._bucket(bucket)
        with _translated(f"put object {bucket}/{name}"):
            await store.put(name, data)
        return ObjectRef(
            bucket=bucket,
            name=name,
            size_bytes=len(data),
            sha256=hashlib.sha256(data).hexdigest(),
        )

    async def object_get(
        self,
        bucket: str,
        name: str,
        message_type: type[M],
        *,
        expected_sha256: str | None = None,
    ) -> M:
        """Read and decode object `name`. Refuses objects over `max_object_bytes` before
        downloading them; raises NotFoundError, or WireError if the bytes do not match
        `expected_sha256` or are not a valid `message_type`."""
        store = await self._bucket(bucket)
        limit = self._settings.max_object_bytes
        with _translated(f"get object {bucket}/{name}"):
            info = await store.get_info(name)
            if (info.size or 0) > limit:
                raise WireError(f"object {bucket}/{name} has {info.size} bytes, limit {limit}")
            buffer = io.BytesIO()
            await store.get(name, writeinto=buffer)
        data = buffer.getvalue()
        if expected_sha256 is not None and hashlib.sha256(data).hexdigest() != expected_sha256:
            raise WireError(f"object {bucket}/{name} does not match sha256 {expected_sha256}")
        return decode(data, message_type, limit)

    # --- internals shared by the handles ---------------------------------------------

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
        family = self.subjects.family(msg.subject)
        headers = {
            str(k)[:256]: _one_line(str(v), MAX_TEXT_LEN)
            for k, v in list((msg.headers or {}).items())[:MAX_HEADERS]
        }
        letter = DeadLetter(
            subject=msg.subject[:512],
            stream=stream,
            error=_one_line(error, MAX_TEXT_LEN),
            received_ts_s=time.time(),
            payload=msg.data[:MAX_DEAD_LETTER_PAYLOAD_BYTES],
            headers=headers,
            payload_size_bytes=len(msg.data),
            stream_seq=stream_seq,
            num_delivered=num_delivered,
        )
        # Several replicas may dead-letter the same stored message: de-duplicate.
        msg_id = f"{stream}-{stream_seq}" if stream and stream_seq else None
        try:
            await self.js_publish(
                self.subjects.dlq(stream or CORE_DLQ_TOKEN), letter, msg_id=msg_id
            )
        except (BusError, WireError) as exc:
            log.error("could not dead-letter a message from %s: %s", msg.subject, exc)
            self.metrics.rejected.labels(family, "dead_letter_failed").inc()
            return False
        self.metrics.dead_letters.labels(family).inc()
        return True

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
        """Count, log (rate-limited) and dead-letter a refused message; False if the dead
        letter could not be stored."""
        self.metrics.rejected.labels(family, refusal.reason).inc()
        self._log_refusal(family, refusal, msg.subject)
        if not dead_letter:
            return True
        return await self._dead_letter(
            msg,
            error=f"refused: {refusal}",
            stream=stream,
            stream_seq=stream_seq,
            num_delivered=num_delivered,
        )

    def _log_refusal(self, family: str, refusal: Reject, subject: str) -> None:
        now = time.monotonic()
        state = self._refusal_log.setdefault((family, refusal.reason), [-math.inf, 0.0])
        if now - state[0] < REFUSAL_LOG_INTERVAL_S:
            state[1] += 1
            return
        unsaid = int(state[1])
        state[0], state[1] = now, 0.0
        log.warning(
            "refused a message on %s: %s%s",
            subject[:200],
            _one_line(str(refusal), 500),
            f" ({unsaid} more {refusal.reason} refusals on {family} since the last report)"
            if unsaid
            else "",
        )

    def _log_failure(self, family: str, exc: Exception, message: str, *args: object) -> None:
        """Log a handler failure with its traceback, at most once per
        `REFUSAL_LOG_INTERVAL_S` per subject family and exception type (called inside the
        except block); the count left unsaid goes with the next line."""
        now = time.monotonic()
        state = self._failure_log.setdefault((family, type(exc).__name__), [-math.inf, 0.0])
        if now - state[0] < REFUSAL_LOG_INTERVAL_S:
            state[1] += 1
            return
        unsaid = int(state[1])
        state[0], state[1] = now, 0.0
        name = type(exc).__name__
        suffix = f" ({unsaid} more {name} failures on {family} since)" if unsaid else ""
        log.exception(message + suffix, *args)

    async def _respond(self, reply: str, data: bytes, headers: dict[str, str] | None) -> None:
        try:
            await self._nc.publish(reply, data, headers=headers)
        except nats.errors.Error as exc:
            log.warning("could not answer on %s: %s", reply, exc)


def _is_no_responders(msg: Msg) -> bool:
    return not msg.data and bool(msg.headers) and msg.headers.get("Status") == "503"  # type: ignore[union-attr]


def _raise_remote_error(msg: Msg) -> None:
    if msg.headers and ERROR_HEADER in msg.headers:
        code_text = msg.headers.get(ERROR_CODE_HEADER, "500")
        code = int(code_text) if code_text.isdigit() else 500
        raise RemoteError(code, msg.headers[ERROR_HEADER])


class _Handle:
    """Something `Bus.drain` must stop; lower `stop_order` stops first."""

    stop_order = 0

    async def stop(self) -> None:
        raise NotImplementedError

    def cancel(self) -> None:
        """Abandon in-flight work (hard close)."""


class _Receiver(_Handle, Generic[M, T]):
    """The one receive sequence of every path (`serve`, `subscribe`, `consume`, `replay`):
    count, decode, check the sender's identity, run the handler (timed), then hand the
    outcome to the path. Each path says what an outcome means for it (ack or term, an
    error answer, a dead letter, a log line) by overriding the four hooks."""

    _bus: Bus
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
        bus: Bus,
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
                msg.reply, b"", {ERROR_HEADER: _one_line(text), ERROR_CODE_HEADER: code}
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
        bus: Bus,
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
        bus: Bus,
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
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), timeout=paused_s)
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
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), timeout=expires_s / 2)

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
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), timeout=0.05)
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


class Replay(_Receiver[M, None]):
    """An ordered replay started by `Bus.replay`."""

    stop_order = 1

    def __init__(
        self,
        bus: Bus,
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
        """Set once the messages present when the replay started have been handled."""
        self.finished = asyncio.Event()
        """Set when the replay stopped (stop_at_end, or `stop()`)."""
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
            "replay of %s %s caught up at seq %d (%d handled)",
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
        await asyncio.wait_for(self.caught_up.wait(), timeout=timeout_s)

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
                "replay %s seq %d: invalid message: %s", self.stream, delivery.stream_seq, exc
            )
            await self._bus._dead_letter(
                msg,
                error=str(exc),
                stream=delivery.stream,
                stream_seq=delivery.stream_seq,
                num_delivered=delivery.num_delivered,
            )
            return
        log.debug("replay %s seq %d: invalid message: %s", self.stream, delivery.stream_seq, exc)
        self._on_undecodable(
            Undecodable(
                subject=msg.subject,
                stream=delivery.stream or self.stream,
                stream_seq=delivery.stream_seq or 0,
                timestamp_s=delivery.timestamp_s,
                payload_size_bytes=len(msg.data),
                error=_one_line(str(exc), MAX_TEXT_LEN),
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
        log.exception("replay handler for %s seq %d failed", msg.subject, delivery.stream_seq)
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
