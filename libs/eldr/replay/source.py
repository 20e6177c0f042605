"""Read an `EventLog` from JetStream, and load one back into a namespace.

`read_events` reads a range of DECISIONS (by sequence, by the time JetStream stored them,
or the newest N) and then what a replay needs around it:

- LOAD: the load reports stored from `load_margin_s` before the first decision to the last
  one (LOAD keeps only minutes: older windows come without them, and the log says so);
- PROFILES and FINISHED: the decode summaries and the gateways' finish events of the
  window's requests, stored from `load_margin_s` before the first decision (an import
  stores events nearly at once, in any order) up to `summary_lag_s` after the last
  (decoding finishes after routing);
- PARTITIONS: every announcement the stream keeps, and from bucket `{ns}-partitions` the
  blobs of the versions the decisions used, the versions announced during the window and
  the one in force when it began, with the bytes they are stored as (an export writes
  those, not a re-encoding).

Reading is read-only: nothing is published (the reads are ephemeral ordered consumers,
deleted when they finish). A stored record that does not decode is not dead-lettered but
left out and counted in `UndecodableRecords` (per stream: how many, the first sequence and
its error), which `read_events` also turns into a note of the log, so an export says what
it lacks.

`import_events` publishes a log into the bus's namespace (streams and bucket created if
needed): blobs first (the bytes they were recorded as, so each still hashes as its
announcement says), then events, each on the subject its message belongs to in that
namespace. Import into a namespace no services run in: routers there would act on the
load reports and partition announcements.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from eldr.bus import (
    AlreadyExists,
    Bus,
    BusError,
    Delivery,
    NotFoundError,
    Topology,
    Undecodable,
    apply_topology,
    build_topology,
    stream_name,
)
from eldr.bus.topology import DECISIONS, FINISHED, LOAD, PARTITIONS, PROFILES
from eldr.replay.eventlog import MESSAGE_TYPES, STREAMS, Event, EventLog, EventMessage, Selection
from eldr.settings import RetentionSettings
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
)

log = logging.getLogger(__name__)

DEFAULT_LOAD_MARGIN_S = 5.0
"""Load reports read before the first decision (a router forgets a worker silent for
`stale_after_s`, 3 s by default)."""
DEFAULT_SUMMARY_LAG_S = 900.0
DEFAULT_TIMEOUT_S = 300.0
IMPORT_CONCURRENCY = 256


class SourceError(RuntimeError):
    """The namespace cannot be read (no such stream, timeout); says what to check."""


@dataclass
class UndecodableStream:
    """Records of one stream that did not decode."""

    count: int = 0
    first_seq: int = 0
    first_subject: str = ""
    first_error: str = ""


@dataclass
class UndecodableRecords:
    """Stored records a read left out because they do not decode, by stream name."""

    streams: dict[str, UndecodableStream] = field(default_factory=dict)

    def add(self, record: Undecodable) -> None:
        seen = self.streams.get(record.stream)
        if seen is None:
            seen = self.streams[record.stream] = UndecodableStream(
                first_seq=record.stream_seq,
                first_subject=record.subject,
                first_error=record.error,
            )
        seen.count += 1

    @property
    def total(self) -> int:
        return sum(s.count for s in self.streams.values())

    def lines(self) -> list[str]:
        """One line per stream: `DECISIONS: 200 undecodable, first at seq 17 (subject): error`."""
        return [
            f"{stream}: {s.count:,} undecodable record(s) left out, the first at seq "
            f"{s.first_seq} ({s.first_subject}): {s.first_error}"
            for stream, s in sorted(self.streams.items())
        ]


async def _read_stream(
    bus: Bus,
    suffix: str,
    subject_filter: str,
    *,
    start_seq: int | None = None,
    start_time_s: float | None = None,
    stop: Callable[[EventMessage, Delivery], bool] = lambda _m, _d: False,
    keep: Callable[[EventMessage, Delivery], bool] = lambda _m, _d: True,
    done: Callable[[], bool] = lambda: False,
    undecodable: UndecodableRecords | None = None,
    counts: Callable[[Undecodable], bool] = lambda _u: True,
    timeout_s: float,
) -> list[Event]:
    """Events of one stream from a start point until `stop` says so or the stream's end
    (as it was when the read began). Records that do not decode are counted in
    `undecodable` (a throwaway tally if None) when `counts` says they belong to the read,
    never dead-lettered."""
    stream = stream_name(bus.subjects.namespace, suffix)
    message_type = MESSAGE_TYPES[suffix]
    events: list[Event] = []
    finished = asyncio.Event()
    tally = undecodable if undecodable is not None else UndecodableRecords()

    def on_undecodable(record: Undecodable) -> None:
        if not finished.is_set() and counts(record):
            tally.add(record)

    async def on(message: Message, delivery: Delivery) -> None:
        if finished.is_set():
            return
        assert isinstance(
            message,
            Decision | LoadReport | DecodeSummary | PartitionAnnouncement | RequestFinished,
        )
        if stop(message, delivery):
            finished.set()
            return
        if keep(message, delivery):
            events.append(
                Event.of(
                    message,
                    stream=suffix,
                    seq=delivery.stream_seq or 0,
                    stored_ts_s=delivery.timestamp_s,
                    subject=delivery.subject,
                )
            )
            if done():
                finished.set()

    try:
        reader = await bus.read_back(
            stream,
            subject_filter,
            message_type,
            on,
            start_seq=start_seq,
            start_time_s=start_time_s,
            stop_at_end=True,
            on_undecodable=on_undecodable,
        )
    except NotFoundError as exc:
        raise SourceError(
            f"namespace {bus.subjects.namespace!r} has no stream {stream} (is ELDR_NAMESPACE "
            f"right? are the services running there?): {exc}"
        ) from exc
    ended = asyncio.create_task(reader.finished.wait())
    stopped = asyncio.create_task(finished.wait())
    try:
        await asyncio.wait({ended, stopped}, timeout=timeout_s, return_when="FIRST_COMPLETED")
    finally:
        ended.cancel()
        stopped.cancel()
        await reader.stop()
    if not (reader.finished.is_set() or finished.is_set()):
        raise SourceError(f"reading {stream} did not finish within {timeout_s:g} s")
    return events


async def read_decisions(
    bus: Bus,
    selection: Selection,
    timeout_s: float,
    undecodable: UndecodableRecords | None = None,
) -> list[Event]:
    """The decisions `selection` names, in stream order (undecodable ones counted in
    `undecodable`)."""
    start_seq = selection.start_seq
    if selection.last is not None:
        try:
            state = await bus.stream_state(stream_name(bus.subjects.namespace, DECISIONS))
        except NotFoundError as exc:
            raise SourceError(
                f"namespace {bus.subjects.namespace!r} has no decisions stream: {exc}"
            ) from exc
        start_seq = max(1, state.last_seq - selection.last + 1)
    start_time = selection.since_s if start_seq is None else None

    def stop(_m: EventMessage, d: Delivery) -> bool:
        if selection.end_seq is not None and (d.stream_seq or 0) > selection.end_seq:
            return True
        return selection.until_s is not None and (d.timestamp_s or 0.0) > selection.until_s

    def keep(_m: EventMessage, d: Delivery) -> bool:
        return selection.since_s is None or (d.timestamp_s or 0.0) >= selection.since_s

    def in_window(u: Undecodable) -> bool:
        ts_s = u.timestamp_s or 0.0
        return not (
            (selection.end_seq is not None and u.stream_seq > selection.end_seq)
            or (selection.until_s is not None and ts_s > selection.until_s)
            or (selection.since_s is not None and ts_s < selection.since_s)
        )

    return await _read_stream(
        bus,
        DECISIONS,
        bus.subjects.decisions_all,
        start_seq=start_seq,
        start_time_s=start_time,
        stop=stop,
        keep=keep,
        undecodable=undecodable,
        counts=in_window,
        timeout_s=timeout_s,
    )


async def read_events(
    bus: Bus,
    selection: Selection,
    *,
    load_reports: bool = True,
    profiles: bool = True,
    load_margin_s: float = DEFAULT_LOAD_MARGIN_S,
    summary_lag_s: float = DEFAULT_SUMMARY_LAG_S,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    undecodable: UndecodableRecords | None = None,
) -> EventLog:
    """The decisions `selection` names and the events around them (see the module doc).
    Records that do not decode are left out, counted in `undecodable` and noted in the
    log."""
    ns = bus.subjects.namespace
    notes: list[str] = []
    skipped = undecodable if undecodable is not None else UndecodableRecords()
    decisions = await read_decisions(bus, selection, timeout_s, skipped)
    stored = [e.stored_ts_s for e in decisions if e.stored_ts_s is not None]
    t0 = min(stored) if stored else None
    t1 = max(stored) if stored else None
    events: list[Event] = list(decisions)
    announcements = await _read_stream(
        bus,
        PARTITIONS,
        bus.subjects.partition_active,
        undecodable=skipped,
        timeout_s=timeout_s,
    )
    events += announcements
    if t0 is not None and t1 is not None and load_reports:
        end = t1

        def past_window(_m: EventMessage, d: Delivery) -> bool:
            return (d.timestamp_s or 0.0) > end

        reports = await _read_stream(
            bus,
            LOAD,
            bus.subjects.load_all,
            start_time_s=t0 - load_margin_s,
            stop=past_window,
            undecodable=skipped,
            timeout_s=timeout_s,
        )
        if not reports:
            notes.append(
                "no load reports recorded for the window (LOAD keeps them for "
                "ELDR_LOAD_MAX_AGE_S, 600 s by default): replays use the loads recorded in "
                "each decision"
            )
        events += reports
    if t0 is not None and t1 is not None and profiles:
        wanted = {e.message.request_id for e in decisions if isinstance(e.message, Decision)}
        found: set[str] = set()
        horizon = t1 + summary_lag_s

        def past_horizon(_m: EventMessage, d: Delivery) -> bool:
            return (d.timestamp_s or 0.0) > horizon

        def ours(m: EventMessage, _d: Delivery) -> bool:
            if isinstance(m, DecodeSummary) and m.request_id in wanted:
                found.add(m.request_id)
                return True
            return False

        events += await _read_stream(
            bus,
            PROFILES,
            bus.subjects.profiles_all,
            start_time_s=t0 - load_margin_s,
            stop=past_horizon,
            keep=ours,
            done=lambda: len(found) == len(wanted),
            undecodable=skipped,
            timeout_s=timeout_s,
        )
        ended: set[str] = set()

        def ours_finished(m: EventMessage, _d: Delivery) -> bool:
            if isinstance(m, RequestFinished) and m.request_id in wanted:
                if m.reason != "moved":
                    ended.add(m.request_id)
                return True
            return False

        events += await _read_stream(
            bus,
            FINISHED,
            bus.subjects.finished_all,
            start_time_s=t0 - load_margin_s,
            stop=past_horizon,
            keep=ours_finished,
            done=lambda: len(ended) == len(wanted),
            undecodable=skipped,
            timeout_s=timeout_s,
        )
    notes += skipped.lines()
    event_log = EventLog(
        namespace=ns,
        events=events,
        selection=selection,
        notes=notes,
        source=f"{bus.settings.nats_url} namespace {ns}",
    )
    await _attach_blobs(bus, event_log)
    return event_log


async def _attach_blobs(bus: Bus, event_log: EventLog) -> None:
    """Fetch the partition blobs the log's decisions need into `event_log.blobs`."""
    versions = {d.partition_version for d in event_log.decisions if d.partition_version}
    span = event_log.span_s()
    if span is not None:
        first = event_log.version_in_force(span[0])
        if first is not None:
            versions.add(first)
        versions |= {
            a.version for a in event_log.announcements if span[0] <= a.created_ts_s <= span[1]
        }
    for version in sorted(versions):
        named = [a for a in event_log.announcements if a.version == version]
        name = named[-1].object_name if named else f"v{version}"
        sha = named[-1].sha256 if named else None
        stored = await fetch_stored_blob(bus, name, sha)
        if stored is None:
            event_log.notes.append(
                f"partition version {version}: blob {name!r} is not in bucket "
                f"{bus.subjects.namespace}-partitions: its decisions cannot be replayed"
            )
        else:
            event_log.add_blob(name, *stored)


