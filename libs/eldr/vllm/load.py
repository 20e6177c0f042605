"""A vLLM decode instance's load, read from its Prometheus `/metrics` (pure parsing).

vLLM 0.32 exports, per engine (summed here over label sets):

- `vllm:num_requests_running`, `vllm:num_requests_waiting` (gauges);
- `vllm:kv_cache_usage_perc` (gauge, a fraction in [0, 1] despite its name);
- `vllm:cache_config_info` (info gauge whose labels carry `block_size` and
  `num_gpu_blocks`: the KV capacity in tokens is their product);
- `vllm:request_success_total` (counter, by finish reason);
- `process_start_time_seconds` (the server process; changes when vLLM restarts).

Started with `--disable-log-stats`, vLLM still serves `/metrics` but with none of these
(`StatsDisabledError` says so, naming the flag).

`AdmissionTracker` fills `LoadReport.admitted`. vLLM exports no request ids, so the ids
come from the decisions that name this worker (the adapter follows `decisions.*`), and
how many of them arrived comes from the metrics: arrivals = the increase of `running +
waiting + finished + aborted` (a request entering the engine adds one to running or
waiting; finishing moves it from running to finished). vLLM counts a request its API
server aborted (the client went away) in none of its series, so `aborted` are the
gateway's abort events for this worker (the adapter follows `finished.*`). The oldest decided
requests are listed as admitted, up to that many. Exact while every request reaching the
instance came through ELDR in decision order; requests sent to it directly make arrivals
retire ELDR's pending assignments early, and reordering in flight swaps ids (the counts the
router uses stay right). Assignments never listed expire in the router after its
`pending_ttl_s`.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
CACHE_INFO = "vllm:cache_config_info"
FINISHED = "vllm:request_success_total"
PROCESS_START = "process_start_time_seconds"


class MetricsError(ValueError):
    """The page is not a vLLM metrics page (a required series is missing)."""


class StatsDisabledError(MetricsError):
    """A Prometheus page without a single `vllm:` series: vLLM runs with
    `--disable-log-stats`, which turns its metrics off."""


STATS_DISABLED = (
    "the instance exports no vllm:* metrics: it was started with --disable-log-stats; "
    "restart it without that flag (the decode adapter reads vllm:num_requests_running, "
    "vllm:num_requests_waiting and vllm:kv_cache_usage_perc; without them the instance "
    "is never reported, so never routed to)"
)


@dataclass(frozen=True)
class VllmLoad:
    running: int
    waiting: int
    kv_usage: float
    """Fraction of the KV cache in use, [0, 1]."""
    kv_capacity_tokens: int
    """0 when the instance does not say."""
    finished_total: int
    process_start_s: float | None

    @property
    def kv_tokens(self) -> int:
        return round(self.kv_usage * self.kv_capacity_tokens)

    @property
    def seen_total(self) -> int:
        """Requests that ever entered the engine (see `AdmissionTracker`)."""
        return self.running + self.waiting + self.finished_total


def parse_metrics(text: str) -> VllmLoad:
    """Read the load of a vLLM instance from its `/metrics` page."""
    sums: dict[str, float] = {}
    capacity = 0
    start: float | None = None
    any_vllm = False
    for family in text_string_to_metric_families(text):
        any_vllm = any_vllm or family.name.startswith("vllm:")
        for sample in family.samples:
            name = sample.name
            if name in (RUNNING, WAITING, KV_USAGE, FINISHED):
                sums[name] = sums.get(name, 0.0) + float(sample.value)
            elif name == CACHE_INFO:
                labels = sample.labels
                with contextlib.suppress(KeyError, ValueError):  # an info gauge without them
                    capacity += int(labels["num_gpu_blocks"]) * int(labels["block_size"])
            elif name == PROCESS_START:
                start = float(sample.value)
    missing = [n for n in (RUNNING, WAITING, KV_USAGE) if n not in sums]
    if missing and not any_vllm and start is not None:
        raise StatsDisabledError(STATS_DISABLED)
    if missing:
        raise MetricsError(f"not a vLLM metrics page: no {', '.join(missing)}")
    return VllmLoad(
        running=max(0, round(sums[RUNNING])),
        waiting=max(0, round(sums[WAITING])),
        kv_usage=min(1.0, max(0.0, sums[KV_USAGE])),
        kv_capacity_tokens=capacity,
        finished_total=max(0, round(sums.get(FINISHED, 0.0))),
        process_start_s=start,
    )


class AdmissionTracker:
    """Which decided requests have reached the instance (see the module docstring)."""

    def __init__(
        self, max_pending: int = 4096, pending_ttl_s: float = 60.0, credit_ttl_s: float = 2.0
    ) -> None:
        self.max_pending = max_pending
        self.pending_ttl_s = pending_ttl_s
        self.credit_ttl_s = credit_ttl_s
        """An arrival with no decision to match it is kept this long: the decision may
        reach the adapter after the request reached vLLM."""
        self._pending: OrderedDict[str, float] = OrderedDict()
        self._credit: list[float] = []
        self._ready: list[str] = []
        self._last_seen: int | None = None
        self.aborted = 0
        """Requests aborted on this instance through its API server (see the module
        docstring); they count as having arrived."""

    def __len__(self) -> int:
        return len(self._pending)

    def assigned(self, request_id: str, now_s: float) -> None:
        """A decision sent `request_id` here."""
        if request_id in self._pending or request_id in self._ready:
            return
        self._credit = [t for t in self._credit if now_s - t <= self.credit_ttl_s]
        if self._credit:
            self._credit.pop(0)
            self._ready.append(request_id)
            return
        self._pending[request_id] = now_s
        while len(self._pending) > self.max_pending:
            self._pending.popitem(last=False)

    def abort(self) -> None:
        """The gateway aborted a request on this instance (its client went away)."""
        self.aborted += 1

    def reset(self) -> None:
        """The instance restarted: its counters start again."""
        self._last_seen = None
        self.aborted = 0

    def admitted(self, load: VllmLoad, now_s: float) -> list[str]:
        """Ids admitted since the previous scrape, oldest decision first."""
        while self._pending:
            oldest_id, at = next(iter(self._pending.items()))
            if now_s - at <= self.pending_ttl_s:
                break
            del self._pending[oldest_id]
        # An abort event that reaches the adapter before vLLM took the request out of
        # `running` counts it twice for one scrape: at most one decided request is listed
        # early. An abort no event tells of (a client of the instance itself) lowers the
        # sum; the clamp keeps that from hiding later arrivals.
        seen = load.seen_total + self.aborted
        arrivals = 0 if self._last_seen is None else max(0, seen - self._last_seen)
        self._last_seen = seen
        out, self._ready = self._ready, []
        while arrivals > 0 and self._pending:
            request_id, _ = self._pending.popitem(last=False)
            out.append(request_id)
            arrivals -= 1
        self._credit = [t for t in self._credit if now_s - t <= self.credit_ttl_s]
        self._credit.extend([now_s] * min(arrivals, self.max_pending))
        return out
