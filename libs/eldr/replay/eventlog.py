"""Recorded routing events in memory (`EventLog`) and in an export file.

An event log is everything a replay needs to rebuild a router's inputs at any moment of a
window of traffic: the routers' `Decision`s (each carries the loads it saw, its signature,
its partition version and the seed of its draws), the decode workers' `LoadReport`s, the
trainer's `PartitionAnnouncement`s with the `PartitionBlob`s they name, and the workers'
`DecodeSummary`s and the gateways' `RequestFinished` events (when each request ended). It
does not care where the events came from: JetStream
(`eldr.replay.source.read_events`) or a file (`read_event_file`). Events are ordered by their
own timestamps (the producer's clock: `ts_s`, or `created_ts_s` for announcements), which
survive an export and an import, unlike the time JetStream stored them.

File format, version 2 (`write_event_file` / `read_event_file`; version 1 files, which
have no FINISHED records, still read): the 8-byte magic
`ELDRLOG\\n`, then records. Each record is a little-endian uint32 payload length, the
CRC-32 of the payload (uint32 LE), and the payload: one MessagePack map tagged by its
`record` field. Record 0 is the `FileHeader` (format version, namespace, selection, counts,
number of records that follow); then one `BlobRecord` per partition blob (its bytes as
stored in the bucket, which a read keeps in `EventLog.blob_data`), then one
`EventRecord` per event in time order. An event record carries the wire bytes of its
message (`eldr.wire.encode`), so every message is validated by `eldr.wire.decode` on read.
A file whose name ends in `.gz` is gzip-compressed as a whole; byte offsets in errors are
then offsets in the uncompressed stream. Any damage is reported as an `EventFileError`
naming the first bad record: its index (the header is record 0) and its byte offset.
"""

from __future__ import annotations

import bisect
import gzip
import hashlib
import os
import struct
import time
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Annotated, cast

import msgspec

from eldr import __version__
from eldr.bus.topology import DECISIONS, FINISHED, LOAD, PARTITIONS, PROFILES
from eldr.wire import (
    Decision,
    DecodeSummary,
    LoadReport,
    Message,
    PartitionAnnouncement,
    PartitionBlob,
    RequestFinished,
    WireError,
    decode,
    encode,
)

EventMessage = Decision | LoadReport | DecodeSummary | PartitionAnnouncement | RequestFinished

STREAMS: tuple[str, ...] = (PARTITIONS, LOAD, DECISIONS, PROFILES, FINISHED)
"""Streams an event log reads, in the order events of equal timestamps are sorted: a
partition or load change at the same instant as a decision is taken to precede it."""

MESSAGE_TYPES: dict[str, type[Message]] = {
    PARTITIONS: PartitionAnnouncement,
    LOAD: LoadReport,
    DECISIONS: Decision,
    PROFILES: DecodeSummary,
    FINISHED: RequestFinished,
}
"""The message type each stream records."""

KIND_NAMES = {
    PARTITIONS: "partition_announcements",
    LOAD: "load_reports",
    DECISIONS: "decisions",
    PROFILES: "decode_profiles",
    FINISHED: "finish_events",
}

MAGIC = b"ELDRLOG\n"
FORMAT_VERSION = 2
MAX_RECORD_BYTES = 1 << 30
"""Largest record a reader accepts (a partition blob with many sub-centroids is the
largest thing a record holds)."""
_PREFIX = struct.Struct("<II")
_GZIP_MAGIC = b"\x1f\x8b"


def event_time(message: EventMessage) -> float:
    """The producer's timestamp of a message (Unix seconds)."""
    if isinstance(message, PartitionAnnouncement):
        return message.created_ts_s
    return message.ts_s


