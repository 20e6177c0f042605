"""Publish from inside an engine without ever blocking it.

The engine's worker thread calls `BackgroundPublisher.submit(step_result)` (or
`submit_messages` for decode summaries and load-only prefill events), which only puts the
messages in a bounded queue (a full queue drops them and counts it) and wakes a background
thread. That thread owns an asyncio loop and one `Bus` connection (connected lazily,
retried forever while the process lives) and publishes each item in order: a step's block
batches on `{ns}.blocks.{worker}`, then its prefill-done events on
`{ns}.prefill.done.{worker}` (JetStream, acked; `Nats-Msg-Id` = request id, so a retried
publish is not stored twice); decode summaries on `{ns}.profiles.{worker}` (JetStream,
`Nats-Msg-Id` = `profile-<request id>`). With a status source it also publishes the
plugin's `CaptureStatus` on `{ns}.capture.{worker}` (core) every interval and whenever
`status_changed()` is called. A publish that fails is logged and counted, never raised.

Drops lose information, not correctness of what is published: a missing block summary
makes the router's signature assembly report it missing (`missing_blocks` in the
decision); a missing prefill-done event means the gateway falls back to its own routing
after its decision timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from eldr.aio import wait_event
from eldr.bus import Bus, BusError
from eldr.settings import BusSettings
from eldr.vllm.capture import StepResult
from eldr.wire import CaptureStatus, DecodeSummary, PrefillDone, WireError

Outgoing = PrefillDone | DecodeSummary
"""Messages queued one by one (not as an engine step's batch)."""
StatusSource = Callable[[], CaptureStatus | None]

log = logging.getLogger("vllm.eldr_capture.publisher")

_CONNECT_RETRY_S = 1.0
_LOG_EVERY_S = 30.0


@dataclass
class PublisherStats:
    submitted: int = 0
    """Steps handed over."""
    dropped: int = 0
    """Steps dropped because the queue was full (NATS slow or unreachable)."""
    published_batches: int = 0
    published_done: int = 0
    published_summaries: int = 0
    published_statuses: int = 0
    failed: int = 0
    """Messages whose publish failed (logged)."""


class BackgroundPublisher:
    """A bounded queue drained into NATS by a daemon thread (see the module docstring)."""

    def __init__(
        self,
        settings: BusSettings,
        client_name: str,
        max_queued_steps: int,
        *,
        status_source: StatusSource | None = None,
        status_interval_s: float = 2.0,
    ) -> None:
        if max_queued_steps < 1:
            raise ValueError(f"max_queued_steps must be positive, got {max_queued_steps}")
        self.settings = settings
        self.client_name = client_name
        self.stats = PublisherStats()
        self.status_source = status_source
        """Called on the publisher's thread for the status to publish (None: none yet)."""
        self.status_interval_s = status_interval_s
        self._status_due = threading.Event()
        self._queue: queue.Queue[StepResult | tuple[Outgoing, ...] | None] = queue.Queue(
            max_queued_steps
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._wake_scheduled = False
        self._started = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._last_drop_log_s = 0.0
        self._closing = threading.Event()
        self.connected = threading.Event()
        """Set once the first connection to NATS is up (tests wait on it)."""
        self.on_error: Callable[[str], None] | None = None
        """Told (on the publisher's thread) of an exception the publisher did not expect."""

    # --- engine side (any thread) --------------------------------------------------------

    def submit(self, result: StepResult) -> bool:
        """Queue one step's messages; False (and counted) when the queue is full."""
        if not result:
            return True
        return self._put(result)

    def submit_messages(self, messages: Sequence[Outgoing]) -> bool:
        """Queue prefill-done events or decode summaries; False (counted) when full."""
        if not messages:
            return True
        return self._put(tuple(messages))

    def status_changed(self) -> None:
        """Publish the status now (from any thread), not only at the next interval."""
        self._status_due.set()
        self._ensure_thread()
        self._schedule_wake()

    def start(self) -> None:
        """Start the thread (and the status heartbeat) before anything is submitted."""
        self._ensure_thread()

    def _put(self, item: StepResult | tuple[Outgoing, ...]) -> bool:
        self._ensure_thread()
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.stats.dropped += 1
            now = time.monotonic()
            if now - self._last_drop_log_s > _LOG_EVERY_S:
                self._last_drop_log_s = now
                log.warning(
                    "eldr capture: publish queue full, %d steps dropped so far (NATS at %s "
                    "slow or unreachable)",
                    self.stats.dropped,
                    self.settings.nats_url,
                )
            return False
        self.stats.submitted += 1
        self._schedule_wake()
        return True

    def _schedule_wake(self) -> None:
        loop = self._loop
        if loop is None or self._wake_scheduled:
            return
        self._wake_scheduled = True
        with contextlib.suppress(RuntimeError):  # loop closed at interpreter exit
            loop.call_soon_threadsafe(self._on_wake)

    def _ensure_thread(self) -> None:
        if self._thread is not None:
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="eldr-capture-publisher", daemon=True
                )
                self._thread.start()
                self._started.wait(timeout=5.0)

    def close(self, timeout_s: float = 2.0) -> None:
        """Publish what is queued (waiting at most `timeout_s`), then stop the thread."""
        thread = self._thread
        if thread is None:
            return
        self._closing.set()  # also ends a connect loop that cannot reach NATS
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout_s)
        self._schedule_wake()
        thread.join(timeout=timeout_s)

    # --- publisher thread ----------------------------------------------------------------

    def _on_wake(self) -> None:
        self._wake_scheduled = False
        if self._wake is not None:
            self._wake.set()

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._main(loop))
        except Exception:
            log.exception("eldr capture publisher stopped")
        finally:
            with contextlib.suppress(Exception):
                loop.close()

    async def _main(self, loop: asyncio.AbstractEventLoop) -> None:
        self._wake = asyncio.Event()
        self._loop = loop
        self._started.set()
        self._wake.set()  # items may have been queued before the loop existed
        bus: Bus | None = None
        next_status_s = time.monotonic()
        try:
            while True:
                timeout = None
                if self.status_source is not None:
                    timeout = max(0.0, next_status_s - time.monotonic())
                await wait_event(self._wake, timeout)
                self._wake.clear()
                if self.status_source is not None and (
                    self._status_due.is_set() or time.monotonic() >= next_status_s
                ):
                    self._status_due.clear()
                    bus = bus or await self._connect()
                    if bus is None:
                        return
                    await self._publish_status(bus)
                    next_status_s = time.monotonic() + self.status_interval_s
                while True:
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if item is None:
                        return
                    bus = bus or await self._connect()
                    if bus is None:
                        return
                    if isinstance(item, StepResult):
                        await self._publish(bus, item)
                    else:
                        await self._publish_messages(bus, item)
        finally:
            if bus is not None:
                with contextlib.suppress(Exception):
                    await bus.drain()

    async def _connect(self) -> Bus | None:
        while not self._closing.is_set():
            try:
                bus = await Bus.connect(self.settings, self.client_name)
            except (BusError, OSError) as exc:
                log.warning(
                    "eldr capture: cannot reach NATS at %s: %s", self.settings.nats_url, exc
                )
                await asyncio.sleep(_CONNECT_RETRY_S)
                continue
            self.connected.set()
            return bus
        return None

    def _unexpected(self, what: str, exc: BaseException) -> None:
        """An exception the publisher did not expect (a bug, a message it could not
        build): counted, logged, reported through `on_error`; the thread goes on (the
        status heartbeat must not stop)."""
        self.stats.failed += 1
        log.error("eldr capture publisher: %s failed", what, exc_info=exc)
        if self.on_error is not None:
            with contextlib.suppress(Exception):
                self.on_error(f"{type(exc).__name__}: {exc} ({what})")

    async def _publish(self, bus: Bus, item: StepResult) -> None:
        try:
            await self._publish_step(bus, item)
        except Exception as exc:
            self._unexpected("publishing a step", exc)

    async def _publish_step(self, bus: Bus, item: StepResult) -> None:
        subjects = bus.subjects
        for batch in item.batches:
            try:
                await bus.js_publish(subjects.blocks(batch.worker_id), batch)
                self.stats.published_batches += 1
            except (BusError, WireError) as exc:
                self.stats.failed += 1
                log.warning("eldr capture: block batch %d not published: %s", batch.seq, exc)
        for done in item.done:
            try:
                await bus.js_publish(
                    subjects.prefill_done(done.prefill_worker), done, msg_id=done.request_id
                )
                self.stats.published_done += 1
            except (BusError, WireError) as exc:
                self.stats.failed += 1
                log.warning(
                    "eldr capture: PrefillDone of %s not published: %s", done.request_id, exc
                )

    async def _publish_messages(self, bus: Bus, items: tuple[Outgoing, ...]) -> None:
        try:
            await self._publish_each(bus, items)
        except Exception as exc:
            self._unexpected("publishing messages", exc)

    async def _publish_each(self, bus: Bus, items: tuple[Outgoing, ...]) -> None:
        subjects = bus.subjects
        for message in items:
            try:
                if isinstance(message, PrefillDone):
                    await bus.js_publish(
                        subjects.prefill_done(message.prefill_worker),
                        message,
                        msg_id=message.request_id,
                    )
                    self.stats.published_done += 1
                else:
                    await bus.js_publish(
                        subjects.profiles(message.worker_id),
                        message,
                        msg_id=f"profile-{message.request_id}",
                    )
                    self.stats.published_summaries += 1
            except (BusError, WireError) as exc:
                self.stats.failed += 1
                log.warning(
                    "eldr capture: %s of %s not published: %s",
                    type(message).__name__,
                    message.request_id,
                    exc,
                )

    async def _publish_status(self, bus: Bus) -> None:
        assert self.status_source is not None
        try:
            status = self.status_source()
            if status is None:
                return
            await bus.publish(bus.subjects.capture(status.worker_id), status)
            self.stats.published_statuses += 1
        except (BusError, WireError) as exc:
            self.stats.failed += 1
            log.warning("eldr capture: status not published: %s", exc)
        except Exception as exc:
            self._unexpected("publishing the status", exc)
