"""Cost-aware routing in the routing service: the activity of every replica's decisions
steers it, and the gateway's finish events or decode summaries (finished requests) release
it; a worker's entries stay within what is in flight there."""

from __future__ import annotations

import asyncio
import re
import socket
import time
from contextlib import AbstractAsyncContextManager

import aiohttp
import numpy as np
import pytest

from eldr.bus import Bus, Topology, apply_topology
from eldr.bus.topology import DECISIONS, FINISHED
from eldr.core.partition.partition import Partition
from eldr.core.routing.decide import RouterCore
from eldr.core.routing.loadtable import LoadTable
from eldr.core.routing.profile import DEFAULT_PROFILE, EldrCostProfile
from eldr.core.signature.signature import Calibration
from eldr.settings import BusSettings, RetentionSettings
from eldr.wire import (
    Decision,
    DecodeSummary,
    PrefillDone,
    RequestFinished,
    SparseCounts,
)
from eldr_services.router.rebuild import rebuild
from eldr_services.router.service import setup
from eldr_services.router.settings import RouterSettings
from support import messages
from support.decisions import committed_decision
from support.partitions import announce
from support.services import running_service
from support.workers import reporting

pytestmark = pytest.mark.integration

L, E = 2, 4
RUNNING = {"d0": 3, "d1": 3}
"""Both stand-in workers report 3 running requests."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def counts(*experts: int) -> np.ndarray:
    x = np.zeros((L, E), dtype=np.uint32)
    x[:, list(experts)] = 3
    return x


def running_router(settings: RouterSettings) -> AbstractAsyncContextManager[None]:
    return running_service("router", settings, setup)


async def other_replica_decides(bus: Bus, rid: str, worker: str, experts: tuple[int, ...]) -> None:
    await bus.js_publish(
        bus.subjects.decision(rid),
        messages.decision(
            rid,
            worker,
            counts=counts(*experts),
            router_id="elsewhere",
            policy="eldr_cost",
            prompt_tokens=6,
        ),
    )


async def finished(bus: Bus, rid: str, worker: str) -> None:
    await bus.js_publish(
        bus.subjects.profiles(worker),
        DecodeSummary(
            request_id=rid,
            worker_id=worker,
            ts_s=time.time(),
            tokens=4,
            counts=SparseCounts.from_dense(counts(2, 3)),
        ),
    )


async def gateway_says_finished(
    bus: Bus, rid: str, worker: str, *, gateway: str = "gw0", subject_gateway: str | None = None
) -> None:
    await bus.publish(
        bus.subjects.finished(subject_gateway or gateway),
        RequestFinished(
            request_id=rid, gateway_id=gateway, ts_s=time.time(), reason="stop", worker_id=worker
        ),
    )


async def metric(port: int, name: str, *, absent: float | None = None) -> float:
    """The series' value; a series not exported yet fails the test, or reads as `absent`
    when given (a labelled counter appears only with its first increment)."""
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{port}/metrics") as response,
    ):
        text = await response.text()
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    if found is None and absent is not None:
        return absent
    assert found is not None, name
    return float(found.group(1))


async def activity(port: int) -> float:
    return await metric(port, "eldr_router_activity_requests")


async def wait_for_activity(port: int, value: float) -> None:
    deadline = time.monotonic() + 10
    while await activity(port) != value:
        assert time.monotonic() < deadline, f"activity never reached {value}"
        await asyncio.sleep(0.05)


async def route(bus: Bus, rid: str, experts: tuple[int, ...]) -> Decision:
    """A prompt shorter than one block: its partial block is the whole signature."""
    await bus.js_publish(
        bus.subjects.prefill_done("p0"),
        PrefillDone(
            request_id=rid,
            model="m",
            prefill_worker="p0",
            ts_s=time.time(),
            block_size=16,
            block_hashes=[],
            n_prompt_tokens=6,
            partial=SparseCounts.from_dense(counts(*experts)),
            num_moe_layers=L,
            num_experts=E,
        ),
    )
    return await committed_decision(bus, rid)


def two_topic_partition() -> Partition:
    """d0 and d1 own centroids on experts 0-1, d2 and d3 on experts 2-3."""
    cal = Calibration(L, E, "raw", None, np.ones(L, dtype=bool))
    c = np.zeros((4, L * E), dtype=np.float32)
    for k, (a, b) in enumerate([(0, 1), (0, 1), (2, 3), (2, 3)]):
        c[k, [a, b, E + a, E + b]] = 0.5 + 0.01 * k  # near-equal within a topic
    return Partition(1, "m", cal, c, np.arange(4), ("d0", "d1", "d2", "d3"))


async def test_the_default_routes_in_the_partitions_band_where_the_activity_is_cheapest(
    bus: Bus, bus_settings: BusSettings, retention: RetentionSettings, topology: Topology
) -> None:
    """The shipped default reads the announced partition (the band: the two workers of the
    request's topic) and the activity table (of the two, the one already running its
    experts costs least to join); its record holds only what it read."""
    await apply_topology(bus, topology)
    await announce(bus, two_topic_partition())
    port = free_port()
    settings = RouterSettings(
        **(bus_settings.model_dump() | retention.model_dump()),
        signature_timeout_s=0.05,
        stale_after_s=2.0,
        metrics_port=port,
    )
    assert settings.routing_profile == DEFAULT_PROFILE
    running = dict.fromkeys(("d0", "d1", "d2", "d3"), 3)
    admitted: dict[str, list[str]] = {w: [] for w in running}
    async with reporting(bus, running, period_s=0.1, admitted=admitted), running_router(settings):
        for i in range(2):
            admitted["d1"].append(f"y{i}")
            await other_replica_decides(bus, f"y{i}", "d1", (0, 1))
            admitted["d2"].append(f"z{i}")
            await other_replica_decides(bus, f"z{i}", "d2", (2, 3))
        await wait_for_activity(port, 4)
        first = await route(bus, "r1", (0, 1))
        second = await route(bus, "r2", (2, 3))
    for d, band, worker in ((first, ["d0", "d1"], "d1"), (second, ["d2", "d3"], "d2")):
        assert (d.policy, d.partition_version, d.fallback) == ("eldr_band_cost", 1, None)
        assert (d.band, d.worker_id) == (band, worker)
        assert d.fleet == []
        assert d.live_workers == 4
        assert [row[0] for row in d.considered] == ["d0", "d1", "d2", "d3"]
        terms = {row[0]: (row[4], row[5]) for row in d.considered if row[4] is not None}
        assert set(terms) == set(band)
        other = next(w for w in band if w != worker)
        assert terms[worker][1] < terms[other][1]  # it adds fewer new experts there


async def test_cost_aware_routing_follows_activity_and_forgets_finished_requests(
    bus: Bus, bus_settings: BusSettings, retention: RetentionSettings
) -> None:
    port = free_port()
    settings = RouterSettings(
        **(bus_settings.model_dump() | retention.model_dump()),
        signature_timeout_s=0.05,
        stale_after_s=2.0,
        metrics_port=port,
        routing_profile=EldrCostProfile(),  # activity over every worker, no partition
    )
    admitted: dict[str, list[str]] = {"d0": [], "d1": []}
    async with reporting(bus, RUNNING, period_s=0.1, admitted=admitted), running_router(settings):
        # Another replica sent three expert-2/3 requests to d1.
        for i in range(3):
            admitted["d1"].append(f"y{i}")
            await other_replica_decides(bus, f"y{i}", "d1", (2, 3))
        await wait_for_activity(port, 3)
        first = await route(bus, "r1", (2, 3))
        assert (first.worker_id, first.policy, first.fallback) == ("d1", "eldr_cost", None)
        # They finish; then two expert-2/3 requests go to d0.
        for i in range(3):
            await finished(bus, f"y{i}", "d1")
        await finished(bus, "r1", first.worker_id)
        await wait_for_activity(port, 0)
        for i in range(2):
            admitted["d0"].append(f"z{i}")
            await other_replica_decides(bus, f"z{i}", "d0", (2, 3))
        await wait_for_activity(port, 2)
        second = await route(bus, "r2", (2, 3))
    # Had d1's finished requests still counted, d1 (3 of them) would have won again.
    assert second.worker_id == "d0"


async def test_finish_events_release_activity_without_any_decode_summary(
    bus: Bus, bus_settings: BusSettings, retention: RetentionSettings
) -> None:
    # The same story with real decode workers that publish no profiles: the gateway's
    # finish events alone release the activity, and a forged gateway id does not.
    port = free_port()
    settings = RouterSettings(
        **(bus_settings.model_dump() | retention.model_dump()),
        signature_timeout_s=0.05,
        stale_after_s=2.0,
        metrics_port=port,
        routing_profile=EldrCostProfile(),
    )
    admitted: dict[str, list[str]] = {"d0": [], "d1": []}
    async with reporting(bus, RUNNING, period_s=0.1, admitted=admitted), running_router(settings):
        for i in range(3):
            admitted["d1"].append(f"y{i}")
            await other_replica_decides(bus, f"y{i}", "d1", (2, 3))
        await wait_for_activity(port, 3)
        # A finish published on another gateway's subject is refused and counted.
        await gateway_says_finished(bus, "y0", "d1", gateway="gw0", subject_gateway="gw1")
        deadline = time.monotonic() + 10
        name = 'eldr_bus_messages_rejected_total{family="finished",reason="identity_mismatch"}'
        while await metric(port, name, absent=0.0) < 1:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        assert await activity(port) == 3
        for i in range(3):
            await gateway_says_finished(bus, f"y{i}", "d1")
        await wait_for_activity(port, 0)
        tracked = 'eldr_router_finish_events_total{outcome="tracked",reason="stop"}'
        assert await metric(port, tracked) == 3
        for i in range(2):
            admitted["d0"].append(f"z{i}")
            await other_replica_decides(bus, f"z{i}", "d0", (2, 3))
        await wait_for_activity(port, 2)
        second = await route(bus, "r2", (2, 3))
    assert second.worker_id == "d0"


async def test_a_workers_activity_is_capped_by_its_in_flight_requests(
    bus: Bus, bus_settings: BusSettings, retention: RetentionSettings
) -> None:
    # 40 decisions for d1 whose finishes never arrive, while d1 keeps reporting 3 requests
    # in flight: the replica holds at most 3 + slack of them and counts the evictions.
    port = free_port()
    settings = RouterSettings(
        **(bus_settings.model_dump() | retention.model_dump()),
        signature_timeout_s=0.05,
        stale_after_s=2.0,
        metrics_port=port,
        activity_slack=2,
    )
    admitted: dict[str, list[str]] = {"d0": [], "d1": []}
    async with reporting(bus, RUNNING, period_s=0.1, admitted=admitted), running_router(settings):
        await asyncio.sleep(0.3)  # the first reports are in
        for i in range(40):
            admitted["d1"].append(f"y{i}")
            await other_replica_decides(bus, f"y{i}", "d1", (i % E,))
        deadline = time.monotonic() + 10
        evicted = 'eldr_router_activity_evictions_total{reason="over_in_flight"}'
        while await metric(port, evicted, absent=0.0) < 35:
            assert time.monotonic() < deadline, await metric(port, evicted, absent=0.0)
            await asyncio.sleep(0.05)
        assert await activity(port) == 5
        per_worker = 'eldr_router_worker_activity_requests{worker="d1"}'
        assert await metric(port, per_worker) == 5
        assert await metric(port, "eldr_router_activity_bytes") > 0


async def worker_activity(port: int) -> dict[str, float]:
    """Per worker, the activity entries a router holds."""
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{port}/metrics") as response,
    ):
        text = await response.text()
    found = re.findall(
        r'^eldr_router_worker_activity_requests\{worker="([^"]+)"\} (\S+)$', text, re.MULTILINE
    )
    return {worker: float(value) for worker, value in found if float(value)}


async def test_a_new_replica_rebuilds_what_is_in_flight_before_it_takes_events(
    bus: Bus, bus_settings: BusSettings, retention: RetentionSettings, topology: Topology
) -> None:
    """Issue 23: a replica that starts (or restarts) while requests are in flight counts
    them from the streams before it takes events, so it sees what the replica that never
    stopped sees, instead of idle workers."""
    await apply_topology(bus, topology)
    port_a, port_b = free_port(), free_port()

    def settings(port: int, instance: str) -> RouterSettings:
        return RouterSettings(
            **(bus_settings.model_dump() | retention.model_dump()),
            signature_timeout_s=0.05,
            stale_after_s=2.0,
            metrics_port=port,
            instance_id=instance,
        )

    room = {"d0": 40, "d1": 40}  # the per-worker bound keeps every entry
    async with reporting(bus, room, period_s=0.1), running_router(settings(port_a, "a")):
        routed = [await route(bus, f"r{n}", (n % 4, (n + 1) % 4)) for n in range(30)]
        for decision in routed[:10]:  # the gateway saw these end
            await gateway_says_finished(bus, decision.request_id, decision.worker_id)
        # One moved to the other worker before it started there.
        moved = routed[10]
        other = "d1" if moved.worker_id == "d0" else "d0"
        await bus.publish(
            bus.subjects.finished("gw0"),
            RequestFinished(
                request_id=moved.request_id,
                gateway_id="gw0",
                ts_s=time.time(),
                reason="moved",
                worker_id=moved.worker_id,
                moved_to=other,
            ),
        )
        await wait_for_activity(port_a, 20)
        expected = await worker_activity(port_a)
        async with running_router(settings(port_b, "b")):
            ready = time.monotonic()
            # Per worker once B has its first load reports (every 0.1 s). The issue's "within
            # one second of its start" is asserted on the router's own clock (the rebuild's
            # seconds, before it takes events); the test's polling, which a busy CI machine
            # delays, is printed, and bounded only so that it cannot wait forever.
            while set(rebuilt := await worker_activity(port_b)) != set(expected):
                assert time.monotonic() - ready < 15.0, rebuilt
                await asyncio.sleep(0.02)
            shown_s = time.monotonic() - ready
            in_flight = await metric(port_b, "eldr_router_rebuild_in_flight_requests")
            complete = await metric(port_b, "eldr_router_rebuild_complete")
            took_s = await metric(port_b, "eldr_router_rebuild_seconds")
    print(
        f"\nrebuilt {in_flight:.0f} requests in flight in {took_s:.3f} s, per worker in the "
        f"metrics {shown_s:.2f} s after start: {rebuilt}"
    )
    assert sum(expected.values()) == 20
    assert rebuilt == expected
    assert (in_flight, complete) == (20, 1)
    assert took_s < 1.0


async def test_a_rebuild_beyond_its_memory_bound_says_it_is_incomplete(
    bus: Bus, topology: Topology
) -> None:
    """The rebuild keeps at most `max_requests` finished ids: beyond, it counts the rest as
    in flight (the activity table's own bounds then apply) and says it is incomplete."""
    await apply_topology(bus, topology)
    for n in range(6):
        await other_replica_decides(bus, f"q{n}", "d0", (1, 2))
    for n in range(4):
        await gateway_says_finished(bus, f"q{n}", "d0")
    await bus.flush()

    def core() -> RouterCore:
        return RouterCore(EldrCostProfile(), LoadTable(), np.random.default_rng(0))

    limits = {
        "decisions_stream": topology.stream_name(DECISIONS),
        "finished_stream": topology.stream_name(FINISHED),
        "lifetime_s": 60.0,
        "pending_ttl_s": 10.0,
        "timeout_s": 20.0,
    }
    roomy, tight = core(), core()
    whole = await rebuild(bus, roomy, max_requests=100, **limits)
    cut = await rebuild(bus, tight, max_requests=2, **limits)
    assert (whole.complete, whole.finished, whole.decisions, whole.in_flight) == (True, 4, 6, 2)
    assert sorted(roomy.activity.per_worker().items()) == [("d0", 2)]
    assert (cut.complete, cut.in_flight) == (False, 4)  # two finishes not kept
