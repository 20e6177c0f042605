"""The event log and its export file: round trips, and damage reported at the first bad
record (index and byte offset)."""

from __future__ import annotations

import hashlib
import struct
import zlib
from pathlib import Path

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eldr.core.partition.partition import Partition
from eldr.core.signature.signature import Calibration
from eldr.partitions.codec import partition_to_blob
from eldr.replay.eventlog import (
    MAGIC,
    Event,
    EventFileError,
    EventLog,
    FileHeader,
    Selection,
    SelectionRecord,
    read_event_file,
    record_offsets,
    write_event_file,
)
from eldr.wire import (
    Decision,
    DecodeSummary,
    LoadReport,
    PartitionAnnouncement,
    PartitionBlob,
    RequestFinished,
    SparseCounts,
    decode,
    encode,
)

T0 = 1_700_000_000.0


def sample_log(n: int = 5) -> EventLog:
    cal = Calibration(2, 4, "raw", None, np.ones(2, dtype=bool))
    c = np.eye(2, 8, dtype=np.float32)
    blob = partition_to_blob(Partition(3, "m", cal, c, np.arange(2), ("a", "b")))
    sig = SparseCounts.from_dense(np.arange(8, dtype=np.uint32).reshape(2, 4))
    events = [
        Event.of(
            PartitionAnnouncement(
                version=3,
                model="m",
                object_name="v3",
                sha256="ab" * 32,
                created_ts_s=T0 - 5,
                k=2,
                dim=8,
                workers=["a", "b"],
            ),
            stream="PARTITIONS",
            seq=1,
        )
    ]
    for i in range(n):
        events.append(
            Event.of(
                Decision(
                    request_id=f"r{i}",
                    ts_s=T0 + i,
                    router_id="r1",
                    model="m",
                    worker_id="a",
                    policy="eldr",
                    params={"tau": 0.1, "load_measure": "requests", "widen_to": 2},
                    partition_version=3,
                    fallback=None,
                    scores=[("a", 0.9), ("b", 0.1)],
                    band=["a"],
                    loads=[("a", 1.0), ("b", 2.0)],
                    signature=sig,
                    missing_blocks=0,
                    decide_s=0.001,
                    rng_seed=i,
                    fleet=[("a", 1, 10), ("b", 2, 20)],
                    prompt_tokens=10,
                ),
                stream="DECISIONS",
                seq=i + 1,
                stored_ts_s=T0 + i + 0.001,
                subject=f"ns.decisions.{i}",
            )
        )
        events.append(
            Event.of(
                LoadReport(
                    worker_id="b",
                    incarnation="x",
                    seq=i,
                    ts_s=T0 + i + 0.5,
                    running=2,
                    waiting=0,
                    kv_tokens=20,
                    kv_capacity_tokens=1000,
                    admitted=[],
                ),
                stream="LOAD",
                seq=i + 1,
            )
        )
        events.append(
            Event.of(
                DecodeSummary(
                    request_id=f"r{i}", worker_id="a", ts_s=T0 + i + 3, tokens=5, counts=sig
                ),
                stream="PROFILES",
                seq=i + 1,
            )
        )
        events.append(
            Event.of(
                RequestFinished(
                    request_id=f"r{i}",
                    gateway_id="gw",
                    ts_s=T0 + i + 2.5,
                    reason="length",
                    worker_id="a",
                    output_tokens=6,
                ),
                stream="FINISHED",
                seq=i + 1,
            )
        )
    return EventLog("ns", events, {"v3": blob}, Selection(last=5), notes=["a note"])


@pytest.mark.parametrize("name", ["events.eldr", "events.eldr.gz"])
def test_a_log_survives_the_file(tmp_path: Path, name: str) -> None:
    log = sample_log()
    write_event_file(log, tmp_path / name)
    assert ((tmp_path / name).read_bytes()[:2] == b"\x1f\x8b") == name.endswith(".gz")
    back = read_event_file(tmp_path / name)
    assert [e.message for e in back.events] == [e.message for e in log.events]
    assert [(e.stream, e.seq, e.stored_ts_s, e.subject) for e in back.events] == [
        (e.stream, e.seq, e.stored_ts_s, e.subject) for e in log.events
    ]
    assert back.blobs == log.blobs
    assert (back.namespace, back.selection, back.notes) == ("ns", Selection(last=5), ["a note"])
    assert back.partition_blob(3) == log.blobs["v3"]
    assert back.counts() == log.counts()


GOLDEN_BLOB_V1 = Path(__file__).parents[1] / "wire" / "golden" / "partition_blob.v1.msgpack"


def v1_blob_log() -> tuple[EventLog, bytes]:
    """A log recorded before PartitionBlob v2: its blob is v1 bytes, its announcement
    names their SHA-256."""
    data = GOLDEN_BLOB_V1.read_bytes()
    blob = decode(data, PartitionBlob)
    announcement = PartitionAnnouncement(
        version=blob.version,
        model=blob.model,
        object_name="v4",
        sha256=hashlib.sha256(data).hexdigest(),
        created_ts_s=T0,
        k=len(blob.workers),
        dim=blob.centroids.shape[1],
        workers=blob.workers,
    )
    events = [Event.of(announcement, stream="PARTITIONS", seq=1)]
    return EventLog("ns", events, {"v4": blob}, blob_data={"v4": data}), data


