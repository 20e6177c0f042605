"""The gateway's Prometheus metrics (on the registry its runtime owns)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from eldr.bus.metrics import LATENCY_BUCKETS_S


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.requests = Counter(
            "eldr_gateway_requests_total",
            "Client requests by endpoint (completions, chat; models, tokenize, detokenize, "
            "version passed through) and outcome (ok, client_error, upstream_error, "
            "unavailable, aborted: the client went away).",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.decision_wait = Histogram(
            "eldr_gateway_decision_wait_seconds",
            "From the prefill's answer to the routing decision.",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.prefill_seconds = Histogram(
            "eldr_gateway_prefill_seconds",
            "Prefill request round trip.",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.decisions = Counter(
            "eldr_gateway_decisions_total",
            "How the decode instance was chosen (inbox, stream, fallback).",
            ["source"],
            registry=r,
        )
        self.prefill_reconnects = Counter(
            "eldr_gateway_prefill_reconnects_total",
            "Prefill requests sent again on a fresh connection after the instance dropped "
            "the kept-alive one before answering.",
            registry=r,
        )
        self.decode_retries = Counter(
            "eldr_gateway_decode_retries_total",
            "Decode attempts moved to the next candidate after a failure before streaming.",
            registry=r,
        )
        self.in_flight = Gauge(
            "eldr_gateway_requests_in_flight", "Client requests being served.", registry=r
        )
        self.upstream_healthy = Gauge(
            "eldr_gateway_upstream_healthy",
            "1 when the instance answered its last /health probe.",
            ["role", "instance"],
            registry=r,
        )
        self.finish_events = Counter(
            "eldr_gateway_finish_events_total",
            "RequestFinished events published, by reason (stop, length, abort, error, "
            "moved; unpublished when the publish failed).",
            ["reason"],
            registry=r,
        )
        self.client_aborts = Counter(
            "eldr_gateway_client_aborts_total",
            "Requests whose client went away before the answer ended, streamed or not (the "
            "upstream request, prefill or decode, was cancelled: vLLM aborts it).",
            registry=r,
        )
        self.stream_errors = Counter(
            "eldr_gateway_stream_errors_total",
            "Streams that failed after the client got HTTP 200, ended with vLLM's error "
            "event and [DONE]: upstream_broken (the decode connection failed), "
            "idle_timeout (silent for gateway_upstream_idle_timeout_s), upstream_error "
            "(vLLM sent an error event itself).",
            ["reason"],
            registry=r,
        )
        for reason in ("upstream_broken", "idle_timeout", "upstream_error"):
            self.stream_errors.labels(reason)
        self.unauthorized = Counter(
            "eldr_gateway_unauthorized_total",
            "Requests refused for a missing or unknown API key (gateway_api_keys).",
            registry=r,
        )
        self.no_healthy_upstream = Counter(
            "eldr_gateway_no_healthy_upstream_total",
            "Requests answered 503 at once because no instance of the role was healthy.",
            ["role"],
            registry=r,
        )
        self.connector_refused = Gauge(
            "eldr_gateway_connector_refused",
            "1 while the instance is out of rotation because its KV connector (from its "
            "capture plugin's status) is not one the gateway can drive.",
            ["role", "instance"],
            registry=r,
        )
        self.reprefills = Counter(
            "eldr_gateway_reprefills_total",
            "Prefills run again for a decode retry (the failed decode instance may have "
            "pulled the first prefill's KV blocks).",
            registry=r,
        )
        self.prefill_capture = Gauge(
            "eldr_gateway_prefill_capture",
            "1 while the prefill instance's capture plugin says it captures; 0 while its "
            "requests are routed load-only (capture off, failed, or silent).",
            ["instance"],
            registry=r,
        )
        self.capture_fallbacks = Counter(
            "eldr_gateway_capture_fallbacks_total",
            "Requests routed load-only at once because their prefill could not be captured "
            "(capture_off, capture_failed, no_capture_status, capture_stale).",
            ["reason"],
            registry=r,
        )
        self.refused_bodies = Counter(
            "eldr_gateway_refused_bodies_total",
            "Client requests refused for their body: too_large (413), timeout (408, not sent "
            "within gateway_body_timeout_s), invalid (400: not a JSON object, nested too "
            "deeply, a prompt over the limits, a field of the wrong type).",
            ["reason"],
            registry=r,
        )
        for reason in ("too_large", "timeout", "invalid"):
            self.refused_bodies.labels(reason)
        self.capture_status = Counter(
            "eldr_gateway_capture_status_total",
            "Capture statuses received (ok; other_instance: not one of ours). One whose "
            "worker id is not its subject's token is refused by the bus "
            '(eldr_bus_messages_rejected_total{family="capture",reason="identity_mismatch"}).',
            ["outcome"],
            registry=r,
        )
