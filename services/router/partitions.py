"""The router's partition loader: the newest announced version, loaded off the request path.

Announcements arrive on `partitions.active` (read back from the stream at start, then live);
the loader fetches the newest one's blob, builds its index in a thread and swaps it into the
`RouterCore`. A failed load (the blob not there yet, a transient error, a corrupt blob) is
retried with backoff until it succeeds or a newer announcement replaces it; meanwhile the
replica routes with the version it has and says so (`eldr_router_partition_behind`,
`RouterControlReply.announced_version` / `partition_error`).
"""

from __future__ import annotations

import asyncio
import logging

from eldr.aio import wait_event
from eldr.bus import Bus, BusError, Delivery
from eldr.core.routing.decide import RouterCore
from eldr.partitions.codec import partition_from_blob
from eldr.wire import PartitionAnnouncement, PartitionBlob

from .metrics import RouterMetrics

log = logging.getLogger(__name__)

PARTITION_RETRY_MIN_S = 0.5
PARTITION_RETRY_MAX_S = 10.0
"""A failed partition load is retried after 0.5 s, doubling up to 10 s (a missing blob
costs one object-store lookup per 10 s)."""


class PartitionLoader:
    """The newest announced partition for one router replica (module docstring)."""

    def __init__(
        self,
        bus: Bus,
        bucket: str,
        core: RouterCore,
        metrics: RouterMetrics,
        *,
        index_method: str,
        instance_id: str,
    ) -> None:
        self.bus = bus
        self.bucket = bucket
        self.core = core
        self.metrics = metrics
        self.index_method = index_method
        self.instance_id = instance_id
        self.latest: tuple[int, PartitionAnnouncement] | None = None
        """The newest announcement (its stream sequence and itself)."""
        self._loaded_seq = 0
        self.error: str | None = None
        """Why the newest announced version is not in use, while it is not."""
        self._wakeup = asyncio.Event()

    async def on_announcement(self, msg: PartitionAnnouncement, delivery: Delivery) -> None:
        seq = delivery.stream_seq or 0
        if self.latest is None or seq > self.latest[0]:
            self.latest = (seq, msg)
            self.metrics.partition_announced.set(msg.version)
            self.metrics.partition_behind.set(1)
            self._wakeup.set()

    @property
    def behind(self) -> bool:
        """Whether a newer announcement than the version in use is not loaded (yet)."""
        latest = self.latest
        return latest is not None and latest[0] > self._loaded_seq

    async def run(self, stopping: asyncio.Event) -> None:
        """Load each newest announcement until `stopping` (module docstring)."""
        backoff_s = PARTITION_RETRY_MIN_S
        while not stopping.is_set():
            latest = self.latest
            if latest is None or latest[0] <= self._loaded_seq:
                await self._wakeup.wait()
                self._wakeup.clear()
                continue
            seq, ann = latest
            try:
                blob = await self.bus.object_get(
                    self.bucket, ann.object_name, PartitionBlob, expected_sha256=ann.sha256
                )
                partition = await asyncio.to_thread(partition_from_blob, blob, self.index_method)
            except (BusError, ValueError) as exc:
                self.metrics.partition_loads.labels("error").inc()
                self.error = f"version {ann.version}: {exc}"[:1000]
                in_use = self.core.partition
                log.error(
                    "could not load partition version %d (routing with %s; retrying in %.1f s): %s",
                    ann.version,
                    "none" if in_use is None else f"version {in_use.version}",
                    backoff_s,
                    exc,
                )
                self._wakeup.clear()
                # A newer announcement tries at once; else the same one after the wait.
                await wait_event(self._wakeup, backoff_s)
                backoff_s = min(backoff_s * 2, PARTITION_RETRY_MAX_S)
                continue
            backoff_s = PARTITION_RETRY_MIN_S
            self.core.set_partition(partition)
            self._loaded_seq = seq
            self.error = None
            self.metrics.partition_loads.labels("ok").inc()
            self.metrics.partition_version.set(partition.version)
            self.metrics.partition_behind.set(1 if self.behind else 0)
            log.info(
                "router %s now routes with partition version %d (%d workers)",
                self.instance_id,
                partition.version,
                partition.k,
            )
