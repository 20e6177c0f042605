"""The shape of every ELDR service process.

`run_service` does what each service would otherwise write again: configure logging,
create a fresh Prometheus registry, connect the bus and apply the topology, serve
`/metrics`, `/healthz` and `/readyz` over HTTP, call the service's `setup(ctx)` to wire its
handlers, then wait for SIGTERM/SIGINT and shut down gracefully: mark not-ready, run the
service's `on_stopping` callbacks while still connected, drain the bus (consumers stop
fetching, in-flight handlers finish and ack), run the service's cleanups (in reverse order,
through an AsyncExitStack), close the HTTP server.

Readiness is explicit: a service calls `ctx.set_ready()` when it can do its job (the
signature service, for instance, only after replaying the block stream).

Background work goes through `ctx.spawn` (a long-running task) and `ctx.every` (a periodic
tick): both are cancelled and awaited at shutdown, a crash is logged (and makes the service
not ready), a failing tick is logged and the schedule goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from eldr.aio import wait_event
from eldr.bus import Bus, apply_topology, build_topology
from eldr.settings import CommonSettings

log = logging.getLogger(__name__)

S = TypeVar("S", bound=CommonSettings)


@dataclass
class Background:
    """A task started by `ServiceContext.spawn` or `.every`."""

    name: str
    task: asyncio.Task[None]

    async def stop(self) -> None:
        """Cancel the task and wait until it has ended (idempotent; its failure, if any,
        was logged when it happened)."""
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)

    async def wait(self) -> None:
        """Wait until the work ends by itself (e.g. after asking it to stop)."""
        await asyncio.gather(self.task, return_exceptions=True)


@dataclass
class ServiceContext(Generic[S]):
    """What `setup` gets: settings, the connected bus, the registry, a stop signal."""

    name: str
    settings: S
    bus: Bus
    registry: CollectorRegistry
    stack: AsyncExitStack
    stopping: asyncio.Event
    started_monotonic_s: float = field(default_factory=time.monotonic)
    _ready: bool = False
    _checks: dict[str, Callable[[], bool]] = field(default_factory=dict)
    ready_event: asyncio.Event = field(default_factory=asyncio.Event)
    """Set while the service is ready (tests running a service in-process await it)."""
    _on_stopping: list[Callable[[], Awaitable[None]]] = field(default_factory=list)

    def on_stopping(self, callback: Callable[[], Awaitable[None]]) -> None:
        """Run `callback` when the stop signal arrives, while the bus is still connected
        (before the drain): e.g. refuse new work and publish a last "draining" report.
        Callbacks run in reverse order of registration; a failing one is logged."""
        self._on_stopping.append(callback)

    async def run_stopping_callbacks(self) -> None:
        for callback in reversed(self._on_stopping):
            try:
                await callback()
            except Exception:
                log.exception("%s: a stopping callback failed; stopping anyway", self.name)

    def spawn(self, name: str, work: Callable[[], Coroutine[Any, Any, None]]) -> Background:
        """Run `work()` in the background until it returns or the service closes: then it
        is cancelled and awaited with the other cleanups (after the bus has drained), or
        earlier by `Background.stop()`. If it fails, the failure is logged and the service
        is marked not ready: it can no longer do its job."""
        background = Background(name, asyncio.create_task(work(), name=f"{self.name} {name}"))
        background.task.add_done_callback(lambda task: self._background_ended(name, task))
        self.stack.push_async_callback(background.stop)
        return background

    def every(
        self,
        name: str,
        interval_s: float,
        tick: Callable[[], Awaitable[None]],
        *,
        first_after_s: float = 0.0,
        until: Literal["stop", "close"],
    ) -> Background:
        """Call `tick()` every `interval_s` (a fixed rate: a slow tick delays the next one
        but the schedule does not drift; ticks late by more than a period are skipped), the
        first after `first_after_s`. `until="stop"`: no tick after the stop signal (the
        router's expiry, the trainer's refit schedule); `"close"`: ticks go on while the
        bus drains (the gateway's health probes; the adapter's reports, which it stops
        itself). A tick that raises is logged and the next one comes as planned."""

        async def run() -> None:
            next_s = time.monotonic() + first_after_s
            while True:
                delay_s = next_s - time.monotonic()
                if until == "stop":
                    if self.stopping.is_set():
                        return
                    if delay_s > 0:
                        await wait_event(self.stopping, delay_s)
                        if self.stopping.is_set():
                            return
                elif delay_s > 0:
                    await asyncio.sleep(delay_s)
                try:
                    await tick()
                except Exception:
                    log.exception(
                        "%s: %s failed; the next one is due in %g s", self.name, name, interval_s
                    )
                next_s = max(next_s + interval_s, time.monotonic())

        return self.spawn(name, run)

    def _background_ended(self, name: str, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error("%s: background task %s failed: %r", self.name, name, exc, exc_info=exc)
            self.set_ready(False)

    def set_ready(self, ready: bool = True) -> None:
        if ready:
            self.ready_event.set()
        else:
            self.ready_event.clear()
        if ready != self._ready:
            log.info(
                "%s %s is %s",
                self.name,
                self.settings.instance_id,
                "ready" if ready else "not ready",
            )
        self._ready = ready

    def add_health_check(self, name: str, check: Callable[[], bool]) -> None:
        """A readiness condition evaluated on every /readyz (must be cheap)."""
        self._checks[name] = check

    def readiness(self) -> tuple[bool, dict[str, bool]]:
        detail = {"started": self._ready, "bus_connected": self.bus.is_connected}
        for name, check in self._checks.items():
            try:
                detail[name] = bool(check())
            except Exception:  # a broken check means not ready, never a crash
                log.exception("readiness check %s failed", name)
                detail[name] = False
        return all(detail.values()), detail


def service_info(registry: CollectorRegistry, name: str) -> None:
    """`eldr_service_info{service=name} 1`, on every service's registry."""
    Gauge(
        "eldr_service_info",
        "Constant 1, labelled with the service name.",
        ["service"],
        registry=registry,
    ).labels(service=name).set(1)


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


