"""Per-worker load as this router replica sees it, read from its load table at scrape time.

The load table (`eldr.core.routing.loadtable`) holds every live decode worker's last report plus the
assignments made since by any replica, so every replica exports about the same numbers;
dashboards take the max over replicas. Only live workers are exported (a stale or draining
worker's series disappears), so the `worker` label is bounded by the fleet size.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from prometheus_client.core import GaugeMetricFamily, Metric

from eldr.core.routing.activity import ActivityTable
from eldr.core.routing.loadtable import LoadTable


class LoadTableCollector:
    """`eldr_router_worker_requests`, `eldr_router_worker_kv_tokens` and
    `eldr_router_worker_activity_requests`, by worker."""

    def __init__(
        self,
        table: LoadTable,
        activity: ActivityTable | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._table = table
        self._activity = activity
        self._clock = clock

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def collect(self) -> Iterable[Metric]:
        requests, kv_tokens, activity = self._families()
        counted = self._activity.per_worker() if self._activity is not None else {}
        for worker_id in self._table.live_workers(self._clock()):
            state = self._table.get(worker_id)
            if state is None:
                continue
            requests.add_metric([worker_id], state.in_flight)
            kv_tokens.add_metric([worker_id], state.kv_load)
            activity.add_metric([worker_id], counted.get(worker_id, 0))
        return [requests, kv_tokens, activity]

    @staticmethod
    def _families() -> list[GaugeMetricFamily]:
        return [
            GaugeMetricFamily(
                "eldr_router_worker_requests",
                "Requests on a live decode worker as the policies see them: running and "
                "waiting at its last report plus assignments made since.",
                labels=["worker"],
            ),
            GaugeMetricFamily(
                "eldr_router_worker_kv_tokens",
                "KV-cache tokens of a live decode worker at its last report plus the prompt "
                "tokens of assignments made since.",
                labels=["worker"],
            ),
            GaugeMetricFamily(
                "eldr_router_worker_activity_requests",
                "Requests whose predicted experts cost-aware routing counts against a live "
                "decode worker (at most its requests plus activity_slack).",
                labels=["worker"],
            ),
        ]
