"""Partition versions for integration tests: announce one the way the trainer does (blob in
the object store, then the announcement on the PARTITIONS stream)."""

from __future__ import annotations

import time

from eldr.bus import Bus
from eldr.core.partition.partition import Partition
from eldr.partitions.codec import blob_sha256, partition_to_blob
from eldr.wire import PartitionAnnouncement


async def announce(bus: Bus, p: Partition) -> None:
    """Store `p`'s blob and announce it as the active version (the topology must exist)."""
    blob = partition_to_blob(p)
    ns = bus.subjects.namespace
    ref = await bus.object_put(f"{ns}-partitions", f"v{p.version}", blob)
    assert ref.sha256 == blob_sha256(blob)
    await bus.js_publish(
        bus.subjects.partition_active,
        PartitionAnnouncement(
            version=p.version,
            model=p.model,
            object_name=f"v{p.version}",
            sha256=ref.sha256,
            created_ts_s=time.time(),
            k=p.k,
            dim=p.calibration.dim,
            workers=list(p.workers),
        ),
    )
