"""The simulated prefill's Prometheus metrics: each replay round's outcomes."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from eldr.bus.metrics import LATENCY_BUCKETS_S
from eldr.sim.traffic import TrafficDriver, TrafficSummary


class SimPrefillMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "eldr_simprefill_requests_total",
            "Replayed requests by outcome (decided, recovered, lost, error).",
            ["outcome"],
            registry=registry,
        )
        self.latency = Histogram(
            "eldr_simprefill_decision_latency_seconds",
            "PrefillDone publish -> Decision on the reply inbox.",
            buckets=LATENCY_BUCKETS_S,
            registry=registry,
        )
        self.blocks = Counter(
            "eldr_simprefill_blocks_published_total",
            "Block summaries published (each distinct block once).",
            registry=registry,
        )

    def observe(self, driver: TrafficDriver, summary: TrafficSummary) -> None:
        for record in driver.records:
            if record.decision_latency_s is not None:
                self.latency.observe(record.decision_latency_s)
        self.requests.labels("decided").inc(summary.decided - summary.recovered)
        self.requests.labels("recovered").inc(summary.recovered)
        self.requests.labels("lost").inc(summary.lost)
        self.requests.labels("error").inc(summary.errors - summary.lost)
        self.blocks.inc(summary.blocks_published)