@pytest.mark.parametrize("name", ["events.eldr", "events.eldr.gz"])
def test_a_recorded_v1_blob_keeps_its_bytes_through_read_and_write(
    tmp_path: Path, name: str
) -> None:
    log, data = v1_blob_log()
    assert encode(log.blobs["v4"]) != data  # a re-encoding would not hash as announced
    write_event_file(log, tmp_path / name)
    back = read_event_file(tmp_path / name)
    assert back.blob_data == {"v4": data}
    write_event_file(back, tmp_path / f"again.{name}")
    again = read_event_file(tmp_path / f"again.{name}")
    assert again.blob_bytes("v4") == data
    assert hashlib.sha256(again.blob_bytes("v4")).hexdigest() == again.announcements[0].sha256
    assert again.partition_blob(4) == log.blobs["v4"]


def test_a_blob_built_in_memory_is_encoded() -> None:
    log, data = v1_blob_log()
    rebuilt = msgspec.structs.replace(log.blobs["v4"], v=2)
    log.add_blob("v4", rebuilt)
    assert log.blob_bytes("v4") == encode(rebuilt) != data
    built = sample_log()
    assert built.blob_bytes("v3") == encode(built.blobs["v3"])


def test_stored_bytes_of_a_blob_the_log_lacks_are_refused() -> None:
    with pytest.raises(ValueError, match="does not hold"):
        EventLog("ns", [], blob_data={"v4": b"x"})


def test_finish_events_are_kept_per_request_moves_left_out() -> None:
    log = sample_log(2)
    moved = RequestFinished(
        request_id="r0", gateway_id="gw", ts_s=T0, reason="moved", worker_id="b", moved_to="a"
    )
    log = EventLog("ns", [*log.events, Event.of(moved, stream="FINISHED", seq=9)], log.blobs)
    assert {rid: f.reason for rid, f in log.finishes.items()} == {"r0": "length", "r1": "length"}
    assert log.counts()["finish_events"] == 3


def test_events_are_ordered_by_their_own_time() -> None:
    log = sample_log(3)
    times = [e.ts_s for e in log.events]
    assert times == sorted(times)
    assert [d.request_id for d in log.decisions] == ["r0", "r1", "r2"]


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, list[int]]:
    path = tmp_path_factory.mktemp("log") / "events.eldr"
    write_event_file(sample_log(), path)
    return path.read_bytes(), record_offsets(path)


def record_at(offsets: list[int], position: int) -> int:
    """Index of the record containing byte `position`."""
    return max(i for i, o in enumerate(offsets) if o <= position)


@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_corrupted_byte_is_reported_at_its_record(
    tmp_path: Path, written: tuple[bytes, list[int]], data: st.DataObject
) -> None:
    raw, offsets = written
    position = data.draw(st.integers(len(MAGIC), len(raw) - 1))
    flip = data.draw(st.integers(1, 255))
    damaged = bytearray(raw)
    damaged[position] ^= flip
    path = tmp_path / "damaged.eldr"
    path.write_bytes(bytes(damaged))
    with pytest.raises(EventFileError) as err:
        read_event_file(path)
    index = record_at(offsets, position)
    assert err.value.record == index
    assert err.value.offset == offsets[index]
    assert f"record {index} at byte offset {offsets[index]}" in str(err.value)


@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_truncated_file_is_reported_at_the_first_incomplete_record(
    tmp_path: Path, written: tuple[bytes, list[int]], data: st.DataObject
) -> None:
    raw, offsets = written
    length = data.draw(st.integers(len(MAGIC), len(raw) - 1))
    path = tmp_path / "short.eldr"
    path.write_bytes(raw[:length])
    with pytest.raises(EventFileError, match="truncated") as err:
        read_event_file(path)
    index = record_at(offsets, length) if length < len(raw) else len(offsets)
    if length in offsets:  # cut exactly between two records: the next one is missing
        index = offsets.index(length)
    assert err.value.record == index
    assert err.value.offset == (offsets[index] if index < len(offsets) else length)


def test_a_truncated_gzip_file_fails_clearly(tmp_path: Path) -> None:
    write_event_file(sample_log(), tmp_path / "events.eldr.gz")
    raw = (tmp_path / "events.eldr.gz").read_bytes()
    (tmp_path / "short.eldr.gz").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(EventFileError, match=r"record \d+ at byte offset \d+: truncated"):
        read_event_file(tmp_path / "short.eldr.gz")


def test_a_file_of_another_kind_is_refused(tmp_path: Path) -> None:
    (tmp_path / "x.json").write_text('{"not": "an event log"}')
    with pytest.raises(EventFileError, match="not an ELDR event file"):
        read_event_file(tmp_path / "x.json")


def test_a_newer_format_asks_for_an_upgrade(tmp_path: Path) -> None:
    header = FileHeader(
        format_version=99,
        namespace="ns",
        created_ts_s=T0,
        producer="eldr 9",
        selection=SelectionRecord(),
        counts={},
        records=0,
    )
    payload = msgspec.msgpack.encode(header)
    path = tmp_path / "future.eldr"
    path.write_bytes(MAGIC + struct.pack("<II", len(payload), zlib.crc32(payload)) + payload)
    with pytest.raises(EventFileError, match="format version 99 is newer"):
        read_event_file(path)


def test_data_after_the_announced_records_is_refused(tmp_path: Path) -> None:
    write_event_file(sample_log(1), tmp_path / "events.eldr")
    raw = (tmp_path / "events.eldr").read_bytes()
    (tmp_path / "long.eldr").write_bytes(raw + raw[len(MAGIC) :])
    with pytest.raises(EventFileError, match="unexpected data after the last"):
        read_event_file(tmp_path / "long.eldr")


def test_selection_refuses_contradictions() -> None:
    with pytest.raises(ValueError, match="end_seq is before start_seq"):
        Selection(start_seq=5, end_seq=2)
    with pytest.raises(ValueError, match="cannot be combined"):
        Selection(last=3, start_seq=1)
