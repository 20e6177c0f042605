"""The decode adapter's Prometheus metrics (on the registry its runtime owns)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class AdapterMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.scrapes = Counter(
            "eldr_adapter_scrapes_total",
            "Scrapes of the vLLM instance's /metrics by outcome (ok, unreachable, invalid, "
            "stats_disabled: vLLM runs with --disable-log-stats).",
            ["outcome"],
            registry=r,
        )
        self.reports = Counter("eldr_adapter_reports_total", "Load reports published.", registry=r)
        self.up = Gauge("eldr_adapter_instance_up", "1 when the last scrape succeeded.", registry=r)
        self.aborts = Counter(
            "eldr_adapter_aborted_requests_total",
            "Requests the gateway aborted on this instance (their client went away): vLLM "
            "counts them in none of its series, the admission count adds them.",
            registry=r,
        )