async def fetch_partition_blob(
    bus: Bus, object_name: str, expected_sha256: str | None = None
) -> PartitionBlob | None:
    """A partition blob from the namespace's bucket; None when it is not there."""
    stored = await fetch_stored_blob(bus, object_name, expected_sha256)
    return None if stored is None else stored[0]


async def fetch_stored_blob(
    bus: Bus, object_name: str, expected_sha256: str | None = None
) -> tuple[PartitionBlob, bytes] | None:
    """A partition blob from the namespace's bucket and the bytes it is stored as; None
    when it is not there, or is unusable (logged)."""
    bucket = f"{bus.subjects.namespace}-partitions"
    try:
        data = await bus.object_get_bytes(bucket, object_name, expected_sha256=expected_sha256)
        return decode(data, PartitionBlob, bus.settings.max_object_bytes), data
    except NotFoundError:
        return None
    except WireError as exc:
        log.warning("partition blob %s/%s is unusable: %s", bucket, object_name, exc)
        return None


async def fetch_partition_version(bus: Bus, version: int, timeout_s: float) -> PartitionBlob | None:
    """Blob of partition `version`, found through its announcement (or as `v{version}`)."""
    announcements = await _read_stream(
        bus, PARTITIONS, bus.subjects.partition_active, timeout_s=timeout_s
    )
    named = [
        e.message
        for e in announcements
        if isinstance(e.message, PartitionAnnouncement) and e.message.version == version
    ]
    if named:
        return await fetch_partition_blob(bus, named[-1].object_name, named[-1].sha256)
    return await fetch_partition_blob(bus, f"v{version}")


