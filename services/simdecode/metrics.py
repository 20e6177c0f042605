"""The simulated decode workers' Prometheus metrics (`eldr_simdecode_*`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

UNION_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
STEP_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.2, 0.5)
TPOT_BUCKETS_S = (0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0)


class SimDecodeMetrics:
    """`eldr_simdecode_*`; the worker label is bounded: a process hosts a configured set."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.steps = Counter(
            "eldr_simdecode_steps_total", "Decode steps run.", ["worker"], registry=registry
        )
        self.union = Histogram(
            "eldr_simdecode_step_union_experts",
            "Distinct experts per MoE layer activated by one decode step's batch.",
            ["worker"],
            buckets=UNION_BUCKETS,
            registry=registry,
        )
        self.batch = Histogram(
            "eldr_simdecode_batch_size",
            "Requests in one decode step.",
            ["worker"],
            buckets=BATCH_BUCKETS,
            registry=registry,
        )
        self.step_seconds = Histogram(
            "eldr_simdecode_step_seconds",
            "Cost-model duration of one decode step (simulated seconds).",
            ["worker"],
            buckets=STEP_BUCKETS_S,
            registry=registry,
        )
        self.tpot_seconds = Histogram(
            "eldr_simdecode_tpot_seconds",
            "Time per output token of a finished request, queueing included (simulated s).",
            ["worker"],
            buckets=TPOT_BUCKETS_S,
            registry=registry,
        )
        self.finished = Counter(
            "eldr_simdecode_finished_total", "Requests finished.", ["worker"], registry=registry
        )
        self.jobs = Counter(
            "eldr_simdecode_jobs_total",
            "DecodeJobs received, by outcome (accepted, draining, wrong_worker, invalid).",
            ["worker", "outcome"],
            registry=registry,
        )
        self.abandoned = Counter(
            "eldr_simdecode_abandoned_total",
            "Accepted requests dropped unfinished at shutdown.",
            ["worker"],
            registry=registry,
        )
        self.running = Gauge(
            "eldr_simdecode_running", "Requests decoding now.", ["worker"], registry=registry
        )
        self.waiting = Gauge(
            "eldr_simdecode_waiting",
            "Accepted requests waiting for a batch slot.",
            ["worker"],
            registry=registry,
        )
        self.kv_tokens = Gauge(
            "eldr_simdecode_kv_tokens", "KV-cache tokens held.", ["worker"], registry=registry
        )
        self.profiles_dropped = Counter(
            "eldr_simdecode_profiles_dropped_total",
            "DecodeSummaries not published (queue full or publish failed).",
            ["reason"],
            registry=registry,
        )
        self.reports = Counter(
            "eldr_simdecode_load_reports_total",
            "LoadReports published.",
            registry=registry,
        )
        self.late_seconds = Counter(
            "eldr_simdecode_late_seconds_total",
            "Real seconds busy workers' steps started after their predecessor's planned end "
            "(the event loop was late): time the modelled hardware would not have lost.",
            ["worker"],
            registry=registry,
        )
        self.late_steps = Counter(
            "eldr_simdecode_late_steps_total",
            "Steps of a busy worker that started after their predecessor's planned end.",
            ["worker"],
            registry=registry,
        )
        self.lost_seconds = Counter(
            "eldr_simdecode_lost_seconds_total",
            "Of the late seconds, those a busy worker could not catch up with (late by more "
            "than max_lag_s, its schedule restarted): time added to the modelled one.",
            ["worker"],
            registry=registry,
        )
