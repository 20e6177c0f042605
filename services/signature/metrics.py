"""The signature service's Prometheus metrics: counters and timings, and the cache's size
and counters read from its state at scrape time."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from eldr.bus import ReadBack
from eldr.bus.metrics import LATENCY_BUCKETS_S
from eldr.signature.state import Outcome, RejectReason, SignatureState
from eldr.wire import BlockSummaryBatch

ASSEMBLY_SECONDS_BUCKETS = (0.00005, *LATENCY_BUCKETS_S)
"""Assembly runs in tens of microseconds: the request-path buckets with one below them."""


class SignatureMetrics:
    """Counters and timings of the signature service (prefix `eldr_signature_`)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.batches_received = Counter(
            "eldr_signature_batches_received_total",
            "Block-summary batches received (valid messages, accepted or not).",
            registry=registry,
        )
        self.blocks_received = Counter(
            "eldr_signature_blocks_received_total",
            "Block summaries received in accepted batches (new or already cached).",
            registry=registry,
        )
        self.batches_rejected = Counter(
            "eldr_signature_batches_rejected_total",
            "Well-formed batches not cached, by reason (malformed ones are counted by "
            "eldr_bus_messages_rejected_total and dead-lettered).",
            ["reason"],
            registry=registry,
        )
        for reason in RejectReason:
            self.batches_rejected.labels(reason.value)
        self.block_conflicts = Counter(
            "eldr_signature_block_conflicts_total",
            "Block summaries that differ from the one cached for their block (another "
            "writer's claim): own = kept for their writer's requests only; trusted = a "
            "trusted writer's, which replaced an untrusted one for everyone.",
            ["outcome"],
            registry=registry,
        )
        for outcome in ("own", "trusted"):
            self.block_conflicts.labels(outcome)
        self.seq_gaps = Counter(
            "eldr_signature_publisher_seq_gaps_total",
            "Batches skipped in publishers' sequence numbers (lost, expired or malformed).",
            registry=registry,
        )
        self.seq_duplicates = Counter(
            "eldr_signature_publisher_seq_duplicates_total",
            "Batches received again (sequence number not above the last; harmless).",
            registry=registry,
        )
        self.publisher_restarts = Counter(
            "eldr_signature_publisher_restarts_total",
            "Publishers seen restarting their sequence at 0.",
            registry=registry,
        )
        self.assemblies = Counter(
            "eldr_signature_assemblies_total",
            "Assemblies answered, by outcome (complete, partial, empty, error).",
            ["outcome"],
            registry=registry,
        )
        for outcome in Outcome:
            self.assemblies.labels(outcome.value)
        self.missing_blocks = Counter(
            "eldr_signature_missing_blocks_total",
            "Blocks requested by assemblies but not cached when answering.",
            registry=registry,
        )
        self.wait_seconds = Histogram(
            "eldr_signature_assembly_wait_seconds",
            "Time assemblies waited for blocks in flight (only those that waited).",
            registry=registry,
            buckets=LATENCY_BUCKETS_S,
        )
        self.assembly_seconds = Histogram(
            "eldr_signature_assembly_duration_seconds",
            "Time from taking an assemble request to having its reply (waiting included).",
            registry=registry,
            buckets=ASSEMBLY_SECONDS_BUCKETS,
        )


class StateCollector:
    """Cache size and counters read from the state at scrape time."""

    def __init__(
        self, state: SignatureState, read_back: ReadBack[BlockSummaryBatch] | None
    ) -> None:
        self._state = state
        self.read_back = read_back

    def describe(self) -> Iterable[Metric]:
        return list(self._metrics())

    def collect(self) -> Iterable[Metric]:
        return list(self._metrics())

    def _metrics(self) -> Iterator[Metric]:
        state, cache = self._state, self._state.cache
        yield GaugeMetricFamily(
            "eldr_signature_cache_entries", "Block summaries cached.", value=len(cache)
        )
        yield GaugeMetricFamily(
            "eldr_signature_cache_bytes",
            "Bytes the cached summaries take (payload plus per-entry overhead).",
            value=cache.bytes_used,
        )
        yield GaugeMetricFamily(
            "eldr_signature_cache_max_bytes", "Byte budget of the cache.", value=cache.max_bytes
        )
        yield CounterMetricFamily(
            "eldr_signature_cache_hits", "Block lookups that found the block.", value=cache.hits
        )
        yield CounterMetricFamily(
            "eldr_signature_cache_misses",
            "Block lookups that did not find the block.",
            value=cache.misses,
        )
        yield CounterMetricFamily(
            "eldr_signature_cache_evictions",
            "Blocks evicted to stay within the byte budget.",
            value=cache.evictions,
        )
        yield GaugeMetricFamily(
            "eldr_signature_cache_own_entries",
            "Writers' own block summaries held beside the shared ones (they disagreed).",
            value=cache.own_entries,
        )
        yield GaugeMetricFamily(
            "eldr_signature_models", "Models with a known geometry.", value=len(state.geometries)
        )
        yield GaugeMetricFamily(
            "eldr_signature_assemblies_waiting",
            "Assemblies waiting now for blocks in flight.",
            value=len(state.waiters),
        )
        reader = self.read_back
        yield GaugeMetricFamily(
            "eldr_signature_replay_stream_seq",
            "Last BLOCKS stream sequence this replica has read.",
            value=reader.last_stream_seq if reader is not None else 0,
        )
        yield GaugeMetricFamily(
            "eldr_signature_replay_caught_up",
            "1 once the read-back of BLOCKS has caught up with the stream as it was at start.",
            value=1 if reader is not None and reader.caught_up.is_set() else 0,
        )
