"""The router's per-worker load gauges, read from its load table at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest

from eldr.core.routing.loadtable import LoadTable, Report
from eldr_services.router.load_metrics import LoadTableCollector


def scrape(table: LoadTable, now_s: float) -> dict[str, float]:
    registry = CollectorRegistry()
    registry.register(LoadTableCollector(table, clock=lambda: now_s))
    values = {}
    for line in generate_latest(registry).decode().splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            values[series] = float(value)
    return values


def report(worker: str, running: int, *, draining: bool = False) -> Report:
    return Report(worker, "inc", 1, running, 1, 100 * running, 10_000, draining=draining)


def test_live_workers_export_in_flight_requests_and_kv_tokens() -> None:
    table = LoadTable(stale_after_s=3.0)
    table.on_report(report("dw0", 2), now_s=0.0)
    table.on_assignment("dw0", "r1", 50, now_s=0.5)
    values = scrape(table, now_s=1.0)
    assert values['eldr_router_worker_requests{worker="dw0"}'] == 2 + 1 + 1
    assert values['eldr_router_worker_kv_tokens{worker="dw0"}'] == 200 + 50


def test_stale_and_draining_workers_are_not_exported() -> None:
    table = LoadTable(stale_after_s=3.0)
    table.on_report(report("old", 1), now_s=0.0)
    table.on_report(report("leaving", 1, draining=True), now_s=9.0)
    table.on_report(report("fresh", 1), now_s=9.0)
    workers = {k.split('"')[1] for k in scrape(table, now_s=10.0)}
    assert workers == {"fresh"}
