"""Record a window of real routing decisions on NATS, then replay, explain, export and
import it.

The routing service runs in-process (two replicas, the default profile: the partition's band
and the activity table) against stand-in decode
workers that take every decision, hold each request for a while, report their loads and
publish a decode summary when a request finishes. The window (1,200 decisions) is recorded
once per module; every test reads it back from JetStream or from an export of it.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
import pytest

from eldr.bus import Bus, Delivery, apply_topology, build_topology, delete_topology, stream_name
from eldr.bus.topology import DECISIONS, PROFILES
from eldr.core.partition.partition import Partition
from eldr.core.signature.signature import Calibration
from eldr.dev.natsserver import EmbeddedNats
from eldr.partitions.codec import partition_to_blob
from eldr.replay.cli import register
from eldr.replay.engine import replay
from eldr.replay.eventlog import (
    Event,
    EventLog,
    Selection,
    read_event_file,
    record_offsets,
    write_event_file,
)
from eldr.replay.source import fetch_partition_blob, import_events, read_events
from eldr.replay.whatif import ReplayConfig
from eldr.runtime import run_service
from eldr.settings import BusSettings, RetentionSettings
from eldr.wire import (
    Decision,
    DecodeSummary,
    LoadReport,
    PartitionAnnouncement,
    PartitionBlob,
    PrefillDone,
    RouterControl,
    RouterControlReply,
    SparseCounts,
    decode,
    encode,
)
from eldr_services.router.service import setup as router_setup
from eldr_services.router.settings import RouterSettings

pytestmark = pytest.mark.integration

L, E = 4, 16
WORKERS = ("d0", "d1", "d2", "d3")
N_REQUESTS = 1200
REPORT_PERIOD_S = 0.1


def make_partition() -> Partition:
    """Worker k owns topic k: experts 4k..4k+3 in every layer."""
    cal = Calibration(L, E, "idf", np.ones(L * E, dtype=np.float32), np.ones(L, dtype=bool))
    c = np.zeros((len(WORKERS), L * E), dtype=np.float32)
    for k in range(len(WORKERS)):
        for layer in range(L):
            c[k, layer * E + 4 * k : layer * E + 4 * k + 4] = 1.0
    c /= np.linalg.norm(c, axis=1, keepdims=True)
    return Partition(1, "m", cal, c, np.arange(len(WORKERS)), WORKERS)


def topic_counts(rng: np.random.Generator, topics: tuple[int, ...], tokens: int) -> np.ndarray:
    """Expert counts of `tokens` tokens (top-2), drawn mostly (86%) from the topics' experts.

    The background share is kept small so that a worker's batch under locality routing
    activates clearly fewer experts than a load-only one; with a large background every
    batch of a few dozen requests touches nearly all 16 experts and the modelled difference
    is within the noise of the recording's timing."""
    weights = np.full(E, 0.02)
    for t in topics:
        weights[4 * t : 4 * t + 4] += 2.0 / len(topics)
    weights /= weights.sum()
    return np.stack([rng.multinomial(2 * tokens, weights) for _ in range(L)]).astype(np.uint32)