async def fetch_decision(bus: Bus, request_id: str) -> Decision | None:
    """The committed decision for `request_id` (a direct get by subject); None if none."""
    stream = stream_name(bus.subjects.namespace, DECISIONS)
    try:
        return await bus.get_last(stream, bus.subjects.decision(request_id), Decision)
    except NotFoundError as exc:
        raise SourceError(
            f"namespace {bus.subjects.namespace!r} has no stream {stream}: {exc}"
        ) from exc


async def fetch_summary(bus: Bus, decision: Decision, timeout_s: float) -> DecodeSummary | None:
    """The decode summary of a decided request, searched on its worker's subject from the
    decision's time on (profiles are not indexed by request id)."""
    found: list[DecodeSummary] = []
    horizon = decision.ts_s + DEFAULT_SUMMARY_LAG_S

    def too_late(_m: EventMessage, d: Delivery) -> bool:
        return (d.timestamp_s or 0.0) > horizon

    def ours(m: EventMessage, _d: Delivery) -> bool:
        if isinstance(m, DecodeSummary) and m.request_id == decision.request_id:
            found.append(m)
            return True
        return False

    try:
        await _read_stream(
            bus,
            PROFILES,
            bus.subjects.profiles(decision.worker_id),
            start_time_s=decision.ts_s - 1.0,
            stop=too_late,
            keep=ours,
            done=lambda: bool(found),
            timeout_s=timeout_s,
        )
    except SourceError:
        return None
    return found[0] if found else None


