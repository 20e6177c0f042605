"""The routing service against a real nats-server: exactly-once decisions, fallbacks,
partition hot-swap, fleet-wide load, control."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

import numpy as np
import pytest

from eldr.bus import Bus, Delivery, RemoteError, Topology, apply_topology
from eldr.bus.topology import DECISIONS, PARTITIONS
from eldr.core.partition.partition import Partition
from eldr.core.routing.profile import EldrBoundedProfile, EldrCostProfile, EldrProfile
from eldr.core.signature.signature import Calibration
from eldr.settings import BusSettings, RetentionSettings
from eldr.wire import (
    Decision,
    PrefillDone,
    RouterControl,
    RouterControlReply,
    SparseCounts,
)
from eldr_services.router.service import setup
from eldr_services.router.settings import RouterSettings
from support.partitions import announce
from support.services import running_service
from support.workers import reporting

pytestmark = pytest.mark.integration

L, E = 2, 4


def router_settings(
    bus_settings: BusSettings, retention: RetentionSettings, **kw
) -> RouterSettings:
    base = bus_settings.model_dump() | retention.model_dump()
    base.update({"signature_timeout_s": 0.05, "stale_after_s": 2.0} | kw)
    return RouterSettings(**base)


def running_router(settings: RouterSettings) -> AbstractAsyncContextManager[None]:
    return running_service("router", settings, setup)


def prefill_done(rid: str, reply_to: str | None = None, model: str = "m") -> PrefillDone:
    return PrefillDone(
        request_id=rid,
        model=model,
        prefill_worker="p0",
        ts_s=time.time(),
        block_size=16,
        block_hashes=[],
        n_prompt_tokens=8,
        partial=None,
        num_moe_layers=L,
        num_experts=E,
        reply_to=reply_to,
    )


async def collect_decisions(bus: Bus, n: int, timeout_s: float = 20.0) -> list[Decision]:
    """Read every decision of the namespace from the stream (the record of truth)."""
    got: list[Decision] = []
    done = asyncio.Event()

    async def on(msg: Decision, _: Delivery) -> None:
        got.append(msg)
        if len(got) >= n:
            done.set()

    topo_stream = f"{bus.subjects.namespace.upper()}_{DECISIONS}"
    reader = await bus.read_back(topo_stream, bus.subjects.decisions_all, Decision, on)
    try:
        await asyncio.wait_for(done.wait(), timeout_s)
        await asyncio.sleep(0.2)  # anything beyond n would be a double decision
    finally:
        await reader.stop()
    return got


async def wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.02)


async def test_every_request_gets_exactly_one_decision_across_two_replicas(
    bus: Bus, bus_settings: BusSettings, retention: RetentionSettings
) -> None:
    s1 = router_settings(bus_settings, retention, instance_id="r1", policy="jsq")
    s2 = router_settings(bus_settings, retention, instance_id="r2", policy="jsq")
    workers = {"d0": 0, "d1": 0, "d2": 0}
    async with reporting(bus, workers), running_router(s1), running_router(s2):
        for i in range(200):
            await bus.js_publish(bus.subjects.prefill_done("p0"), prefill_done(f"req-{i}"))
        # the same request id again (a prefill worker retrying): must not be decided twice
        for i in range(20):
            await bus.js_publish(bus.subjects.prefill_done("p0"), prefill_done(f"req-{i}"))
        decisions = await collect_decisions(bus, 200)
    ids = [d.request_id for d in decisions]
    assert len(ids) == 200
    assert len(set(ids)) == 200
    assert {d.router_id for d in decisions} <= {"r1", "r2"}
    # no signature service in this namespace: every decision says so
    assert {d.fallback for d in decisions} == {None}  # jsq is load-only: no fallback
    # JSQ over the fleet-wide table spreads the load
    per_worker = {w: sum(d.worker_id == w for d in decisions) for w in ("d0", "d1", "d2")}
    assert min(per_worker.values()) > 20  # JSQ spreads (RR would give 66-67 each)


async def test_a_repeated_request_is_answered_with_the_committed_decision(
    bus: Bus, bus_settings: BusSettings, retention: RetentionSettings
) -> None:
    inbox = "_INBOX." + bus.subjects.namespace + ".replies"  # routers answer inboxes only
    replies: list[Decision] = []

    async def on_reply(msg: Decision, _: Delivery) -> None:
        replies.append(msg)

    await bus.subscribe(inbox, Decision, on_reply)
    async with (
        reporting(bus, {"d0": 0, "d1": 0}),
        running_router(router_settings(bus_settings, retention, policy="random")),
    ):
        for _ in range(5):
            await bus.js_publish(bus.subjects.prefill_done("p0"), prefill_done("same", inbox))
        await wait_for(lambda: len(replies) == 5)
    assert len({(d.worker_id, d.ts_s) for d in replies}) == 1
    committed = await bus.get_last(
        f"{bus.subjects.namespace.upper()}_{DECISIONS}", bus.subjects.decision("same"), Decision
    )
    assert committed is not None
    assert committed.worker_id == replies[0].worker_id


async def test_eldr_without_partition_or_signature_falls_back_and_says_why(
    bus: Bus, bus_settings: BusSettings, retention: RetentionSettings
) -> None:
    async with (
        reporting(bus, {"d0": 5, "d1": 0}),
        running_router(router_settings(bus_settings, retention, policy="eldr")),
    ):
        await bus.js_publish(bus.subjects.prefill_done("p0"), prefill_done("x1"))
        [d] = await collect_decisions(bus, 1)
    assert d.policy == "eldr"
    assert d.fallback == "no_partition"
    assert d.worker_id == "d1"
    assert {w: n for w, n, _ in d.fleet} == {"d0": 5, "d1": 0}
    assert d.loads == []  # v4: the fleet holds both measures


async def test_no_live_worker_puts_the_request_back_until_one_reports(
    bus: Bus, bus_settings: BusSettings, retention: RetentionSettings
) -> None:
    s = router_settings(
        bus_settings, retention, policy="jsq", no_worker_wait_s=0.2, no_worker_retry_s=0.1
    )
    async with running_router(s):
        await bus.js_publish(bus.subjects.prefill_done("p0"), prefill_done("late"))
        await asyncio.sleep(0.5)  # past the in-router wait: the request went back once
        async with reporting(bus, {"d7": 0}):
            [d] = await collect_decisions(bus, 1)
    assert d.worker_id == "d7"


def locality_partition(version: int, workers: tuple[str, str]) -> Partition:
    cal = Calibration(
        num_moe_layers=L,
        num_experts=E,
        transform="raw",
        idf=None,
        layer_mask=np.ones(L, dtype=bool),
    )
    c = np.zeros((2, L * E), dtype=np.float32)
    c[0, [0, 1, 4, 5]] = 0.5
    c[1, [2, 3, 6, 7]] = 0.5
    return Partition(
        version=version,
        model="m",
        calibration=cal,
        centroids=c,
        owners=np.array([0, 1]),
        workers=workers,
    )


async def test_router_hot_swaps_to_a_newly_announced_partition(
    bus: Bus, bus_settings: BusSettings, retention: RetentionSettings, topology: Topology
) -> None:
    await apply_topology(bus, topology)
    await announce(bus, locality_partition(1, ("d0", "d1")))  # before the router starts
    async with (
        reporting(bus, {"d0": 0, "d1": 0}),
        running_router(router_settings(bus_settings, retention, policy="eldr", tau=0.0)),
    ):
        # Prompts shorter than one block: the partial block is the whole signature, so the
        # router needs no signature service for them.

        def with_counts(rid: str, experts: list[int]) -> PrefillDone:
            x = np.zeros((L, E), dtype=np.uint32)
            x[:, experts] = 3
            base = prefill_done(rid)
            return PrefillDone(
                **{
                    **{f: getattr(base, f) for f in base.__struct_fields__},
                    "partial": SparseCounts.from_dense(x),
                }
            )

        stream = f"{bus.subjects.namespace.upper()}_{PARTITIONS}"
        assert (await bus.stream_state(stream)).messages == 1
        await asyncio.sleep(0.3)  # the loader runs off the request path
        await bus.js_publish(bus.subjects.prefill_done("p0"), with_counts("a", [0, 1]))
        [first] = await collect_decisions(bus, 1)
        await announce(bus, locality_partition(2, ("d1", "d0")))  # swap the owners
        await asyncio.sleep(0.5)
        await bus.js_publish(bus.subjects.prefill_done("p0"), with_counts("b", [0, 1]))
        decisions = await collect_decisions(bus, 2)
    second = next(d for d in decisions if d.request_id == "b")
    assert (first.partition_version, first.fallback, first.worker_id) == (1, None, "d0")
    assert (second.partition_version, second.fallback, second.worker_id) == (2, None, "d1")


async def test_control_switches_the_policy_of_every_replica(
    bus: Bus, bus_settings: BusSettings, retention: RetentionSettings
) -> None:
    s1 = router_settings(bus_settings, retention, instance_id="r1", policy="eldr")
    s2 = router_settings(bus_settings, retention, instance_id="r2", policy="eldr")
    async with reporting(bus, {"d0": 0}), running_router(s1), running_router(s2):
        replies = await bus.request_many(
            bus.subjects.control_router,
            RouterControl(policy="round_robin", tau=None, load_measure=None),
            RouterControlReply,
            timeout_s=1.0,
            max_replies=2,
        )
        await bus.js_publish(bus.subjects.prefill_done("p0"), prefill_done("c1"))
        [d] = await collect_decisions(bus, 1)
    assert sorted(r.router_id for r in replies if isinstance(r, RouterControlReply)) == ["r1", "r2"]
    assert d.policy == "round_robin"


async def test_control_sets_a_typed_profile_and_a_policy_switch_keeps_its_parameters(
    bus: Bus, bus_settings: BusSettings, retention: RetentionSettings
) -> None:
    start = EldrBoundedProfile(slack=0.3, widen_to=3)
    s = router_settings(bus_settings, retention, instance_id="r1", routing_profile=start)

    async def control(message: RouterControl) -> RouterControlReply | RemoteError:
        [reply] = await bus.request_many(
            bus.subjects.control_router, message, RouterControlReply, timeout_s=2.0, max_replies=1
        )
        return reply

    async with reporting(bus, {"d0": 0}), running_router(s):
        first = await control(RouterControl())
        assert isinstance(first, RouterControlReply)
        assert first.profile == start
        # The older fields switch policy and keep what the new one takes (widen_to).
        switched = await control(RouterControl(policy="eldr", tau=0.2))
        assert isinstance(switched, RouterControlReply)
        assert switched.profile == EldrProfile(tau=0.2, widen_to=3)
        # A parameter the policy does not take is refused; the profile stays.
        refused = await control(RouterControl(policy="jsq", tau=0.3))
        assert isinstance(refused, RemoteError)
        assert "takes no parameter tau" in str(refused)
        typed = EldrCostProfile(locality_weight=5.0, top_k=1)
        replaced = await control(RouterControl(profile=typed))
        assert isinstance(replaced, RouterControlReply)
        assert (replaced.profile, replaced.params) == (typed, typed.params())
        await bus.js_publish(bus.subjects.prefill_done("p0"), prefill_done("c1"))
        [d] = await collect_decisions(bus, 1)
    assert (d.v, d.policy, d.profile, d.params) == (4, "eldr_cost", typed, {})


async def test_a_request_waits_for_a_worker_past_the_ack_wait_without_redelivery(
    bus: Bus, bus_settings: BusSettings, retention: RetentionSettings
) -> None:
    """The router holds an event while no decode worker is live, telling JetStream it is in
    progress: it is neither redelivered nor dead-lettered however long the fleet is down."""
    quick = retention.model_copy(update={"router_ack_wait_s": 1.0, "router_max_deliver": 2})
    s = router_settings(bus_settings, quick, policy="jsq", no_worker_wait_s=60.0)
    async with running_router(s):
        await bus.js_publish(bus.subjects.prefill_done("p0"), prefill_done("patient"))
        await asyncio.sleep(3.5)  # 3.5 ack waits: without progress acks, past max_deliver
        async with reporting(bus, {"d9": 0}):
            [d] = await collect_decisions(bus, 1)
        state = await bus.consumer_state(f"{bus.subjects.namespace.upper()}_PREFILL", "router")
    assert d.worker_id == "d9"
    assert state.num_redelivered == 0
    dlq = await bus.stream_state(f"{bus.subjects.namespace.upper()}_DLQ")
    assert dlq.messages == 0


async def test_a_reply_to_outside_the_inboxes_is_not_answered(
    bus: Bus, bus_settings: BusSettings, retention: RetentionSettings
) -> None:
    """A PrefillDone naming another request's decision subject as its reply_to must not make
    the router write there (it has the rights to; the stream would record it)."""
    victim = bus.subjects.decision("victim")
    async with (
        reporting(bus, {"d0": 0}),
        running_router(router_settings(bus_settings, retention, policy="jsq")),
    ):
        await bus.js_publish(bus.subjects.prefill_done("p0"), prefill_done("attacker", victim))
        [d] = await collect_decisions(bus, 1)
    assert d.request_id == "attacker"
    forged = await bus.get_last(f"{bus.subjects.namespace.upper()}_{DECISIONS}", victim, Decision)
    assert forged is None


async def test_decisions_overlapping_their_commits_see_each_other(
    bus: Bus, bus_settings: BusSettings, retention: RetentionSettings, topology: Topology
) -> None:
    """A router takes a backlog of PrefillDones at once and decides them while the first
    commits are still unacknowledged: each decision is counted at decision time, so JSQ
    deals the backlog out evenly instead of sending most of it to whichever worker looked
    least loaded when the backlog arrived."""
    await apply_topology(bus, topology)
    for i in range(48):  # queued before the router starts: its first pull takes them all
        await bus.js_publish(bus.subjects.prefill_done("p0"), prefill_done(f"burst-{i}"))
    workers = {"d0": 0, "d1": 0, "d2": 0, "d3": 0}
    s = router_settings(bus_settings, retention, policy="jsq", stale_after_s=30.0)
    async with reporting(bus, workers, period_s=5.0), running_router(s):
        decisions = await collect_decisions(bus, 48)
    per_worker = [sum(d.worker_id == w for d in decisions) for w in workers]
    assert sum(per_worker) == 48
    assert max(per_worker) - min(per_worker) <= 1, per_worker
