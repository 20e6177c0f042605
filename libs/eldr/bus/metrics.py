"""Prometheus metrics of the bus, registered on a registry the caller owns.

Labels are bounded: `family` is a subject family (`prefill.done`, `blocks`, ...; see
`Subjects.family`), never a full subject; `reason` and `outcome` come from fixed sets.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from eldr.bus.errors import REFUSAL_REASONS

LATENCY_BUCKETS_S = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
"""Buckets of every request-path latency histogram (bus handlers, the router's decision
and signature fetch, the gateway's waits, the signature service's assembly wait, the
simulated prefill's): 0.1 ms to 10 s, 1-2.5-5 per decade, so the same quantile reads alike
across services. (The decision path runs at 0.1-2 ms; the alert rules' thresholds, 10 and
50 ms, are bucket bounds.)"""

REJECT_REASONS = (
    "too_large",
    "invalid",
    "handler_error",
    "exhausted",
    "dead_letter_failed",
    *REFUSAL_REASONS,
)
"""`too_large`: over max_payload_bytes; `invalid`: not a valid message of the expected
type; `handler_error`: the handler raised; `exhausted`: failed on its last delivery;
`dead_letter_failed`: could not be dead-lettered (kept for redelivery); the
`REFUSAL_REASONS`: well-formed, but refused for what it claims (`eldr.bus.Reject`)."""


class BusMetrics:
    """Counters and timings of one `Bus`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.received = Counter(
            "eldr_bus_messages_received_total",
            "Messages delivered to this process, by subject family.",
            ["family"],
            registry=registry,
        )
        self.rejected = Counter(
            "eldr_bus_messages_rejected_total",
            "Messages not processed successfully, by subject family and reason.",
            ["family", "reason"],
            registry=registry,
        )
        self.retried = Counter(
            "eldr_bus_messages_retried_total",
            "JetStream messages negatively acknowledged for redelivery, by subject family.",
            ["family"],
            registry=registry,
        )
        self.dead_letters = Counter(
            "eldr_bus_dead_letters_total",
            "Messages published to the dead-letter stream, by subject family.",
            ["family"],
            registry=registry,
        )
        self.published = Counter(
            "eldr_bus_messages_published_total",
            "Messages published, by subject family and transport (core, jetstream).",
            ["family", "transport"],
            registry=registry,
        )
        self.transient_errors = Counter(
            "eldr_bus_transient_errors_total",
            "Expected faults of a clustered bus (a leader election, a node restart), "
            "retried with backoff: by operation and kind (eldr.bus.transient).",
            ["op", "kind"],
            registry=registry,
        )
        self.hedged = Counter(
            "eldr_bus_requests_hedged_total",
            "Requests sent again because no answer came within their hedge delay (the "
            "first answer of any copy is taken), by subject family.",
            ["family"],
            registry=registry,
        )
        self.handler_seconds = Histogram(
            "eldr_bus_handler_duration_seconds",
            "Time spent in message handlers, by subject family.",
            ["family"],
            registry=registry,
            buckets=LATENCY_BUCKETS_S,
        )
