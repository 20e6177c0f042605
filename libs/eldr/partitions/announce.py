"""Announcing a stored partition version to the routers: its blob goes to the object store
as `v{version}`, then a `PartitionAnnouncement` naming it to `{ns}.partition.active`.

The one way a version is announced: the trainer (after a refit, and for a version a crash
left unannounced), `eldr partitions activate` and the tests all call `announce_version`.
The blob's bytes, exactly as the database stores them (never re-encoded: a version stored
as PartitionBlob v1 keeps its v1 bytes and hash), are put first and their hash checked
against the database's, so an announcement never names an object that is missing or
differs from the stored version.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, TypeVar

from eldr.wire import Message, PartitionAnnouncement

if TYPE_CHECKING:
    from eldr.bus import ObjectRef, PublishAck
    from eldr.partitions.writer import StoredVersion

M = TypeVar("M", bound=Message)


class PartitionBus(Protocol):
    """The part of `eldr.bus.Bus` that announcing a version needs."""

    async def object_put_bytes(self, bucket: str, name: str, data: bytes) -> ObjectRef: ...

    async def js_publish(
        self,
        subject: str,
        message: Message,
        *,
        msg_id: str | None = None,
        timeout_s: float | None = None,
    ) -> PublishAck: ...

    async def get_last(self, stream: str, subject: str, message_type: type[M]) -> M | None: ...


class BlobMismatchError(RuntimeError):
    """The object store holds other bytes than the database's hash says: encoding is
    deterministic, so this is a bug, and every router would refuse the blob."""


def object_name(version: int) -> str:
    """The blob's name in bucket `{ns}-partitions`."""
    return f"v{version}"


async def announce_version(
    bus: PartitionBus,
    stored: StoredVersion,
    *,
    bucket: str,
    subject: str,
    created_ts_s: float,
    msg_id: str | None = None,
    timeout_s: float | None = None,
) -> PublishAck:
    """Put `stored`'s blob in `bucket`, then announce it on `subject`.

    `msg_id` deduplicates on the server: the same id within the duplicate window is
    dropped (pass a unique one to re-announce a version). Raises BlobMismatchError, or
    the bus's errors.
    """
    blob = stored.blob
    name = object_name(stored.version)
    ref = await bus.object_put_bytes(bucket, name, stored.blob_bytes)
    if ref.sha256 != stored.sha256:
        raise BlobMismatchError(
            f"object {name} hashes to {ref.sha256}, the database has {stored.sha256}"
        )
    announcement = PartitionAnnouncement(
        version=stored.version,
        model=blob.model,
        object_name=name,
        sha256=stored.sha256,
        created_ts_s=created_ts_s,
        k=len(blob.workers),
        dim=blob.centroids.shape[1],
        workers=list(blob.workers),
    )
    return await bus.js_publish(subject, announcement, msg_id=msg_id, timeout_s=timeout_s)