async def _start_http(ctx: ServiceContext[S], host: str, port: int) -> web.AppRunner:
    async def metrics(_: web.Request) -> web.Response:
        body = generate_latest(ctx.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"service": ctx.name, "instance": ctx.settings.instance_id})

    async def readyz(_: web.Request) -> web.Response:
        ok, detail = ctx.readiness()
        return web.json_response({"ready": ok, **detail}, status=200 if ok else 503)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    log.info("%s serving /metrics /healthz /readyz on %s:%d", ctx.name, host, port)
    return runner


async def run_service(
    name: str,
    settings: S,
    setup: Callable[[ServiceContext[S]], Awaitable[None]],
    *,
    stop: asyncio.Event | None = None,
    ready: asyncio.Event | None = None,
    install_signal_handlers: bool = True,
    no_echo: bool = False,
) -> None:
    """Run a service until `stop` is set or the process gets SIGTERM/SIGINT.

    `ready`, when given, is set once the service calls `ctx.set_ready()` (for tests that
    run services in-process). `no_echo`: see `Bus.connect`.
    """
    stopping = stop or asyncio.Event()
    registry = CollectorRegistry()
    service_info(registry, name)
    bus = await Bus.connect(
        settings, f"eldr-{name}-{settings.instance_id}", registry=registry, no_echo=no_echo
    )
    runner: web.AppRunner | None = None
    async with AsyncExitStack() as stack:
        ctx: ServiceContext[S] = ServiceContext(
            name=name, settings=settings, bus=bus, registry=registry, stack=stack, stopping=stopping
        )
        if ready is not None:
            ctx.ready_event = ready
        try:
            # Only what this service's role owns is changed (eldr.bus.owners).
            changes = await apply_topology(
                bus, build_topology(settings.namespace, settings), role=name
            )
            for change in changes:
                if change.action != "unchanged":
                    log.info("topology %s %s: %s", change.kind, change.name, change.action)
            if settings.metrics_port:
                runner = await _start_http(ctx, settings.metrics_host, settings.metrics_port)
            if install_signal_handlers:
                loop = asyncio.get_running_loop()
                for sig in (signal.SIGTERM, signal.SIGINT):
                    with contextlib.suppress(NotImplementedError, RuntimeError):
                        loop.add_signal_handler(sig, stopping.set)
            await setup(ctx)
            # Everything allocated so far (imported modules, settings, caches warmed at
            # start) lives as long as the process: move it out of the collector's reach,
            # so that full collections no longer walk it. Without this a full collection
            # of a service's heap pauses its event loop for ~50 ms (measured), which is
            # the tail latency of every request in flight at that moment.
            gc.collect()
            gc.freeze()
            await stopping.wait()
            log.info("%s %s stopping: draining", name, settings.instance_id)
            ctx.set_ready(False)
            await ctx.run_stopping_callbacks()
        finally:
            ctx.set_ready(False)
            await bus.drain()
            # the ExitStack closes here: service cleanups run after the bus has drained
    if runner is not None:
        await runner.cleanup()
    await bus.close()
    log.info("%s %s stopped", name, settings.instance_id)


T = TypeVar("T")


def run_async(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run` on uvloop: the services spend most of their CPU in the event loop and
    socket I/O, where uvloop's libuv loop costs a fraction of asyncio's default one."""
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


def service_main(
    name: str,
    settings_type: type[S],
    setup: Callable[[ServiceContext[S]], Awaitable[None]],
    *,
    no_echo: bool = False,
) -> int:
    """Console entry: read settings from the environment, run until signalled."""
    settings = settings_type()
    configure_logging(settings.log_level)
    run_async(run_service(name, settings, setup, no_echo=no_echo))
    return 0
