"""The router's Prometheus metrics (the load table's per-worker series are read at scrape
time by `load_metrics.LoadTableCollector`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from eldr.bus.metrics import LATENCY_BUCKETS_S
from eldr.core.routing.decide import FALLBACK_REASONS, RouterCore

from .load_metrics import LoadTableCollector


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry, policy: str) -> None:
        """`policy`: the policy this replica starts with (its label set is pre-created)."""
        r = self.registry = registry
        self.decisions = Counter(
            "eldr_router_decisions_total",
            "Decisions committed by this replica, by policy and fallback reason.",
            ["policy", "fallback"],
            registry=r,
        )
        self.decision_seconds = Histogram(
            "eldr_router_decision_latency_seconds",
            "From taking a PrefillDone to the committed decision.",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.signature_seconds = Histogram(
            "eldr_router_signature_fetch_seconds",
            "Signature request/reply round trip.",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.signature_outcomes = Counter(
            "eldr_router_signature_fetches_total",
            "Signature fetches by outcome (complete, partial, timeout, unavailable, error, "
            "no_signature).",
            ["outcome"],
            registry=r,
        )
        sources = Counter(
            "eldr_router_signature_source_total",
            "Where each decided PrefillDone's signature came from: event (the whole "
            "signature in the event: the prefill worker held every cached block's summary), "
            "computed (no prefix-cache hit: the event's computed counts), service (asked the "
            "signature service for the cached blocks; its outcome in "
            "eldr_router_signature_fetches_total), partial_only (a prompt shorter than a "
            "block), none (no signature: capture unavailable, geometry refused, or not "
            "fetched for a policy that needs none).",
            ["source"],
            registry=r,
        )
        self.signature_source = {
            source: sources.labels(source)
            for source in ("event", "computed", "service", "partial_only", "none")
        }
        """Pre-created children: one dict lookup and an increment per decision."""
        self.already_decided = Counter(
            "eldr_router_already_decided_total",
            "Redelivered PrefillDone events answered with the decision committed earlier.",
            registry=r,
        )
        self.expired = Counter(
            "eldr_router_expired_total",
            "PrefillDone events taken after their deadline (the requester had stopped "
            "waiting), recorded as expired instead of assigned.",
            registry=r,
        )
        self.no_live_workers = Counter(
            "eldr_router_no_live_workers_total",
            "PrefillDone events put back because no decode worker was live.",
            registry=r,
        )
        self.live_workers = Gauge(
            "eldr_router_live_workers", "Decode workers in the load table.", registry=r
        )
        self.partition_version = Gauge(
            "eldr_router_partition_version", "Partition version in use (0: none).", registry=r
        )
        self.partition_loads = Counter(
            "eldr_router_partition_loads_total",
            "Partition load attempts, by outcome (ok, error: each failed attempt; retried "
            "with backoff).",
            ["outcome"],
            registry=r,
        )
        self.partition_announced = Gauge(
            "eldr_router_partition_announced_version",
            "Newest partition version this replica has seen announced (0: none).",
            registry=r,
        )
        self.partition_behind = Gauge(
            "eldr_router_partition_behind",
            "1 while the newest announced partition version is not the one in use (its "
            "load failed and is being retried, or is under way).",
            registry=r,
        )
        self.load_reports = Counter(
            "eldr_router_load_reports_total",
            "Load reports applied (ok), ignored as out of order (stale), or refused because "
            "they would add a worker beyond max_workers (fleet_full).",
            ["outcome"],
            registry=r,
        )
        for outcome in ("ok", "stale", "fleet_full"):
            self.load_reports.labels(outcome)
        self.activity_requests = Gauge(
            "eldr_router_activity_requests",
            "In-flight requests whose predicted experts cost-aware routing counts against "
            "their workers (assigned, finish not yet seen).",
            registry=r,
        )
        self.activity_bytes = Gauge(
            "eldr_router_activity_bytes",
            "Memory held by the activity table's entries and per-worker sums.",
            registry=r,
        )
        self.activity_evictions = Counter(
            "eldr_router_activity_evictions_total",
            "Activity entries dropped without a finish: over the worker's in-flight count "
            "plus slack (over_in_flight), older than activity_ttl_s (ttl), table full "
            "(capacity), worker left the table (worker_gone).",
            ["reason"],
            registry=r,
        )
        self.finished = Counter(
            "eldr_router_finish_events_total",
            "Finish events taken, by reason (stop, length, abort, error, moved; profile for "
            "a decode summary) and whether this replica tracked the request (tracked, "
            "untracked).",
            ["reason", "outcome"],
            registry=r,
        )
        self.rejected_inputs = Counter(
            "eldr_router_rejected_inputs_total",
            "Well-formed inputs not used for what they claim, by kind: prefill_geometry (a "
            "PrefillDone's counts of a geometry other than the partition's or beyond the "
            "limits: decided load-only, nothing allocated), decision_geometry (another "
            "replica's decision, not counted in the activity table), activity_shape (an "
            "assignment of another geometry than the activity table's).",
            ["kind"],
            registry=r,
        )
        for kind in ("prefill_geometry", "decision_geometry", "activity_shape"):
            self.rejected_inputs.labels(kind)
        for reason in ("over_in_flight", "ttl", "capacity", "worker_gone"):
            self.activity_evictions.labels(reason)
        # Pre-create the bounded label sets so dashboards see zeros.
        for reason in ("none", *FALLBACK_REASONS):
            self.decisions.labels(policy, reason)

    def watch(self, core: RouterCore) -> None:
        """Read `core`'s load and activity tables at scrape time."""
        self.registry.register(LoadTableCollector(core.table, core.activity))
        activity = core.activity
        self.activity_requests.set_function(lambda: len(activity))
        self.activity_bytes.set_function(lambda: activity.nbytes)