class StandInWorkers:
    """Decode-worker stand-ins (not the simdecode service): every decision is admitted by
    its worker and held 0.1-0.3 s; loads are reported every REPORT_PERIOD_S; a decode
    profile is published when a request finishes."""

    def __init__(self, bus: Bus, topics: dict[str, tuple[int, ...]], seed: int = 1) -> None:
        self.bus = bus
        self.topics = topics
        self.rng = np.random.default_rng(seed)
        self.held: dict[str, list[tuple[float, Decision, int]]] = {w: [] for w in WORKERS}
        self.admitted: dict[str, list[str]] = {w: [] for w in WORKERS}
        self.profiles_published = 0
        self.seq = 0

    async def on_decision(self, d: Decision, _: Delivery) -> None:
        duration_s = float(self.rng.uniform(0.1, 0.3))
        self.held[d.worker_id].append((time.time() + duration_s, d, int(self.rng.integers(8, 40))))
        self.admitted[d.worker_id].append(d.request_id)

    async def run(self) -> None:
        while True:
            self.seq += 1
            now = time.time()
            for w in WORKERS:
                done = [h for h in self.held[w] if h[0] <= now]
                self.held[w] = [h for h in self.held[w] if h[0] > now]
                for _, d, tokens in done:
                    counts = topic_counts(self.rng, self.topics[d.request_id], tokens)
                    await self.bus.js_publish(
                        self.bus.subjects.profiles(w),
                        DecodeSummary(
                            request_id=d.request_id,
                            worker_id=w,
                            ts_s=time.time(),
                            tokens=tokens,
                            counts=SparseCounts.from_dense(counts),
                            tpot_s=0.02,
                        ),
                    )
                    self.profiles_published += 1
                admitted, self.admitted[w] = self.admitted[w], []
                await self.bus.publish(
                    self.bus.subjects.load(w),
                    LoadReport(
                        worker_id=w,
                        incarnation="inc",
                        seq=self.seq,
                        ts_s=time.time(),
                        running=len(self.held[w]),
                        waiting=0,
                        kv_tokens=sum((h[1].prompt_tokens or 0) for h in self.held[w]),
                        kv_capacity_tokens=1_000_000,
                        admitted=admitted,
                    ),
                )
            await asyncio.sleep(REPORT_PERIOD_S)


def eldr_main(argv: list[str]) -> int:
    """`eldr` with the replay commands (run in this process)."""
    parser = argparse.ArgumentParser(prog="eldr")
    register(parser.add_subparsers())
    args = parser.parse_args(argv)
    return int(args.func(args))


@dataclass
class Recording:
    settings: BusSettings
    log: EventLog
    request_ids: list[str]


async def _wait_messages(bus: Bus, suffix: str, n: int, timeout_s: float) -> None:
    stream = stream_name(bus.subjects.namespace, suffix)
    deadline = time.monotonic() + timeout_s
    while (await bus.stream_state(stream)).messages < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{stream} did not reach {n} messages")
        await asyncio.sleep(0.1)


async def record_window(settings: BusSettings, retention: RetentionSettings) -> Recording:
    rng = np.random.default_rng(7)
    topology = build_topology(settings.namespace, retention)
    bus = await Bus.connect(settings, "recorder")
    try:
        await apply_topology(bus, topology)
        p = make_partition()
        blob = partition_to_blob(p)
        ref = await bus.object_put(topology.partitions_bucket, "v1", blob)
        await bus.js_publish(
            bus.subjects.partition_active,
            PartitionAnnouncement(
                version=1,
                model="m",
                object_name="v1",
                sha256=ref.sha256,
                created_ts_s=time.time(),
                k=p.k,
                dim=p.calibration.dim,
                workers=list(WORKERS),
            ),
        )
        topics: dict[str, tuple[int, ...]] = {}
        workers = StandInWorkers(bus, topics)
        await bus.subscribe(bus.subjects.decisions_all, Decision, workers.on_decision)
        reporter = asyncio.create_task(workers.run())
        base = settings.model_dump() | retention.model_dump()
        stops, tasks = [], []
        for rid in ("r1", "r2"):
            stop, ready = asyncio.Event(), asyncio.Event()
            s = RouterSettings(
                **base,
                instance_id=rid,  # the routers' default profile
                stale_after_s=2.0,
                pending_ttl_s=1.0,
                signature_timeout_s=0.05,
            )
            tasks.append(
                asyncio.create_task(
                    run_service(
                        "router",
                        s,
                        router_setup,
                        stop=stop,
                        ready=ready,
                        install_signal_handlers=False,
                    )
                )
            )
            stops.append(stop)
            await asyncio.wait_for(ready.wait(), 20)
        deadline = time.monotonic() + 20
        while True:  # both replicas route with version 1 before traffic starts
            replies = await bus.request_many(
                bus.subjects.control_router,
                RouterControl(),
                RouterControlReply,
                timeout_s=1.0,
                max_replies=2,
            )
            ok = [r for r in replies if isinstance(r, RouterControlReply)]
            if len(ok) == 2 and all(r.partition_version == 1 and r.live_workers == 4 for r in ok):
                break
            assert time.monotonic() < deadline, f"routers not ready: {replies}"
            await asyncio.sleep(0.1)
        ids = []
        for i in range(N_REQUESTS):
            rid = f"req-{i:05d}"
            mixed = rng.random() < 0.3
            topic = (int(rng.integers(4)),) if not mixed else tuple(rng.choice(4, 2, False))
            topics[rid] = tuple(int(t) for t in topic)
            prompt = int(rng.integers(20, 200))
            await bus.js_publish(
                bus.subjects.prefill_done("p0"),
                PrefillDone(
                    request_id=rid,
                    model="m",
                    prefill_worker="p0",
                    ts_s=time.time(),
                    block_size=4096,  # one partial block: the event carries the signature
                    block_hashes=[],
                    n_prompt_tokens=prompt,
                    partial=SparseCounts.from_dense(topic_counts(rng, topics[rid], prompt)),
                    num_moe_layers=L,
                    num_experts=E,
                ),
            )
            ids.append(rid)
            if i % 10 == 9:
                await asyncio.sleep(0.05)  # ~200 requests/s: a dozen in flight per worker
        await _wait_messages(bus, DECISIONS, N_REQUESTS, 60)
        await _wait_messages(bus, PROFILES, N_REQUESTS, 30)
        for stop in stops:
            stop.set()
        await asyncio.gather(*tasks)
        reporter.cancel()
        event_log = await read_events(bus, Selection(), timeout_s=60)
    finally:
        await bus.drain()
    return Recording(settings=settings, log=event_log, request_ids=ids)