@dataclass
class ImportSummary:
    published: dict[str, int] = field(default_factory=dict)
    already_present: dict[str, int] = field(default_factory=dict)
    blobs: int = 0
    topology: list[str] = field(default_factory=list)


async def import_events(
    bus: Bus, event_log: EventLog, retention: RetentionSettings | None = None
) -> ImportSummary:
    """Publish `event_log` into the bus's namespace (see the module doc)."""
    topology: Topology = build_topology(bus.subjects.namespace, retention or RetentionSettings())
    summary = ImportSummary()
    for change in await apply_topology(bus, topology):
        if change.action != "unchanged":
            summary.topology.append(f"{change.kind} {change.name} {change.action}")
    for name in sorted(event_log.blobs):
        await bus.object_put_bytes(topology.partitions_bucket, name, event_log.blob_bytes(name))
        summary.blobs += 1
    subjects = bus.subjects

    async def publish(event: Event) -> tuple[str, bool]:
        """(stream, published); False when the namespace already had the event."""
        m = event.message
        try:
            if isinstance(m, Decision):
                ack = await bus.js_publish(
                    subjects.decision(m.request_id), m, expected_last_subject_seq=0
                )
            elif isinstance(m, LoadReport):
                ack = await bus.js_publish(
                    subjects.load(m.worker_id),
                    m,
                    msg_id=f"load-{m.worker_id}-{m.incarnation}-{m.seq}",
                )
            elif isinstance(m, DecodeSummary):
                ack = await bus.js_publish(
                    subjects.profiles(m.worker_id), m, msg_id=f"profile-{m.request_id}"
                )
            elif isinstance(m, RequestFinished):
                ack = await bus.js_publish(
                    subjects.finished(m.gateway_id),
                    m,
                    msg_id=f"finished-{m.request_id}-{m.reason}-{m.moved_to or ''}",
                )
            else:
                ack = await bus.js_publish(
                    subjects.partition_active, m, msg_id=f"partition-{m.version}-{m.sha256[:16]}"
                )
        except AlreadyExists:
            return event.stream, False
        return event.stream, not ack.duplicate

    # Partition announcements first, one by one (routers and replays take the last one as
    # the active version), then the rest in time order, IMPORT_CONCURRENCY publishes in
    # flight at a time (a replay orders events by their own timestamps anyway).
    ordered = [e for e in event_log.events if e.stream == PARTITIONS]
    rest = [e for e in event_log.events if e.stream != PARTITIONS]
    results: list[tuple[str, bool]] = []
    try:
        for e in ordered:
            results.append(await publish(e))
        for i in range(0, len(rest), IMPORT_CONCURRENCY):
            chunk = rest[i : i + IMPORT_CONCURRENCY]
            results += await asyncio.gather(*(publish(e) for e in chunk))
    except BusError as exc:
        raise SourceError(f"import into {subjects.namespace!r} failed: {exc}") from exc
    for stream, published in results:
        target = summary.published if published else summary.already_present
        target[stream] = target.get(stream, 0) + 1
    for stream in STREAMS:
        summary.published.setdefault(stream, 0)
    return summary
