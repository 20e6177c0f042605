"""Partition versions for integration tests: announce one the way the trainer does (blob in
the object store, then the announcement on the PARTITIONS stream)."""

from __future__ import annotations

import time

from eldr.bus import Bus
from eldr.core.partition.partition import Partition
from eldr.partitions.announce import announce_version
from eldr.partitions.writer import blob_for_version


async def announce(bus: Bus, p: Partition) -> None:
    """Store `p`'s blob and announce it as the active version (the topology must exist)."""
    await announce_version(
        bus,
        blob_for_version(p, p.version),
        bucket=f"{bus.subjects.namespace}-partitions",
        subject=bus.subjects.partition_active,
        created_ts_s=time.time(),
    )