@pytest.fixture(scope="module")
def recording(nats_server: EmbeddedNats) -> Iterator[Recording]:
    settings = BusSettings(
        nats_url=nats_server.url,
        namespace=f"t{uuid.uuid4().hex[:12]}",
        fetch_timeout_s=0.2,
        reconnect_wait_s=0.1,
        drain_timeout_s=10.0,
    )
    mib = 1 << 20
    retention = RetentionSettings(
        blocks_max_bytes=16 * mib,
        prefill_max_bytes=16 * mib,
        decisions_max_bytes=32 * mib,
        load_max_bytes=16 * mib,
        profiles_max_bytes=16 * mib,
        finished_max_bytes=16 * mib,
        partitions_max_bytes=16 * mib,
        dlq_max_bytes=16 * mib,
    )
    yield asyncio.run(record_window(settings, retention))
    asyncio.run(_delete(settings, retention))


async def _delete(settings: BusSettings, retention: RetentionSettings) -> None:
    bus = await Bus.connect(settings, "cleanup")
    await delete_topology(bus, build_topology(settings.namespace, retention))
    await bus.drain()


def test_the_recorded_configuration_reproduces_every_recorded_decision(
    recording: Recording,
) -> None:
    log = recording.log
    assert len(log.decisions) == N_REQUESTS
    assert {d.router_id for d in log.decisions} == {"r1", "r2"}
    assert len(log.load_reports) > 0
    assert len(log.summaries) == N_REQUESTS
    report = replay(log).reproduction
    assert report.checked == N_REQUESTS
    assert report.reproduced == N_REQUESTS, report.mismatches
    assert report.needed_draw > 0  # ties happened, and their recorded draws were re-created


def test_tau_zero_reports_changed_decisions_and_the_modelled_effect(recording: Recording) -> None:
    # The paper's rule at tau 0 sends every request to its best centroid's worker (the
    # default's load ceiling may not, so its own tau 0 need not raise the similarity).
    config = ReplayConfig(policy="eldr", params=(("tau", 0.0),))
    cf = replay(recording.log, config).counterfactual
    assert cf is not None
    assert cf.changes == {"policy": "eldr_band_cost -> eldr", "tau": "0.1 -> 0"}
    assert 0 < cf.changed < N_REQUESTS
    assert cf.after.similarity_mean is not None
    assert cf.before.similarity_mean is not None
    assert cf.after.similarity_mean > cf.before.similarity_mean  # tau 0: the best centroid
    assert cf.modelled is not None
    assert cf.modelled.profiled == N_REQUESTS
    assert cf.modelled.after.expert_union_per_layer != cf.modelled.before.expert_union_per_layer


