"""The decode adapter against a real nats-server and a stand-in vLLM `/metrics` page.

`MetricsStandIn` is a test double serving a vLLM-shaped Prometheus page whose numbers the
test sets; real vLLM metrics are read in tests/vllm (`make test-vllm`).
"""

from __future__ import annotations

import asyncio
import socket
import time
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from eldr.bus import Bus, Delivery
from eldr.settings import BusSettings
from eldr.wire import Decision, LoadReport, RequestFinished
from eldr_services.decodeadapter.service import setup
from eldr_services.decodeadapter.settings import DecodeAdapterSettings
from support import messages
from support.services import running_service

pytestmark = pytest.mark.integration


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class MetricsStandIn:
    def __init__(self) -> None:
        self.running = 0
        self.waiting = 0
        self.finished = 0
        self.up = True
        self.page: str | None = None
        """A whole page to serve instead (e.g. vLLM's with its stats off)."""
        self.port = free_port()
        self._runner: web.AppRunner | None = None

    async def metrics(self, _: web.Request) -> web.Response:
        if not self.up:
            return web.Response(status=503)
        if self.page is not None:
            return web.Response(text=self.page)
        return web.Response(
            text=(
                f'vllm:num_requests_running{{engine="0"}} {self.running}\n'
                f'vllm:num_requests_waiting{{engine="0"}} {self.waiting}\n'
                'vllm:kv_cache_usage_perc{engine="0"} 0.5\n'
                'vllm:cache_config_info{block_size="32",num_gpu_blocks="10"} 1\n'
                f'vllm:request_success_total{{finished_reason="stop"}} {self.finished}\n'
                "process_start_time_seconds 1000\n"
            )
        )

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self.metrics)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


def adapter(settings: DecodeAdapterSettings) -> AbstractAsyncContextManager[None]:
    return running_service("decodeadapter", settings, setup)


def decision(request_id: str, worker: str) -> Decision:
    return messages.decision(request_id, worker)


async def next_report(reports: asyncio.Queue[LoadReport], where: Any) -> LoadReport:
    while True:
        report = await asyncio.wait_for(reports.get(), 10)
        if where(report):
            return report


async def test_reports_load_admissions_liveness_and_draining(
    bus: Bus, bus_settings: BusSettings
) -> None:
    vllm = MetricsStandIn()
    await vllm.start()
    reports: asyncio.Queue[LoadReport] = asyncio.Queue()

    async def on_report(report: LoadReport, _: Delivery) -> None:
        await reports.put(report)

    await bus.subscribe(bus.subjects.load("decode-7"), LoadReport, on_report)
    settings = DecodeAdapterSettings(
        **bus_settings.model_dump(),
        adapter_worker_id="decode-7",
        adapter_url=f"http://127.0.0.1:{vllm.port}",
        adapter_interval_s=0.1,
    )
    try:
        async with adapter(settings):
            first = await next_report(reports, lambda r: True)
            assert (first.kv_tokens, first.kv_capacity_tokens) == (160, 320)
            await bus.publish(bus.subjects.decision("a"), decision("a", "decode-7"))
            await bus.publish(bus.subjects.decision("x"), decision("x", "decode-9"))
            await bus.flush()
            await asyncio.sleep(0.3)  # the adapter sees the decisions before the arrival
            vllm.waiting = 1
            admitted = await next_report(reports, lambda r: r.admitted)
            assert admitted.admitted == ["a"]
            assert admitted.waiting == 1
            vllm.up = False
            await asyncio.sleep(0.5)
            while not reports.empty():
                reports.get_nowait()
            await asyncio.sleep(0.5)
            assert reports.empty()  # down: no report, the routers let it go stale
            vllm.up = True
            back = await next_report(reports, lambda r: True)
            assert back.incarnation == first.incarnation
            assert back.seq > admitted.seq
        last = await next_report(reports, lambda r: r.draining)
        assert last.worker_id == "decode-7"
    finally:
        await vllm.stop()


def settings_for(bus_settings: BusSettings, vllm: MetricsStandIn) -> DecodeAdapterSettings:
    return DecodeAdapterSettings(
        **bus_settings.model_dump(),
        adapter_worker_id="decode-7",
        adapter_url=f"http://127.0.0.1:{vllm.port}",
        adapter_interval_s=0.1,
    )


async def test_an_instance_with_its_stats_off_is_refused_at_start_naming_the_flag(
    bus_settings: BusSettings,
) -> None:
    vllm = MetricsStandIn()
    # The page real vLLM 0.32.0 serves with --disable-log-stats (recorded).
    vllm.page = (
        Path(__file__).parents[1] / "data" / "vllm-0.32.0-metrics-disable-log-stats.txt"
    ).read_text()
    await vllm.start()
    try:
        with pytest.raises(Exception, match="started with --disable-log-stats"):
            async with adapter(settings_for(bus_settings, vllm)):
                pass
    finally:
        await vllm.stop()


async def test_requests_the_gateway_aborted_count_as_arrivals(
    bus: Bus, bus_settings: BusSettings
) -> None:
    vllm = MetricsStandIn()
    vllm.running = 1
    await vllm.start()
    reports: asyncio.Queue[LoadReport] = asyncio.Queue()

    async def on_report(report: LoadReport, _: Delivery) -> None:
        await reports.put(report)

    await bus.subscribe(bus.subjects.load("decode-7"), LoadReport, on_report)
    try:
        async with adapter(settings_for(bus_settings, vllm)):
            await next_report(reports, lambda r: True)  # the baseline: one running
            await bus.publish(bus.subjects.decision("b"), decision("b", "decode-7"))
            # The running request's client went away: vLLM drops it from `running` and
            # counts it nowhere; b arrives meanwhile. The page still says one running.
            await bus.publish(
                bus.subjects.finished("gw0"),
                RequestFinished(
                    request_id="a",
                    gateway_id="gw0",
                    ts_s=time.time(),
                    reason="abort",
                    worker_id="decode-7",
                ),
            )
            await bus.flush()
            admitted = await next_report(reports, lambda r: r.admitted)
            assert admitted.admitted == ["b"]
    finally:
        await vllm.stop()
