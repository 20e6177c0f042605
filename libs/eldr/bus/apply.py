"""Make the server's streams, consumers and buckets match a `Topology`, idempotently.

Each service applies the topology at start, so several processes may apply it at once:
creating an object that already exists with the same configuration is accepted by the
server, and a second apply of an unchanged topology changes nothing. Changed limits
update the stream or consumer in place; changes the server cannot apply in place
(storage type, deliver policy) raise `TopologyError` with what to do.

With `role` (what `eldr.runtime` passes: the service's name) a service changes only what
its role owns (`eldr.bus.owners`): another role's stream or bucket it creates when it is
missing (so services may start in any order) and otherwise only compares, reporting a
difference as `differs` without updating it; another role's consumer it leaves alone.
That is all the generated NATS permissions let it do. Without `role` everything is
applied (tests, `eldr import`, tools run by an operator with full rights).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Literal

from nats.js import api

from eldr.bus.bus import Bus
from eldr.bus.connection import translated
from eldr.bus.errors import NotFoundError, TopologyError
from eldr.bus.owners import BUCKET_OWNER, CONSUMER_OWNERS, stream_owner
from eldr.bus.topology import ConsumerSpec, ObjectStoreSpec, StreamSpec, Topology

log = logging.getLogger(__name__)

Action = Literal["created", "updated", "unchanged", "differs"]
"""`differs`: another role owns it and it differs from this service's settings (`detail`:
the fields); left as it is."""


@dataclass(frozen=True)
class TopologyChange:
    kind: Literal["stream", "consumer", "object_store"]
    name: str
    action: Action
    detail: str = ""
    """For updates: the fields that changed."""


_STORAGE = {"file": api.StorageType.FILE, "memory": api.StorageType.MEMORY}
_DISCARD = {"old": api.DiscardPolicy.OLD, "new": api.DiscardPolicy.NEW}
_DELIVER = {"all": api.DeliverPolicy.ALL, "new": api.DeliverPolicy.NEW}


def _seconds_equal(a: float | None, b: float | None) -> bool:
    return math.isclose(a or 0.0, b or 0.0, abs_tol=1e-6)


def _stream_config(spec: StreamSpec) -> api.StreamConfig:
    duplicate_window_s = spec.duplicate_window_s
    if spec.max_age_s > 0:
        # The server refuses a duplicate window longer than max_age.
        duplicate_window_s = min(duplicate_window_s, spec.max_age_s)
    return api.StreamConfig(
        name=spec.name,
        description=spec.description,
        subjects=list(spec.subjects),
        retention=api.RetentionPolicy.LIMITS,
        max_age=spec.max_age_s,
        max_bytes=spec.max_bytes,
        max_msgs=spec.max_msgs,
        max_msgs_per_subject=spec.max_msgs_per_subject,
        max_msg_size=spec.max_msg_size_bytes,
        storage=_STORAGE[spec.storage],
        num_replicas=spec.replicas,
        discard=_DISCARD[spec.discard],
        duplicate_window=duplicate_window_s,
        allow_direct=spec.allow_direct,
    )


def _stream_diff(want: api.StreamConfig, have: api.StreamConfig) -> list[str]:
    changed = []
    if sorted(want.subjects or []) != sorted(have.subjects or []):
        changed.append("subjects")
    for name in ("description", "max_bytes", "max_msgs", "max_msgs_per_subject", "max_msg_size"):
        if getattr(want, name) != getattr(have, name):
            changed.append(name)
    for name in ("max_age", "duplicate_window"):
        if not _seconds_equal(getattr(want, name), getattr(have, name)):
            changed.append(name)
    if want.num_replicas != have.num_replicas:
        changed.append("num_replicas")
    if want.discard != have.discard:
        changed.append("discard")
    if bool(want.allow_direct) != bool(have.allow_direct):
        changed.append("allow_direct")
    if want.storage != have.storage:
        changed.append("storage")
    return changed


async def _apply_stream(bus: Bus, spec: StreamSpec, owner: str | None = None) -> TopologyChange:
    js = bus._js
    want = _stream_config(spec)
    try:
        with translated(f"stream info {spec.name}"):
            info = await js.stream_info(spec.name)
    except NotFoundError:
        with translated(f"create stream {spec.name}"):
            await js.add_stream(want)
        log.info("created stream %s (%s)", spec.name, ", ".join(spec.subjects))
        return TopologyChange("stream", spec.name, "created")
    changed = _stream_diff(want, info.config)
    if not changed:
        return TopologyChange("stream", spec.name, "unchanged")
    if owner is not None:
        return _differs("stream", spec.name, owner, changed)
    if "storage" in changed:
        raise TopologyError(
            f"stream {spec.name} has storage {info.config.storage}, the topology wants "
            f"{spec.storage}: the server cannot change it in place; back up and delete the "
            "stream to change it"
        )
    with translated(f"update stream {spec.name}"):
        await js.update_stream(want)
    log.info("updated stream %s: %s", spec.name, ", ".join(changed))
    return TopologyChange("stream", spec.name, "updated", ", ".join(changed))


def _consumer_config(spec: ConsumerSpec) -> api.ConsumerConfig:
    return api.ConsumerConfig(
        name=spec.durable,
        durable_name=spec.durable,
        description=spec.description,
        deliver_policy=_DELIVER[spec.deliver_policy],
        ack_policy=api.AckPolicy.EXPLICIT,
        ack_wait=spec.ack_wait_s,
        max_deliver=spec.max_deliver,
        max_ack_pending=spec.max_ack_pending,
        filter_subject=spec.filter_subject,
    )


def _consumer_diff(want: api.ConsumerConfig, have: api.ConsumerConfig) -> list[str]:
    changed = [
        name
        for name in (
            "description",
            "deliver_policy",
            "ack_policy",
            "max_deliver",
            "max_ack_pending",
            "filter_subject",
        )
        if getattr(want, name) != getattr(have, name)
    ]
    if not _seconds_equal(want.ack_wait, have.ack_wait):
        changed.append("ack_wait")
    return changed


async def _apply_consumer(bus: Bus, spec: ConsumerSpec) -> TopologyChange:
    js = bus._js
    want = _consumer_config(spec)
    name = f"{spec.stream}/{spec.durable}"
    try:
        with translated(f"consumer info {name}"):
            info = await js.consumer_info(spec.stream, spec.durable)
    except NotFoundError:
        with translated(f"create consumer {name}"):
            await js.add_consumer(spec.stream, want)
        log.info("created consumer %s", name)
        return TopologyChange("consumer", name, "created")
    changed = _consumer_diff(want, info.config)
    if not changed:
        return TopologyChange("consumer", name, "unchanged")
    if "deliver_policy" in changed or "ack_policy" in changed:
        raise TopologyError(
            f"consumer {name}: deliver/ack policy cannot change in place; delete the "
            "consumer to recreate it (its position is lost)"
        )
    # Creating with the same name updates an existing consumer.
    with translated(f"update consumer {name}"):
        await js.add_consumer(spec.stream, want)
    log.info("updated consumer %s: %s", name, ", ".join(changed))
    return TopologyChange("consumer", name, "updated", ", ".join(changed))


def _differs(
    kind: Literal["stream", "object_store"], name: str, owner: str, changed: list[str]
) -> TopologyChange:
    log.warning(
        "%s %s differs from this service's settings (%s); left to its owner, the %s",
        kind.replace("_", " "),
        name,
        ", ".join(changed),
        owner,
    )
    return TopologyChange(kind, name, "differs", ", ".join(changed))


async def _apply_object_store(
    bus: Bus, spec: ObjectStoreSpec, owner: str | None = None
) -> TopologyChange:
    js = bus._js
    try:
        with translated(f"stream info {spec.stream_name}"):
            info = await js.stream_info(spec.stream_name)
    except NotFoundError:
        with translated(f"create object store {spec.bucket}"):
            await js.create_object_store(
                spec.bucket,
                config=api.ObjectStoreConfig(
                    description=spec.description,
                    max_bytes=spec.max_bytes,
                    storage=_STORAGE[spec.storage],
                    replicas=spec.replicas,
                ),
            )
        log.info("created object store %s", spec.bucket)
        return TopologyChange("object_store", spec.bucket, "created")
    have = info.config
    wanted: dict[str, Any] = {
        "description": spec.description,
        "max_bytes": spec.max_bytes,
        "num_replicas": spec.replicas,
    }
    changed = [k for k, v in wanted.items() if getattr(have, k) != v]
    if have.storage != _STORAGE[spec.storage]:
        raise TopologyError(
            f"object store {spec.bucket} has storage {have.storage}; the server cannot change "
            "it in place"
        )
    if not changed:
        return TopologyChange("object_store", spec.bucket, "unchanged")
    if owner is not None:
        return _differs("object_store", spec.bucket, owner, changed)
    with translated(f"update object store {spec.bucket}"):
        await js.update_stream(have.evolve(**wanted))
    log.info("updated object store %s: %s", spec.bucket, ", ".join(changed))
    return TopologyChange("object_store", spec.bucket, "updated", ", ".join(changed))


async def apply_topology(
    bus: Bus, topology: Topology, *, role: str | None = None
) -> list[TopologyChange]:
    """Create or update every stream, consumer and bucket of `topology` (in that order:
    consumers need their streams); with `role`, only what that role owns, the rest being
    created when missing or compared (module docstring). Returns what was done to each
    (another role's consumers are not listed)."""

    def other_owner(owner: str | None) -> str | None:
        """The owner when it is not `role` (None: this service may change it)."""
        if role is None or owner == role:
            return None
        return owner or "unknown owner"

    changes = [
        await _apply_stream(bus, spec, other_owner(stream_owner(topology, spec.name)))
        for spec in topology.streams
    ]
    changes += [
        await _apply_consumer(bus, spec)
        for spec in topology.consumers
        if other_owner(CONSUMER_OWNERS.get(spec.durable)) is None
    ]
    changes += [
        await _apply_object_store(bus, spec, other_owner(BUCKET_OWNER))
        for spec in topology.object_stores
    ]
    return changes


async def delete_topology(bus: Bus, topology: Topology) -> None:
    """Delete every stream (consumers go with them) and bucket of `topology`; missing ones
    are skipped. For tests and `eldr dev` resets; destroys data."""
    names = [spec.name for spec in topology.streams]
    names += [spec.stream_name for spec in topology.object_stores]
    for name in names:
        try:
            with translated(f"delete stream {name}"):
                await bus._js.delete_stream(name)
        except NotFoundError:
            continue