def test_a_load_only_replay_reports_changed_decisions_and_lower_locality(
    recording: Recording,
) -> None:
    cf = replay(recording.log, ReplayConfig(policy="jsq")).counterfactual
    assert cf is not None
    assert cf.changed > N_REQUESTS // 4
    assert cf.after.similarity_mean is not None
    assert cf.before.similarity_mean is not None
    assert cf.after.similarity_mean < cf.before.similarity_mean
    assert cf.modelled is not None
    assert cf.modelled.after.expert_union_per_layer > cf.modelled.before.expert_union_per_layer


@pytest.fixture
def eldr_env(recording: Recording, monkeypatch: pytest.MonkeyPatch) -> BusSettings:
    monkeypatch.setenv("ELDR_NATS_URL", recording.settings.nats_url)
    monkeypatch.setenv("ELDR_NAMESPACE", recording.settings.namespace)
    return recording.settings


def test_explain_prints_a_readable_answer_for_a_recorded_request(
    recording: Recording, eldr_env: BusSettings, capsys: pytest.CaptureFixture[str]
) -> None:
    rid = recording.request_ids[500]
    assert eldr_main(["explain", rid]) == 0
    out = capsys.readouterr().out
    d = recording.log.decision(rid)
    assert d is not None
    assert out.startswith(f"Request {rid} went to decode worker {d.worker_id}.")
    for section in ("Candidates", "Band: ", "Winner: ", "Load-only: ", "Fallback: none."):
        assert section in out
    assert "recomputed from partition version 1" in out
    assert "reproduced" in out
    assert f"decoded {recording.log.summaries[rid].tokens} tokens on {d.worker_id}" in out


