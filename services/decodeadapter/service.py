"""Decode adapter: a vLLM decode instance's load and liveness, as `LoadReport`s.

Every `adapter_interval_s` it scrapes the instance's `/metrics` (`eldr.vllm.load`) and
publishes a `LoadReport` on `{ns}.load.{worker}`: running and waiting requests, KV tokens
in use and capacity, and the ids of the requests admitted since the previous report.

- Liveness: a scrape that fails publishes nothing, so the routers' load tables drop the
  worker after their `stale_after_s`; it comes back with the next good scrape.
- Restarts: the report's `incarnation` is this adapter's id plus the vLLM process's start
  time, so a restarted vLLM resets the routers' view of the worker.
- Admitted ids: the adapter follows `decisions.*` and lists the decided requests the
  metrics show arriving (`eldr.vllm.load.AdmissionTracker` says how and where it is
  approximate); it follows `finished.*` too, for the requests the gateway aborted on its
  instance, which vLLM's metrics leave out.
- `--disable-log-stats`: vLLM then exports no `vllm:*` series at all; the adapter refuses
  to start against such an instance, naming the flag (and, if the instance is restarted
  so later, says so at every failed scrape's log interval).
- Shutdown: one last report with `draining = true`, so routers stop sending work here at
  once instead of after `stale_after_s`.
"""

from __future__ import annotations

import logging
import time
import uuid

import aiohttp

from eldr.bus import BusError, Delivery
from eldr.bus.topology import IDENTITY
from eldr.runtime import ServiceContext, service_main
from eldr.vllm.load import (
    AdmissionTracker,
    MetricsError,
    StatsDisabledError,
    VllmLoad,
    parse_metrics,
)
from eldr.wire import DecisionRoute, LoadReport, RequestFinished

from .metrics import AdapterMetrics
from .settings import DecodeAdapterSettings

log = logging.getLogger(__name__)

NAME = "decodeadapter"


class DecodeAdapter:
    def __init__(
        self, ctx: ServiceContext[DecodeAdapterSettings], session: aiohttp.ClientSession
    ) -> None:
        self.ctx = ctx
        self.settings = ctx.settings
        self.session = session
        self.metrics = AdapterMetrics(ctx.registry)
        self.tracker = AdmissionTracker(pending_ttl_s=self.settings.adapter_pending_ttl_s)
        self.adapter_id = uuid.uuid4().hex[:12]
        self.seq = 0
        self.last: VllmLoad | None = None
        self.incarnation: str | None = None
        self.failures = 0

    async def on_decision(self, decision: DecisionRoute, _: Delivery) -> None:
        # Every decision, read through the view that decodes only the worker and outcome.
        if decision.worker_id == self.settings.adapter_worker_id:
            self.tracker.assigned(decision.request_id, time.monotonic())

    async def on_finished(self, event: RequestFinished, _: Delivery) -> None:
        if event.reason == "abort" and event.worker_id == self.settings.adapter_worker_id:
            self.tracker.abort()
            self.metrics.aborts.inc()

    async def scrape(self) -> VllmLoad | None:
        url = self.settings.adapter_url + "/metrics"
        try:
            timeout = aiohttp.ClientTimeout(total=self.settings.adapter_scrape_timeout_s)
            async with self.session.get(url, timeout=timeout) as resp:
                if resp.status != 200:
                    raise aiohttp.ClientResponseError(
                        resp.request_info, (), status=resp.status, message="not 200"
                    )
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            self._failed("unreachable", exc)
            return None
        try:
            load = parse_metrics(text)
        except StatsDisabledError as exc:
            self._failed("stats_disabled", exc)
            return None
        except (MetricsError, ValueError) as exc:
            self._failed("invalid", exc)
            return None
        if self.failures:
            log.info("decode instance %s is back", self.settings.adapter_url)
        self.failures = 0
        self.metrics.scrapes.labels("ok").inc()
        self.metrics.up.set(1)
        return load

    async def check_stats(self) -> None:
        """At start: refuse an instance whose metrics are off (`--disable-log-stats`); its
        load could never be reported. An instance not answering yet is no reason to
        refuse (it may still be starting)."""
        url = self.settings.adapter_url + "/metrics"
        try:
            timeout = aiohttp.ClientTimeout(total=self.settings.adapter_scrape_timeout_s)
            async with self.session.get(url, timeout=timeout) as resp:
                text = await resp.text() if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError):
            return
        if text is None:
            return
        try:
            parse_metrics(text)
        except StatsDisabledError as exc:
            self.metrics.scrapes.labels("stats_disabled").inc()
            raise StatsDisabledError(f"decode instance {url}: {exc}") from None
        except (MetricsError, ValueError):
            return  # said by every scrape

    def _failed(self, outcome: str, exc: BaseException) -> None:
        self.failures += 1
        self.metrics.scrapes.labels(outcome).inc()
        self.metrics.up.set(0)
        if self.failures == 1 or self.failures % 60 == 0:
            (log.error if outcome == "stats_disabled" else log.warning)(
                "decode instance %s: %s (%d failed scrapes); not reporting",
                self.settings.adapter_url,
                exc,
                self.failures,
            )

    def report(self, load: VllmLoad, *, draining: bool = False) -> LoadReport:
        incarnation = f"{self.adapter_id}-{int(load.process_start_s or 0)}"
        if incarnation != self.incarnation:
            self.incarnation = incarnation
            self.seq = 0
            self.tracker.reset()
        self.seq += 1
        admitted = [] if draining else self.tracker.admitted(load, time.monotonic())
        return LoadReport(
            worker_id=self.settings.adapter_worker_id,
            incarnation=incarnation,
            seq=self.seq,
            ts_s=time.time(),
            running=load.running,
            waiting=load.waiting,
            kv_tokens=load.kv_tokens,
            kv_capacity_tokens=load.kv_capacity_tokens,
            admitted=admitted[:4096],
            draining=draining,
        )

    async def publish(self, report: LoadReport) -> None:
        bus = self.ctx.bus
        try:
            await bus.publish(bus.subjects.load(report.worker_id), report)
            self.metrics.reports.inc()
        except BusError as exc:
            log.warning("load report %d of %s not sent: %s", report.seq, report.worker_id, exc)

    async def tick(self) -> None:
        load = await self.scrape()
        if load is None:
            return
        self.last = load
        await self.publish(self.report(load))

    async def drain(self) -> None:
        if self.last is not None:
            await self.publish(self.report(self.last, draining=True))


async def setup(ctx: ServiceContext[DecodeAdapterSettings]) -> None:
    session = aiohttp.ClientSession()
    ctx.stack.push_async_callback(session.close)
    adapter = DecodeAdapter(ctx, session)
    await adapter.check_stats()
    await ctx.bus.subscribe(ctx.bus.subjects.decisions_all, DecisionRoute, adapter.on_decision)
    await ctx.bus.subscribe(
        ctx.bus.subjects.finished_all,
        RequestFinished,
        adapter.on_finished,
        identity=IDENTITY[RequestFinished],
    )
    reports = ctx.every(
        "decode-adapter", ctx.settings.adapter_interval_s, adapter.tick, until="close"
    )

    async def stop() -> None:
        await reports.stop()  # no regular report after the draining one
        await adapter.drain()

    ctx.on_stopping(stop)
    ctx.set_ready()
    log.info(
        "decode adapter for %s (%s): reporting every %.2f s",
        ctx.settings.adapter_worker_id,
        ctx.settings.adapter_url,
        ctx.settings.adapter_interval_s,
    )


def main() -> int:
    return service_main(NAME, DecodeAdapterSettings, setup)
