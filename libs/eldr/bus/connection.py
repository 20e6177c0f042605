"""The bus's connection: connect (servers, credentials, TLS, reconnect and ping settings),
sync, drain and close, and the faults of a cluster it rides through.

Expected faults of a cluster (a leader election, a node restart: timeouts, no responders,
503) are told apart from failures, counted and logged once per interval
(`eldr.bus.transient`); `Connection.retrying` retries an operation through them.

`drain()` shuts down gracefully: consumers stop fetching, in-flight handlers finish and
ack, then the connection drains (pending publishes and acks flushed) and closes. The other
modules of the bus turn nats exceptions into `eldr.bus.errors` ones with `translated`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import re
import ssl
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, Self, TypeVar

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from prometheus_client import CollectorRegistry

from eldr.aio import wait_event
from eldr.bus.errors import (
    AlreadyExists,
    BusError,
    BusTimeoutError,
    DisconnectedError,
    NoRespondersError,
    NotFoundError,
    UnavailableError,
)
from eldr.bus.metrics import BusMetrics
from eldr.bus.topology import Subjects
from eldr.bus.transient import Backoff, FaultLog, transient_kind
from eldr.settings import BusSettings

log = logging.getLogger(__name__)

T = TypeVar("T")


WRONG_LAST_SEQUENCE = 10071
"""JetStream err_code of a failed `Nats-Expected-Last-Subject-Sequence` check."""
RETRY_BACKOFF_FIRST_S = 0.05
RETRY_BACKOFF_MAX_S = 0.5
"""`Bus.retrying`'s default backoff: an operation retried through an election tries again
within half a second of the new leader (a try costs one small request)."""


@contextlib.contextmanager
def translated(what: str) -> Iterator[None]:
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


class Handle:
    """Something `Bus.drain` must stop; lower `stop_order` stops first."""

    stop_order = 0

    async def stop(self) -> None:
        raise NotImplementedError

    def cancel(self) -> None:
        """Abandon in-flight work (hard close)."""


class Connection:
    """A connected NATS client: its lifecycle and the faults it rides through (`Bus` is
    this with publishing, dead letters, receivers and the object store).

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
        self._handles: list[Handle] = []
        self._drained = False
        self._no_echo = False
        self.faults = faults or FaultLog(log)
        """Transient faults (an election, a reconnect), said once per interval."""
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
    ) -> Self:
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
            with translated(f"connect to {redact_url(settings.nats_url)}"):
                # nats-py retries the first connect like a reconnect (forever by default).
                await finish_within(connecting, settings.startup_wait_s)
        except BaseException:
            # Bounded: a client stuck between failed attempts (bad credentials) can take
            # its time to close, and the caller is owed the original error now.
            await stop_task(connecting, settings.connect_timeout_s)
            with contextlib.suppress(Exception):
                async with asyncio.timeout(settings.connect_timeout_s):
                    await nc.close()
            raise
        server_info: Mapping[str, Any] = getattr(nc, "_server_info", None) or {}
        if settings.require_auth and not server_info.get("auth_required"):
            with contextlib.suppress(Exception):
                async with asyncio.timeout(settings.connect_timeout_s):
                    await nc.close()
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

    async def __aenter__(self) -> Self:
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
            async with asyncio.timeout(self._settings.drain_timeout_s):
                await self._stop_handles(handles)
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

    async def _stop_handles(self, handles: list[Handle]) -> None:
        # Consumers first (their handlers may still publish), then read-backs, then core
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
            with translated("sync with the server"):
                await self._nc.request(
                    f"{self._js._prefix}.INFO", b"", timeout=self._settings.request_timeout_s
                )
            return
        inbox = self._nc.new_inbox()
        with translated("sync with the server"):
            sub = await self._nc.subscribe(inbox)
            try:
                await self._nc.publish(inbox, b"")
                await sub.next_msg(timeout=self._settings.request_timeout_s)
            finally:
                with contextlib.suppress(nats.errors.Error):
                    await sub.unsubscribe()

    # --- faults of a cluster ----------------------------------------------------------

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
                    await wait_event(stopping, wait_s)
                continue
            if attempt:
                self.faults.recovered(op)
            return result
