"""Which service owns each stream, consumer and bucket of the topology: the one that may
change it.

Every service applies the topology at start (`apply_topology(bus, topology, role=...)`):
what its role owns it creates or updates to its settings; what it does not own it only
creates when missing and otherwise compares, reporting a difference without touching it
(its owner's settings win). Consumers are applied by their owner only. The generated NATS
permissions give each role `$JS.API.STREAM.UPDATE` on its own streams only (`{owned}` in
deploy/nats/permissions.yaml), so a compromised or misconfigured service cannot shrink
another's stream.

The owner is the service whose behaviour depends on the retention: the signature tier
warms up from BLOCKS; routers consume PREFILL, write DECISIONS and read LOAD and FINISHED;
the trainer learns from PROFILES and writes PARTITIONS and the partition bucket. Every
stream of the topology must have an owner (a test checks it).
"""

from __future__ import annotations

from collections.abc import Mapping

from eldr.bus.topology import (
    BLOCKS,
    DECISIONS,
    DLQ,
    FINISHED,
    LOAD,
    PARTITIONS,
    PREFILL,
    PROFILES,
    ROUTER_CONSUMER,
    Topology,
)

STREAM_OWNERS: Mapping[str, str] = {
    BLOCKS: "signature",
    PREFILL: "router",
    DECISIONS: "router",
    LOAD: "router",
    FINISHED: "router",  # RequestFinished from the gateways: the routers' activity table
    PROFILES: "trainer",
    PARTITIONS: "trainer",
    DLQ: "router",
}
"""Stream suffix -> the role that owns it."""

CONSUMER_OWNERS: Mapping[str, str] = {ROUTER_CONSUMER: "router"}
"""Durable consumer name -> the role that owns it."""

BUCKET_OWNER = "trainer"
"""Owner of the partition object store (`{ns}-partitions`, stream `OBJ_{ns}-partitions`)."""


def _suffix(topology: Topology, stream: str) -> str:
    return stream.removeprefix(f"{topology.namespace.upper()}_")


def stream_owner(topology: Topology, stream: str) -> str | None:
    """Owner of the stream named `stream` (a full name, `ELDR_BLOCKS`); None if unknown."""
    return STREAM_OWNERS.get(_suffix(topology, stream))


def owned_streams(topology: Topology, role: str) -> tuple[str, ...]:
    """Full names of the streams `role` may update, the bucket's stream included."""
    names = [s.name for s in topology.streams if stream_owner(topology, s.name) == role]
    if role == BUCKET_OWNER:
        names += [o.stream_name for o in topology.object_stores]
    return tuple(names)


def unowned_streams(topology: Topology) -> tuple[str, ...]:
    """Streams of `topology` that no role owns (must be empty)."""
    return tuple(s.name for s in topology.streams if stream_owner(topology, s.name) is None)
