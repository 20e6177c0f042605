"""The bus on a 3-node JetStream cluster (`eldr.dev.natscluster`): a leader election or a
lost quorum is an expected fault, not a flood (issue 23, item 3).

- a commit whose stream's leader is killed mid-stream is retried through the election
  (`Bus.retrying` + `Bus.commit_once`): every record is stored exactly once and is its
  writer's own, and the election costs a few log lines, no traceback;
- a pull consumer without a leader (quorum lost) backs off instead of spinning on status
  503, says so once, and consumes again when the quorum is back.

The stalls these tests see are printed (`-s`); the cluster fault suite (tests/faults)
measures them under the real services' load.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from eldr.bus import Bus, Delivery, apply_topology, build_topology, stream_name
from eldr.bus.topology import DECISIONS, PREFILL, ROUTER_CONSUMER
from eldr.dev.natscluster import NatsCluster
from eldr.settings import BusSettings, RetentionSettings
from eldr.wire import PrefillDone
from support import messages

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MIB = 1 << 20
RETENTION = RetentionSettings(
    stream_replicas=3,
    **{
        f"{name}_max_bytes": 8 * MIB
        for name in ("blocks", "prefill", "decisions", "load", "profiles", "finished", "dlq")
    },
    partitions_max_bytes=16 * MIB,
    router_ack_wait_s=5.0,
)


@pytest.fixture
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsCluster]:
    with NatsCluster(3, root=tmp_path_factory.mktemp("cluster")) as started:
        yield started


def _settings(url: str, namespace: str) -> BusSettings:
    return BusSettings(
        nats_url=url,
        namespace=namespace,
        fetch_timeout_s=0.5,
        reconnect_wait_s=0.1,
        request_timeout_s=2.0,
        drain_timeout_s=5.0,
    )


def _bus_lines(caplog: pytest.LogCaptureFixture, since: int) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records[since:]
        if r.name.startswith("eldr.bus") and r.levelno >= logging.WARNING
    ]


async def test_commits_through_a_leader_kill_are_stored_once_with_few_log_lines(
    cluster: NatsCluster, caplog: pytest.LogCaptureFixture
) -> None:
    namespace = f"c{uuid.uuid4().hex[:10]}"
    topology = build_topology(namespace, RETENTION)
    stream = stream_name(namespace, DECISIONS)
    setup = await Bus.connect(_settings(cluster.url, namespace), "setup")
    await apply_topology(setup, topology)
    leader = cluster.wait_stream_leader(stream)
    await setup.drain()
    # Connected to a node that stays up: the test sees the election, not a reconnect.
    survivor = (leader + 1) % 3
    registry = CollectorRegistry()
    bus = await Bus.connect(
        _settings(cluster.nodes[survivor].url, namespace), "writer", registry=registry
    )
    caplog.set_level(logging.INFO, logger="eldr.bus")
    since = len(caplog.records)
    done_at: list[float] = []
    outcomes: dict[str, bool] = {}

    async def commit(n: int) -> None:
        rid = f"req-{n:05d}"
        record = messages.decision(rid)
        committed = await bus.retrying(
            "commit",
            lambda: bus.commit_once(stream, bus.subjects.decision(rid), record, timeout_s=0.5),
            give_up_s=60.0,
        )
        outcomes[rid] = committed.first and committed.record == record
        done_at.append(time.monotonic())

    tasks: list[asyncio.Task[None]] = []
    started = time.monotonic()
    killed_at = 0.0
    for n in range(800):  # 100/s for 8 s; the leader dies at 2 s
        tasks.append(asyncio.create_task(commit(n)))
        if n == 200:
            cluster.kill(leader)
            killed_at = time.monotonic()
        await asyncio.sleep(max(0.0, started + (n + 1) / 100 - time.monotonic()))
    await asyncio.gather(*tasks)
    lines = _bus_lines(caplog, since)
    transient = sum(
        registry.get_sample_value("eldr_bus_transient_errors_total", {"op": "commit", "kind": k})
        or 0.0
        for k in ("timeout", "no_responders", "unavailable", "disconnected")
    )
    state = await bus.stream_state(stream)
    gaps = [b - a for a, b in zip(sorted(done_at), sorted(done_at)[1:], strict=False)]
    stall_s = max(g for g, t in zip(gaps, sorted(done_at)[1:], strict=False) if t > killed_at)
    print(
        f"\nleader kill: {len(outcomes)} commits, {transient:.0f} transient errors retried, "
        f"longest gap between commits {stall_s:.2f} s, {len(lines)} warning lines"
    )
    await bus.drain()

    assert all(outcomes.values()), "a commit came back as another writer's record"
    assert state.messages == 800, "every record stored exactly once"
    assert not any(r.exc_info for r in lines), "a traceback was logged for an expected fault"
    assert len(lines) <= 6, [r.getMessage() for r in lines]


async def test_a_consumer_without_a_leader_backs_off_and_resumes(
    cluster: NatsCluster, caplog: pytest.LogCaptureFixture
) -> None:
    namespace = f"c{uuid.uuid4().hex[:10]}"
    topology = build_topology(namespace, RETENTION)
    stream = stream_name(namespace, PREFILL)
    setup = await Bus.connect(_settings(cluster.url, namespace), "setup")
    await apply_topology(setup, topology)
    leader = cluster.wait_stream_leader(stream, consumer=ROUTER_CONSUMER)
    await setup.drain()
    # The reader stays on a follower of the consumer; the consumer's leader and the third
    # node go down. (A leader that lost its quorum keeps serving pulls until it steps down,
    # about 10 s later: the reader must not be on it.)
    reader_node = (leader + 1) % 3
    down = [i for i in range(3) if i != reader_node]
    registry = CollectorRegistry()
    bus = await Bus.connect(
        _settings(cluster.nodes[reader_node].url, namespace), "reader", registry=registry
    )
    got: list[str] = []
    arrived = asyncio.Event()

    async def handle(msg: PrefillDone, _: Delivery) -> None:
        got.append(msg.request_id)
        arrived.set()

    await bus.consume(stream, ROUTER_CONSUMER, PrefillDone, handle, batch=4, max_concurrency=8)
    caplog.set_level(logging.INFO, logger="eldr.bus")
    since = len(caplog.records)
    # Quorum lost: two of three nodes down, the reader's node alone.
    for node in down:
        cluster.kill(node)
    outage_s = 6.0
    await asyncio.sleep(outage_s)
    pulls = sum(
        registry.get_sample_value("eldr_bus_transient_errors_total", {"op": "pull", "kind": k})
        or 0.0
        for k in ("status_503", "status_409", "status_other", "disconnected")
    )
    lines_during = _bus_lines(caplog, since)
    for node in down:
        cluster.start_node(node)
    cluster.wait_formed()
    writer = await Bus.connect(_settings(cluster.url, namespace), "writer")
    event = PrefillDone(
        request_id="after-quorum",
        model="m",
        prefill_worker="pw0",
        ts_s=time.time(),
        block_size=16,
        block_hashes=[],
        n_prompt_tokens=1,
        partial=None,
        num_moe_layers=2,
        num_experts=4,
    )
    await writer.retrying(
        "publish",
        lambda: writer.js_publish(writer.subjects.prefill_done("pw0"), event),
        give_up_s=30.0,
    )
    await asyncio.wait_for(arrived.wait(), 30.0)
    print(
        f"\nno consumer leader for {outage_s:g} s: {pulls:.0f} refused pulls, "
        f"{len(lines_during)} warning lines"
    )
    await writer.drain()
    await bus.drain()

    assert got == ["after-quorum"]
    # Without backoff the loop re-pulled at once on every 503: thousands a second.
    assert 1 <= pulls <= 30, pulls
    assert len(lines_during) <= 4, [r.getMessage() for r in lines_during]
    assert not any(r.exc_info for r in lines_during)