@dataclass(frozen=True)
class Selection:
    """Which decisions a log was read for (and so which other events came with them).

    start_seq / end_seq: DECISIONS stream sequence numbers, inclusive. since_s / until_s:
    the time JetStream stored the decision, Unix seconds. last: the newest `last` decisions.
    All None: every decision the stream holds.
    """

    since_s: float | None = None
    until_s: float | None = None
    start_seq: int | None = None
    end_seq: int | None = None
    last: int | None = None

    def __post_init__(self) -> None:
        if self.last is not None and (self.last < 1 or self.start_seq is not None):
            raise ValueError("last must be >= 1 and cannot be combined with start_seq")
        for name in ("start_seq", "end_seq"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.start_seq and self.end_seq and self.end_seq < self.start_seq:
            raise ValueError("end_seq is before start_seq")
        if self.since_s is not None and self.until_s is not None and self.until_s < self.since_s:
            raise ValueError("until is before since")

    def describe(self) -> str:
        parts = []
        if self.last is not None:
            parts.append(f"the last {self.last} decisions")
        if self.start_seq is not None or self.end_seq is not None:
            parts.append(f"DECISIONS seq {self.start_seq or 1}..{self.end_seq or 'end'}")
        if self.since_s is not None or self.until_s is not None:
            since = "start" if self.since_s is None else format_ts(self.since_s)
            until = "now" if self.until_s is None else format_ts(self.until_s)
            parts.append(f"stored {since} to {until}")
        return ", ".join(parts) or "every recorded decision"


def format_ts(ts_s: float) -> str:
    """Unix seconds as UTC ISO 8601 with milliseconds."""
    seconds = int(ts_s // 1)
    ms = round((ts_s - seconds) * 1000)
    if ms == 1000:
        seconds, ms = seconds + 1, 0
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{ms:03d}Z"


@dataclass(frozen=True)
class Event:
    """One recorded message and where it was recorded."""

    ts_s: float
    """The message's own timestamp (`event_time`)."""
    stream: str
    """Stream suffix: DECISIONS, LOAD, PROFILES, FINISHED or PARTITIONS."""
    seq: int
    """Sequence in the stream it was read from (0 when unknown)."""
    stored_ts_s: float | None
    """When JetStream stored it (None when unknown)."""
    subject: str
    message: EventMessage

    @classmethod
    def of(
        cls,
        message: EventMessage,
        *,
        stream: str,
        seq: int = 0,
        stored_ts_s: float | None = None,
        subject: str = "",
    ) -> Event:
        if not isinstance(message, MESSAGE_TYPES[stream]):
            raise ValueError(f"a {type(message).__name__} is not recorded in {stream}")
        return cls(event_time(message), stream, seq, stored_ts_s, subject, message)


def _sort_key(event: Event) -> tuple[float, int, int]:
    return (event.ts_s, STREAMS.index(event.stream), event.seq)


@dataclass
class EventLog:
    """A time-ordered window of recorded events plus the partition blobs they reference.

    `blobs` maps object names (as in `PartitionAnnouncement.object_name`) to blobs;
    `blob_data` holds the bytes they were stored as, where known (`add_blob`).
    `notes` says what could not be read (expired load reports, missing blobs, ...).
    """

    namespace: str
    events: list[Event]
    blobs: dict[str, PartitionBlob] = field(default_factory=dict)
    selection: Selection = field(default_factory=Selection)
    notes: list[str] = field(default_factory=list)
    created_ts_s: float = field(default_factory=time.time)
    source: str = ""
    """Where the log came from, for reports ("nats://... namespace x", a file path)."""
    blob_data: dict[str, bytes] = field(default_factory=dict)
    """The exact bytes of the blobs read from a file or a bucket, by object name: a file
    and an import store these, so each blob keeps the SHA-256 its announcements name (a
    blob stored with an older schema, re-encoded, would not). Blobs without an entry
    (built in memory) are encoded."""

    def __post_init__(self) -> None:
        if stray := sorted(set(self.blob_data) - set(self.blobs)):
            raise ValueError(f"stored bytes of blobs the log does not hold: {stray}")
        self.events = sorted(self.events, key=_sort_key)
        records = [e.message for e in self.events if isinstance(e.message, Decision)]
        self._by_request: dict[str, Decision] = {}
        for d in records:
            self._by_request.setdefault(d.request_id, d)  # first write wins, as on the bus
        # Expired records assigned no worker: nothing to replay, explain says so.
        self._decisions = [d for d in records if d.assigned]
        self._expired = [d for d in records if not d.assigned]
        self._summaries: dict[str, DecodeSummary] = {}
        self._finishes: dict[str, RequestFinished] = {}
        for e in self.events:
            if isinstance(e.message, DecodeSummary):
                self._summaries[e.message.request_id] = e.message
            elif isinstance(e.message, RequestFinished) and e.message.reason != "moved":
                self._finishes.setdefault(e.message.request_id, e.message)
        self._announcements = [
            e.message for e in self.events if isinstance(e.message, PartitionAnnouncement)
        ]
        self._announcement_times = [a.created_ts_s for a in self._announcements]

    def add_blob(self, name: str, blob: PartitionBlob, data: bytes | None = None) -> None:
        """Hold `blob` as object `name`, with `data`, the bytes it was stored as (None: a
        blob built in memory, encoded when stored)."""
        self.blobs[name] = blob
        if data is None:
            self.blob_data.pop(name, None)
        else:
            self.blob_data[name] = data

    def blob_bytes(self, name: str) -> bytes:
        """The bytes to store blob `name` as: those it was read as, else its encoding."""
        data = self.blob_data.get(name)
        return encode(self.blobs[name]) if data is None else data

    # --- queries -----------------------------------------------------------------------

    @property
    def decisions(self) -> list[Decision]:
        """Every decision that assigned a worker, in time order."""
        return self._decisions

    @property
    def expired(self) -> list[Decision]:
        """The expired records (taken after the requester's deadline, no worker), in time
        order: part of the record, not replayed."""
        return self._expired

    def decision(self, request_id: str) -> Decision | None:
        """The request's record (an assignment, or an expired record), if any."""
        return self._by_request.get(request_id)

    @property
    def summaries(self) -> dict[str, DecodeSummary]:
        """Decode summaries by request id."""
        return self._summaries

    @property
    def finishes(self) -> dict[str, RequestFinished]:
        """Each request's final finish event (not "moved") by request id."""
        return self._finishes

    @property
    def announcements(self) -> list[PartitionAnnouncement]:
        return self._announcements

    @property
    def load_reports(self) -> list[LoadReport]:
        return [e.message for e in self.events if isinstance(e.message, LoadReport)]

    def counts(self) -> dict[str, int]:
        by_stream = Counter(e.stream for e in self.events)
        out = {KIND_NAMES[s]: by_stream.get(s, 0) for s in STREAMS}
        out["partition_blobs"] = len(self.blobs)
        return out

    def span_s(self) -> tuple[float, float] | None:
        """Time of the first and the last decision."""
        if not self._decisions:
            return None
        return self._decisions[0].ts_s, self._decisions[-1].ts_s

    def partition_blob(self, version: int) -> PartitionBlob | None:
        """The blob of partition `version`, if the log holds it."""
        for ann in reversed(self._announcements):
            if ann.version == version and ann.object_name in self.blobs:
                blob = self.blobs[ann.object_name]
                if blob.version == version:
                    return blob
        for blob in self.blobs.values():
            if blob.version == version:
                return blob
        return None

    def version_in_force(self, ts_s: float) -> int | None:
        """Version of the newest partition announced at or before `ts_s`."""
        i = bisect.bisect_right(self._announcement_times, ts_s)
        return self._announcements[i - 1].version if i else None


# --- the file format ----------------------------------------------------------------------


class EventFileError(ValueError):
    """An export file is not a valid event log; names the first bad record."""

    def __init__(self, path: str, message: str, record: int | None, offset: int | None) -> None:
        where = "" if record is None else f"record {record} at byte offset {offset}: "
        super().__init__(f"{path}: {where}{message}")
        self.path = path
        self.record = record
        self.offset = offset


class SelectionRecord(msgspec.Struct, frozen=True):
    since_s: float | None = None
    until_s: float | None = None
    start_seq: int | None = None
    end_seq: int | None = None
    last: int | None = None


class FileHeader(msgspec.Struct, frozen=True, tag_field="record", tag="header"):
    format_version: Annotated[int, msgspec.Meta(ge=1)]
    namespace: str
    created_ts_s: float
    producer: str
    """What wrote the file, e.g. "eldr 0.1.0"."""
    selection: SelectionRecord
    counts: dict[str, int]
    records: Annotated[int, msgspec.Meta(ge=0)]
    """Records after this header."""
    notes: list[str] = msgspec.field(default_factory=list)
    source: str = ""


class BlobRecord(msgspec.Struct, frozen=True, tag_field="record", tag="blob"):
    name: str
    sha256: str
    data: bytes
    """The encoded `PartitionBlob`."""


class EventRecord(msgspec.Struct, frozen=True, tag_field="record", tag="event"):
    stream: str
    seq: int
    stored_ts_s: float | None
    subject: str
    data: bytes
    """The encoded wire message (`eldr.wire.encode`)."""


_RECORD_DECODER: msgspec.msgpack.Decoder[FileHeader | BlobRecord | EventRecord] = (
    msgspec.msgpack.Decoder(FileHeader | BlobRecord | EventRecord)
)
_ENCODER = msgspec.msgpack.Encoder()


def _frame(payload: bytes) -> bytes:
    return _PREFIX.pack(len(payload), zlib.crc32(payload)) + payload


def _records(log: EventLog) -> Iterator[bytes]:
    names = sorted(log.blobs)
    n_records = len(names) + len(log.events)
    sel = log.selection
    yield _ENCODER.encode(
        FileHeader(
            format_version=FORMAT_VERSION,
            namespace=log.namespace,
            created_ts_s=log.created_ts_s,
            producer=f"eldr {__version__}",
            selection=SelectionRecord(
                since_s=sel.since_s,
                until_s=sel.until_s,
                start_seq=sel.start_seq,
                end_seq=sel.end_seq,
                last=sel.last,
            ),
            counts=log.counts(),
            records=n_records,
            notes=list(log.notes),
            source=log.source,
        )
    )
    for name in names:
        data = log.blob_bytes(name)
        yield _ENCODER.encode(
            BlobRecord(name=name, sha256=hashlib.sha256(data).hexdigest(), data=data)
        )
    for e in log.events:
        yield _ENCODER.encode(
            EventRecord(
                stream=e.stream,
                seq=e.seq,
                stored_ts_s=e.stored_ts_s,
                subject=e.subject,
                data=encode(e.message),
            )
        )


def _open_write(path: Path, compress: bool) -> IO[bytes]:
    if compress:
        return cast(IO[bytes], gzip.open(path, "wb", compresslevel=6))
    return path.open("wb")


def write_event_file(log: EventLog, path: str | os.PathLike[str]) -> int:
    """Write `log` to `path` (gzip when the name ends in .gz), atomically; returns the
    number of bytes written (uncompressed)."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    size = 0
    try:
        with _open_write(tmp, compress=target.name.endswith(".gz")) as out:
            out.write(MAGIC)
            size += len(MAGIC)
            for payload in _records(log):
                if len(payload) > MAX_RECORD_BYTES:
                    raise ValueError(f"a record of {len(payload)} bytes exceeds the format limit")
                framed = _frame(payload)
                out.write(framed)
                size += len(framed)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return size


class _Reader:
    """Sequential reads that know their offset and turn gzip failures into errors."""

    def __init__(self, stream: IO[bytes], path: str) -> None:
        self._stream = stream
        self._path = path
        self.offset = 0

    def read(self, n: int) -> bytes:
        try:
            data = self._stream.read(n)
        except EOFError:
            data = b""  # a truncated gzip stream: what was decompressed so far is all
        except (OSError, zlib.error) as exc:
            raise EventFileError(
                self._path, f"the compressed stream is corrupted ({exc})", None, None
            ) from exc
        self.offset += len(data)
        return data


def _read_records(reader: _Reader, path: str) -> Iterator[tuple[int, int, bytes | None]]:
    """(index, offset, payload) per record; payload None at a clean end of file."""
    index = 0
    while True:
        offset = reader.offset
        prefix = reader.read(_PREFIX.size)
        if not prefix:
            yield index, offset, None
            return
        if len(prefix) < _PREFIX.size:
            raise EventFileError(
                path,
                f"truncated: the file ends inside the record's {_PREFIX.size}-byte length "
                f"and checksum prefix ({len(prefix)} bytes left)",
                index,
                offset,
            )
        length, crc = _PREFIX.unpack(prefix)
        if length > MAX_RECORD_BYTES:
            raise EventFileError(
                path,
                f"corrupted: implausible record length {length} (limit {MAX_RECORD_BYTES})",
                index,
                offset,
            )
        payload = reader.read(length)
        if len(payload) < length:
            raise EventFileError(
                path,
                f"truncated: the record needs {length} bytes, the file has {len(payload)} left",
                index,
                offset,
            )
        if zlib.crc32(payload) != crc:
            raise EventFileError(
                path,
                f"corrupted: checksum mismatch (stored {crc:#010x}, computed "
                f"{zlib.crc32(payload):#010x})",
                index,
                offset,
            )
        yield index, offset, payload
        index += 1


def _open_read(path: Path) -> IO[bytes]:
    raw = path.open("rb")
    head = raw.read(2)
    raw.seek(0)
    if head == _GZIP_MAGIC:
        return cast(IO[bytes], gzip.GzipFile(fileobj=raw, mode="rb"))
    return raw


def read_event_file(path: str | os.PathLike[str]) -> EventLog:
    """Read and validate an export file; raises EventFileError naming the first bad record
    (OSError when the file cannot be opened)."""
    name = str(path)
    with _open_read(Path(path)) as stream:
        reader = _Reader(stream, name)
        magic = reader.read(len(MAGIC))
        if magic != MAGIC:
            raise EventFileError(
                name, f"not an ELDR event file (starts with {magic[:8]!r})", None, None
            )
        header: FileHeader | None = None
        events: list[Event] = []
        blobs: dict[str, PartitionBlob] = {}
        blob_data: dict[str, bytes] = {}
        for index, offset, payload in _read_records(reader, name):
            if payload is None:
                if header is None:
                    raise EventFileError(
                        name, "truncated: the header record is missing", index, offset
                    )
                if index - 1 < header.records:
                    raise EventFileError(
                        name,
                        f"truncated: the file ends after record {index - 1} but the header "
                        f"announces {header.records} records after it",
                        index,
                        offset,
                    )
                break
            if header is not None and index > header.records:
                raise EventFileError(
                    name,
                    f"unexpected data after the last of the {header.records} records the "
                    "header announces",
                    index,
                    offset,
                )
            record = _decode_record(payload, name, index, offset)
            if index == 0:
                if not isinstance(record, FileHeader):
                    raise EventFileError(name, "the first record is not a header", index, offset)
                if record.format_version > FORMAT_VERSION:
                    raise EventFileError(
                        name,
                        f"format version {record.format_version} is newer than this eldr "
                        f"reads ({FORMAT_VERSION}): upgrade eldr",
                        index,
                        offset,
                    )
                header = record
            elif isinstance(record, FileHeader):
                raise EventFileError(name, "a second header record", index, offset)
            elif isinstance(record, BlobRecord):
                blobs[record.name] = _decode_blob(record, name, index, offset)
                blob_data[record.name] = record.data
            else:
                events.append(_decode_event(record, name, index, offset))
    assert header is not None
    sel = header.selection
    return EventLog(
        namespace=header.namespace,
        events=events,
        blobs=blobs,
        selection=Selection(
            since_s=sel.since_s,
            until_s=sel.until_s,
            start_seq=sel.start_seq,
            end_seq=sel.end_seq,
            last=sel.last,
        ),
        notes=list(header.notes),
        created_ts_s=header.created_ts_s,
        source=name,
        blob_data=blob_data,
    )


def _decode_record(
    payload: bytes, path: str, index: int, offset: int
) -> FileHeader | BlobRecord | EventRecord:
    try:
        return _RECORD_DECODER.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise EventFileError(path, f"not a valid record: {exc}", index, offset) from exc


def _decode_blob(record: BlobRecord, path: str, index: int, offset: int) -> PartitionBlob:
    if hashlib.sha256(record.data).hexdigest() != record.sha256:
        raise EventFileError(
            path, f"partition blob {record.name!r} does not match its sha256", index, offset
        )
    try:
        return decode(record.data, PartitionBlob, MAX_RECORD_BYTES)
    except WireError as exc:
        raise EventFileError(path, f"partition blob {record.name!r}: {exc}", index, offset) from exc


def _decode_event(record: EventRecord, path: str, index: int, offset: int) -> Event:
    message_type = MESSAGE_TYPES.get(record.stream)
    if message_type is None:
        raise EventFileError(path, f"unknown stream {record.stream!r}", index, offset)
    try:
        message = decode(record.data, message_type, MAX_RECORD_BYTES)
    except WireError as exc:
        raise EventFileError(
            path, f"{record.stream} seq {record.seq}: {exc}", index, offset
        ) from exc
    assert isinstance(
        message,
        Decision | LoadReport | DecodeSummary | PartitionAnnouncement | RequestFinished,
    )
    return Event.of(
        message,
        stream=record.stream,
        seq=record.seq,
        stored_ts_s=record.stored_ts_s,
        subject=record.subject,
    )


def record_offsets(path: str | os.PathLike[str]) -> list[int]:
    """Byte offset of every record of a valid, uncompressed file (tests, tooling)."""
    offsets = []
    with Path(path).open("rb") as stream:
        reader = _Reader(stream, str(path))
        reader.read(len(MAGIC))
        for _, offset, payload in _read_records(reader, str(path)):
            if payload is None:
                break
            offsets.append(offset)
    return offsets