def test_explain_of_an_unknown_request_fails_clearly(
    eldr_env: BusSettings, capsys: pytest.CaptureFixture[str]
) -> None:
    assert eldr_main(["explain", "no-such-request"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("eldr explain: no decision recorded for request id 'no-such-request'")
    assert f"namespace '{eldr_env.namespace}'" in err
    assert f"holds {N_REQUESTS:,} decisions" in err


def test_export_then_import_into_another_namespace_round_trips(
    recording: Recording,
    eldr_env: BusSettings,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = tmp_path / "window.eldr.gz"
    assert eldr_main(["export", str(path), "--start-seq", "1"]) == 0
    exported = read_event_file(path)
    assert exported.counts() == recording.log.counts()
    target = f"t{uuid.uuid4().hex[:12]}"
    monkeypatch.setenv("ELDR_NAMESPACE", target)
    try:
        assert eldr_main(["import", str(path)]) == 0
        imported_out = capsys.readouterr().out
        assert f"imported into namespace {target}" in imported_out
        again = tmp_path / "again.eldr"
        assert eldr_main(["export", str(again), "--start-seq", "1"]) == 0
        reimported = read_event_file(again)
    finally:
        asyncio.run(_delete(eldr_env.model_copy(update={"namespace": target}), RetentionSettings()))
    assert reimported.namespace == target
    assert [d.request_id for d in reimported.decisions] == [
        d.request_id for d in recording.log.decisions
    ]
    assert reimported.decisions == recording.log.decisions
    assert reimported.summaries == recording.log.summaries
    assert reimported.blobs == recording.log.blobs
    assert replay(reimported).reproduction.reproduced == N_REQUESTS


@pytest.mark.parametrize("damage", ["corrupted", "truncated"])
def test_a_damaged_export_fails_naming_the_first_bad_record(
    recording: Recording, tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str
) -> None:
    from eldr.replay.eventlog import write_event_file

    path = tmp_path / "window.eldr"
    write_event_file(recording.log, path)
    offsets = record_offsets(path)
    raw = bytearray(path.read_bytes())
    bad = len(offsets) // 2
    if damage == "corrupted":
        raw[offsets[bad] + 20] ^= 0x55
    else:
        raw = raw[: offsets[bad] + 20]
    path.write_bytes(bytes(raw))
    assert eldr_main(["replay", "--file", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"record {bad} at byte offset {offsets[bad]}: {damage}" in err


def test_replay_from_nats_reproduces_the_window(
    eldr_env: BusSettings, capsys: pytest.CaptureFixture[str]
) -> None:
    assert eldr_main(["replay", "--last", "5000"]) == 0
    out = capsys.readouterr().out
    assert f"{N_REQUESTS:,} of {N_REQUESTS:,} decisions reproduced (100.00%)" in out


def test_an_export_of_an_empty_range_writes_nothing(
    eldr_env: BusSettings, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "empty.eldr"
    assert eldr_main(["export", str(path), "--start-seq", str(N_REQUESTS + 1)]) == 1
    assert "no decisions recorded in namespace" in capsys.readouterr().err
    assert not path.exists()


GOLDEN_BLOB_V1 = (
    Path(__file__).parents[1] / "unit" / "wire" / "golden" / "partition_blob.v1.msgpack"
)


def v1_bytes(blob: PartitionBlob) -> bytes:
    """`blob` as a PartitionBlob v1 writer stored it: `prices` (always nil) after
    `workers`, `v` 1 and last, as in the golden v1 blob (which has a projection, so
    routers do not load it)."""
    fields: dict[str, object] = msgspec.msgpack.decode(encode(blob))
    v1: dict[str, object] = {}
    for key, value in fields.items():
        if key != "v":
            v1[key] = value
        if key == "workers":
            v1["prices"] = None
    v1["v"] = 1
    data = msgspec.msgpack.encode(v1)
    assert list(msgspec.msgpack.decode(data)) == list(
        msgspec.msgpack.decode(GOLDEN_BLOB_V1.read_bytes())
    )
    return data


async def test_an_imported_v1_blob_keeps_the_hash_its_announcement_names(
    bus: Bus,
    bus_settings: BusSettings,
    retention: RetentionSettings,
    tmp_path: Path,
) -> None:
    """A log recorded before PartitionBlob v2 (v1 bytes, announced with their SHA-256)
    imports as those bytes: the routers' checked fetch accepts it, a router loads it, and
    an export writes the same bytes again."""
    data = v1_bytes(partition_to_blob(make_partition()))
    sha = hashlib.sha256(data).hexdigest()
    blob = decode(data, PartitionBlob)
    now = time.time()
    announcement = PartitionAnnouncement(
        version=blob.version,
        model=blob.model,
        object_name="v1",
        sha256=sha,
        created_ts_s=now - 1,
        k=len(blob.workers),
        dim=blob.centroids.shape[1],
        workers=blob.workers,
    )
    decision = Decision(
        request_id="req-1",
        ts_s=now,
        router_id="r1",
        model=blob.model,
        worker_id=blob.workers[0],
        policy="jsq",
        params={},
        partition_version=blob.version,
        fallback=None,
        scores=[],
        band=[],
        loads=[(w, 0.0) for w in blob.workers],
        signature=None,
        missing_blocks=0,
        decide_s=0.001,
    )
    recorded = EventLog(
        "recorded",
        [
            Event.of(announcement, stream="PARTITIONS", seq=1),
            Event.of(decision, stream="DECISIONS", seq=1),
        ],
        {"v1": blob},
        blob_data={"v1": data},
    )
    path = tmp_path / "v1.eldr"
    write_event_file(recorded, path)
    await import_events(bus, read_event_file(path))

    assert await fetch_partition_blob(bus, "v1", sha) == blob
    exported = await read_events(bus, Selection(), load_reports=False, profiles=False)
    assert exported.blob_data == {"v1": data}
    assert exported.announcements == [announcement]

    stop, ready = asyncio.Event(), asyncio.Event()
    settings = RouterSettings(**bus_settings.model_dump() | retention.model_dump())
    router = asyncio.create_task(
        run_service(
            "router", settings, router_setup, stop=stop, ready=ready, install_signal_handlers=False
        )
    )
    try:
        await asyncio.wait_for(ready.wait(), 20)
        deadline = time.monotonic() + 20
        while True:
            replies = await bus.request_many(
                bus.subjects.control_router,
                RouterControl(),
                RouterControlReply,
                timeout_s=1.0,
                max_replies=1,
            )
            reply = next((r for r in replies if isinstance(r, RouterControlReply)), None)
            if reply is not None and reply.partition_version == blob.version:
                break
            assert reply is None or reply.partition_error is None, reply
            assert time.monotonic() < deadline, f"the router did not load the blob: {replies}"
            await asyncio.sleep(0.1)
    finally:
        stop.set()
        await router
