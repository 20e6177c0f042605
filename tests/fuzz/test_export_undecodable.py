"""`eldr export` over a DECISIONS stream salted with hostile records (issue 15, finding 10).

A real nats-server holds valid decisions interleaved with stored records that do not
decode (seeded mutations of valid decisions, kept only when the codec refuses them). The
real `eldr export` command, run as a process, must write every valid decision, say how
many records it left out and the stream sequence of the first, exit 4 (incomplete), and
publish nothing: no dead letter, no stream changes.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import pytest

from eldr.bus import Bus, apply_topology, delete_topology, stream_name
from eldr.bus.topology import DECISIONS, Topology
from eldr.dev.stack import eldr_command
from eldr.replay.eventlog import read_event_file
from eldr.settings import BusSettings
from eldr.wire import Decision, WireError, decode, encode
from support.messages import decision

from .mutations import RandomChooser, payload, plain

pytestmark = pytest.mark.integration

VALID = 300
HOSTILE = 60
SEED = 15


def hostile_decisions(count: int, seed: int) -> list[bytes]:
    """`count` payloads of kind `decision` that the codec refuses."""
    seeds = [plain(decision(f"seed-{i}", f"d{i % 4}")) for i in range(4)]
    chooser = RandomChooser(seed)
    found: list[bytes] = []
    while len(found) < count:
        data = payload(chooser, "decision", seeds)
        try:
            decode(data, Decision, 1 << 20)
        except WireError:
            found.append(data)
    return found


async def salt_stream(settings: BusSettings, topology: Topology) -> list[int]:
    """Publish the valid and hostile decisions interleaved; the hostile ones' sequences."""
    bus = await Bus.connect(settings, "salt")
    try:
        await apply_topology(bus, topology)
        hostile = iter(hostile_decisions(HOSTILE, SEED))
        bad_seqs: list[int] = []
        every = VALID // HOSTILE
        for i in range(VALID):
            rid = f"req-{i}"
            await bus.js_publish(bus.subjects.decision(rid), decision(rid, f"d{i % 4}"))
            if i % every == every - 1:
                ack = await bus.publish_raw(bus.subjects.decision(f"bad-{i}"), next(hostile))
                bad_seqs.append(ack.seq)
        return bad_seqs
    finally:
        await bus.drain()


async def stream_messages(settings: BusSettings, topology: Topology) -> dict[str, int]:
    bus = await Bus.connect(settings, "count")
    try:
        return {s.name: (await bus.stream_state(s.name)).messages for s in topology.streams}
    finally:
        await bus.drain()


async def delete(settings: BusSettings, topology: Topology) -> None:
    bus = await Bus.connect(settings, "cleanup")
    try:
        await delete_topology(bus, topology)
    finally:
        await bus.drain()


def test_export_reports_undecodable_decisions_and_writes_nothing_to_the_cluster(
    bus_settings: BusSettings, topology: Topology, tmp_path: Path
) -> None:
    try:
        check_export(bus_settings, topology, tmp_path)
    finally:
        asyncio.run(delete(bus_settings, topology))


def check_export(bus_settings: BusSettings, topology: Topology, tmp_path: Path) -> None:
    bad_seqs = asyncio.run(salt_stream(bus_settings, topology))
    assert len(bad_seqs) == HOSTILE
    before = asyncio.run(stream_messages(bus_settings, topology))
    assert before[stream_name(bus_settings.namespace, DECISIONS)] == VALID + HOSTILE
    out = tmp_path / "window.eldr.gz"
    env = {
        **os.environ,
        "ELDR_NATS_URL": bus_settings.nats_url,
        "ELDR_NAMESPACE": bus_settings.namespace,
    }
    done = subprocess.run(
        [*eldr_command(), "export", str(out), "--last", "100000", "--timeout", "60"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    print(f"\neldr export exit {done.returncode}\n{done.stdout}{done.stderr}")
    assert done.returncode == 4, done.stderr
    assert f"{HOSTILE:,} stored record(s) could not be decoded" in done.stderr
    assert f"the first at seq {bad_seqs[0]}" in done.stderr
    assert "nothing was dead-lettered" in done.stderr
    event_log = read_event_file(out)
    assert len(event_log.decisions) == VALID
    assert {d.request_id for d in event_log.decisions} == {f"req-{i}" for i in range(VALID)}
    assert any(f"{HOSTILE:,} undecodable" in note for note in event_log.notes)
    # read-only: no dead letter, no stream touched
    assert asyncio.run(stream_messages(bus_settings, topology)) == before


def test_the_hostile_records_really_are_undecodable() -> None:
    """Guards the test above: its hostile records are refused by the codec, its valid ones
    are not."""
    assert len(hostile_decisions(HOSTILE, SEED)) == HOSTILE
    assert decode(encode(decision("x")), Decision, 1 << 20).request_id == "x"
