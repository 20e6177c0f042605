"""The object store: typed messages stored as objects (partitions), read back with a
size limit before the download and an optional SHA-256 check; or, for a recorded object
that must keep its hash (an import, an export), its exact bytes."""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from typing import Any, TypeVar

from eldr.bus.connection import Connection, translated
from eldr.wire import Message, WireError, decode, encode

M = TypeVar("M", bound=Message)


@dataclass(frozen=True)
class ObjectRef:
    bucket: str
    name: str
    size_bytes: int
    sha256: str
    """Hex SHA-256 of the stored bytes (what `PartitionAnnouncement.sha256` carries)."""


class ObjectStore(Connection):
    """The bus's object store buckets."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._object_stores: dict[str, Any] = {}

    async def _bucket(self, bucket: str) -> Any:
        store = self._object_stores.get(bucket)
        if store is None:
            with translated(f"object store {bucket}"):
                store = await self._js.object_store(bucket)
            self._object_stores[bucket] = store
        return store

    async def object_put(self, bucket: str, name: str, message: Message) -> ObjectRef:
        """Store `message` as object `name` (replacing any previous one)."""
        return await self.object_put_bytes(bucket, name, encode(message))

    async def object_put_bytes(self, bucket: str, name: str, data: bytes) -> ObjectRef:
        """Store `data`, a message's bytes exactly as recorded, as object `name` (replacing
        any previous one): a recorded blob keeps the SHA-256 its announcement names, which
        re-encoding it with a newer schema would change."""
        store = await self._bucket(bucket)
        with translated(f"put object {bucket}/{name}"):
            await store.put(name, data)
        return ObjectRef(
            bucket=bucket,
            name=name,
            size_bytes=len(data),
            sha256=hashlib.sha256(data).hexdigest(),
        )

    async def object_get(
        self,
        bucket: str,
        name: str,
        message_type: type[M],
        *,
        expected_sha256: str | None = None,
    ) -> M:
        """Read and decode object `name` (see `object_get_bytes`); raises WireError also if
        the bytes are not a valid `message_type`."""
        data = await self.object_get_bytes(bucket, name, expected_sha256=expected_sha256)
        return decode(data, message_type, self._settings.max_object_bytes)

    async def object_get_bytes(
        self, bucket: str, name: str, *, expected_sha256: str | None = None
    ) -> bytes:
        """The stored bytes of object `name`. Refuses objects over `max_object_bytes` before
        downloading them; raises NotFoundError, or WireError if the bytes do not match
        `expected_sha256`."""
        store = await self._bucket(bucket)
        limit = self._settings.max_object_bytes
        with translated(f"get object {bucket}/{name}"):
            info = await store.get_info(name)
            if (info.size or 0) > limit:
                raise WireError(f"object {bucket}/{name} has {info.size} bytes, limit {limit}")
            buffer = io.BytesIO()
            await store.get(name, writeinto=buffer)
        data = buffer.getvalue()
        if expected_sha256 is not None and hashlib.sha256(data).hexdigest() != expected_sha256:
            raise WireError(f"object {bucket}/{name} does not match sha256 {expected_sha256}")
        return data
