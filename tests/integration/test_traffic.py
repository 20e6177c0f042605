"""The traffic driver (simulated prefill worker + gateway) against a real nats-server.

`StandInRouter` below is NOT the routing service: it is a test double that consumes
PrefillDone events through the routers' durable consumer and answers with a round-robin
Decision, so the driver's side of the contract can be checked on its own.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest

from eldr.bus import ROUTER_CONSUMER, Bus, Delivery, Topology, apply_topology, stream_name
from eldr.bus.topology import BLOCKS, PREFILL
from eldr.core.signature.blocks import hash_chain, trace_token_ids
from eldr.core.workload.synthetic import SyntheticSpec, generate
from eldr.core.workload.trace import TraceSet, expert_counts
from eldr.runtime import run_service
from eldr.settings import BusSettings, RetentionSettings
from eldr.sim.traffic import TrafficConfig, TrafficDriver
from eldr.wire import (
    BlockSummaryBatch,
    DecodeJob,
    DecodeJobAck,
    LoadReport,
    PrefillDone,
    RequestFinished,
    SparseCounts,
)
from eldr_services.simdecode.service import setup as simdecode_setup
from eldr_services.simdecode.settings import SimDecodeSettings
from support import messages

pytestmark = pytest.mark.integration

WAIT_S = 10.0
WORKERS = ("dA", "dB")
BLOCK = 4
SPEC = SyntheticSpec(
    num_topics=2,
    num_moe_layers=3,
    num_experts=8,
    top_k=2,
    prompt_len_range=(1, 9),
    decode_len_range=(2, 4),
    shared_prefix_blocks=2,
    block_size=BLOCK,
)


@pytest.fixture(autouse=True)
async def streams(bus: Bus, topology: Topology) -> None:
    """The namespace's streams and the routers' consumer (services apply them at start)."""
    await apply_topology(bus, topology)


@pytest.fixture(scope="module")
def traces() -> TraceSet:
    return generate(SPEC, 12, np.random.default_rng(7))


def dense(counts: SparseCounts) -> np.ndarray:
    out = np.zeros(counts.shape[0] * counts.shape[1], dtype=np.int64)
    out[counts.indices()] = counts.values()
    return out.reshape(counts.shape)


class StandInRouter:
    """Test double for the router: round-robin decisions, first write wins."""

    def __init__(self, bus: Bus, *, reply: bool = True, reply_twice: bool = False) -> None:
        self.bus = bus
        self.reply = reply
        self.reply_twice = reply_twice
        self.events: list[PrefillDone] = []
        self._next = itertools.cycle(WORKERS)
        self._arrived = asyncio.Condition()

    async def start(self) -> None:
        await self.bus.consume(
            stream_name(self.bus.settings.namespace, PREFILL),
            ROUTER_CONSUMER,
            PrefillDone,
            self.handle,
        )

    async def wait_events(self, n: int) -> None:
        async def reached() -> None:
            async with self._arrived:
                await self._arrived.wait_for(lambda: len(self.events) >= n)

        await asyncio.wait_for(reached(), timeout=WAIT_S)

    async def handle(self, event: PrefillDone, _: Delivery) -> None:
        async with self._arrived:
            self.events.append(event)
            self._arrived.notify_all()
        decision = messages.decision(
            event.request_id,
            next(self._next),
            router_id="stand-in",
            model=event.model,
            policy="round_robin",
        )
        await self.bus.js_publish(
            self.bus.subjects.decision(event.request_id), decision, expected_last_subject_seq=0
        )
        if self.reply and event.reply_to:
            for _ in range(2 if self.reply_twice else 1):
                await self.bus.publish(event.reply_to, decision)


@pytest.fixture
async def simdecode(bus_settings: BusSettings, retention: RetentionSettings) -> AsyncIterator[None]:
    settings = SimDecodeSettings(
        **bus_settings.model_dump(),
        **retention.model_dump(),
        instance_id="simdecode-test",
        simdecode_workers=",".join(WORKERS),
        simdecode_num_experts=SPEC.num_experts,
        simdecode_time_scale=0.01,
        simdecode_report_interval_s=0.05,
    )
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(
        run_service(
            "simdecode",
            settings,
            simdecode_setup,
            stop=stop,
            ready=ready,
            install_signal_handlers=False,
        )
    )
    await asyncio.wait_for(ready.wait(), timeout=WAIT_S)
    yield
    stop.set()
    await asyncio.wait_for(task, timeout=WAIT_S)


def config(**overrides: object) -> TrafficConfig:
    fields: dict[str, object] = {
        "prefill_worker": "p0",
        "block_size": BLOCK,
        "rate_per_s": None,
        "seed": 1,
        "decision_timeout_s": 5.0,
        "send_jobs": False,
    }
    fields.update(overrides)
    return TrafficConfig(**fields)  # type: ignore[arg-type]


async def published_batches(bus: Bus) -> list[BlockSummaryBatch]:
    batches: list[BlockSummaryBatch] = []

    async def keep(batch: BlockSummaryBatch, _: Delivery) -> None:
        batches.append(batch)

    reader = await bus.read_back(
        stream_name(bus.settings.namespace, BLOCKS),
        bus.subjects.blocks("p0"),
        BlockSummaryBatch,
        keep,
        stop_at_end=True,
    )
    await reader.wait_caught_up(WAIT_S)
    return batches


async def test_blocks_are_published_once_each_with_the_requests_hashes(
    bus: Bus, traces: TraceSet
) -> None:
    router = StandInRouter(bus)
    await router.start()
    async with TrafficDriver(bus, traces, config()) as driver:
        summary = await driver.run(30)
    assert summary.decided == 30
    batches = await published_batches(bus)
    hashes = [b.block_hash for batch in batches for b in batch.blocks]
    assert len(hashes) == len(set(hashes)), "a cached block was published again"
    expected: set[int] = set()
    for record in driver.records:
        trace = traces.traces[record.trace_index]
        expected |= set(hash_chain(trace_token_ids(trace), BLOCK))
    assert set(hashes) == expected
    assert [batch.seq for batch in batches] == list(range(len(batches)))
    # 30 requests over 12 traces of 2 topics: the shared prefixes were served from "cache".
    assert summary.blocks_published < sum(
        traces.traces[r.trace_index].prompt_tokens // BLOCK for r in driver.records
    )


async def test_prefill_done_carries_hashes_partial_inbox_and_label(
    bus: Bus, traces: TraceSet
) -> None:
    router = StandInRouter(bus)
    await router.start()
    async with TrafficDriver(bus, traces, config()) as driver:
        await driver.run(10)
        inbox = driver.inbox
        records = {r.request_id: r for r in driver.records}
    assert sorted(e.request_id for e in router.events) == sorted(records)
    for event in router.events:
        trace = traces.traces[records[event.request_id].trace_index]
        tokens = trace_token_ids(trace)
        assert event.block_hashes == hash_chain(tokens, BLOCK)
        assert event.n_prompt_tokens == trace.prompt_tokens
        n_full = trace.prompt_tokens // BLOCK * BLOCK
        if n_full == trace.prompt_tokens:
            assert event.partial is None
        else:
            assert event.partial is not None
            expected = expert_counts(trace.prefill[n_full:], SPEC.num_experts)
            np.testing.assert_array_equal(dense(event.partial), expected)
        assert event.reply_to == inbox
        assert event.attrs == {"label": trace.label}
        assert event.prefill_worker == "p0"
        assert event.max_tokens == trace.decode_tokens


@pytest.mark.parametrize(
    ("overrides", "local"),
    [
        ({}, "all"),
        ({"local_summary_blocks": 5, "max_in_flight": 1}, "some"),
        ({"local_signatures": False}, "none"),
    ],
)
async def test_a_prefix_hit_on_blocks_it_holds_carries_the_whole_signature(
    bus: Bus, traces: TraceSet, overrides: dict[str, object], local: str
) -> None:
    """The driver plays a prefill worker that keeps a summary of every block it computed
    (or of its last `local_summary_blocks`): a prefix hit on held blocks sends the whole
    prompt's counts (`signature`); other hits send `computed` for the service to complete."""
    router = StandInRouter(bus)
    await router.start()
    async with TrafficDriver(bus, traces, config(**overrides)) as driver:
        summary = await driver.run(30)
        records = {r.request_id: r for r in driver.records}
    assert summary.decided == 30
    by_source: dict[str, int] = {}
    for event in router.events:
        trace = traces.traces[records[event.request_id].trace_index]
        whole = expert_counts(trace.prefill, SPEC.num_experts)
        source = event.signature_source
        by_source[source] = by_source.get(source, 0) + 1
        assert records[event.request_id].signature_source == source
        if event.signature is not None:
            assert event.cached_prefix_blocks > 0
            assert event.computed is None
            np.testing.assert_array_equal(dense(event.signature), whole)
        elif event.cached_prefix_blocks == 0 and event.block_hashes:
            assert source == "computed"
            assert event.computed is not None
            np.testing.assert_array_equal(dense(event.computed), whole)
    assert summary.signature_sources == dict(sorted(by_source.items()))
    assert sum(by_source.values()) == 30
    if local == "all":
        assert by_source.get("service", 0) == 0
        assert by_source["event"] > 0
    elif local == "some":
        assert by_source["service"] > 0
        assert by_source["event"] > 0
    else:
        assert "event" not in by_source
        assert by_source["service"] > 0


async def test_decode_jobs_reach_the_chosen_simulated_workers(
    bus: Bus, traces: TraceSet, simdecode: None
) -> None:
    admitted: set[str] = set()
    expected: set[str] = set()
    all_admitted = asyncio.Event()

    async def on_load(report: LoadReport, _: Delivery) -> None:
        admitted.update(report.admitted)
        if expected and expected <= admitted:
            all_admitted.set()

    await bus.subscribe(bus.subjects.load_all, LoadReport, on_load)
    router = StandInRouter(bus)
    await router.start()
    async with TrafficDriver(bus, traces, config(send_jobs=True, rate_per_s=200.0)) as driver:
        summary = await driver.run(12)
        ids = {r.request_id for r in driver.records}
    assert summary.jobs_accepted == 12
    assert summary.errors == 0
    assert summary.per_worker == {"dA": 6, "dB": 6}
    assert summary.latency_p50_ms > 0
    expected.update(ids)
    if expected <= admitted:
        all_admitted.set()
    await asyncio.wait_for(all_admitted.wait(), timeout=WAIT_S)


async def test_every_replayed_request_ends_in_one_finish_event(
    bus: Bus, traces: TraceSet, simdecode: None
) -> None:
    # The simulated gateway publishes what the real one does: one RequestFinished per
    # request when its (simulated) decode response ends.
    events: dict[str, list[RequestFinished]] = {}
    got_all = asyncio.Event()

    async def on_finished(event: RequestFinished, delivery: Delivery) -> None:
        assert delivery.subject == bus.subjects.finished("p0")
        events.setdefault(event.request_id, []).append(event)
        if len(events) == 12:
            got_all.set()

    await bus.subscribe(bus.subjects.finished_all, RequestFinished, on_finished)
    router = StandInRouter(bus)
    await router.start()
    async with TrafficDriver(bus, traces, config(send_jobs=True, rate_per_s=200.0)) as driver:
        await driver.run(12)
        ids = {r.request_id for r in driver.records}
        await asyncio.wait_for(got_all.wait(), timeout=WAIT_S)
    assert set(events) == ids
    records = {r.request_id: r for r in driver.records}
    for rid, (event, *more) in events.items():
        assert more == []
        record = records[rid]
        assert (event.reason, event.worker_id, event.gateway_id) == (
            "length",
            record.worker_id,
            "p0",
        )
        assert event.output_tokens == traces.traces[record.trace_index].decode_tokens
        assert event.decode_s is not None


async def test_decision_is_read_from_the_stream_when_the_reply_is_lost(
    bus: Bus, traces: TraceSet
) -> None:
    router = StandInRouter(bus, reply=False)
    await router.start()
    async with TrafficDriver(bus, traces, config(decision_timeout_s=0.3)) as driver:
        summary = await driver.run(3)
    assert summary.decided == 3
    assert summary.recovered == 3
    assert summary.lost == 0
    assert all(r.worker_id in WORKERS for r in driver.records)


async def test_request_without_any_decision_is_counted_lost(bus: Bus, traces: TraceSet) -> None:
    async with TrafficDriver(bus, traces, config(decision_timeout_s=0.2)) as driver:
        summary = await driver.run(2)
    assert summary.sent == 2
    assert summary.lost == 2
    assert summary.decided == 0
    assert summary.errors == 2


async def test_duplicate_replies_are_counted_not_double_decided(bus: Bus, traces: TraceSet) -> None:
    router = StandInRouter(bus, reply_twice=True)
    await router.start()
    async with TrafficDriver(bus, traces, config()) as driver:
        summary = await driver.run(5)
        deadline = time.monotonic() + WAIT_S
        # No event marks "the trailing second replies were handled": poll briefly.
        while driver.duplicate_replies < 5 and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.01)  # the second replies may trail the run's end
    assert summary.decided == 5
    assert driver.duplicate_replies == 5
    assert driver.conflicting_replies == 0


async def test_same_seed_plans_the_same_requests(bus: Bus, traces: TraceSet) -> None:
    a = TrafficDriver(bus, traces, config(rate_per_s=50.0, seed=3))
    b = TrafficDriver(bus, traces, config(rate_per_s=50.0, seed=3))
    (ia, oa), (ib, ob) = a.plan(20), b.plan(20)
    np.testing.assert_array_equal(ia, ib)
    np.testing.assert_allclose(oa, ob)
    assert oa[0] == 0.0
    assert np.all(np.diff(oa) >= 0)


async def test_job_refusal_is_recorded(bus: Bus, traces: TraceSet) -> None:
    async def refuse(job: DecodeJob) -> DecodeJobAck:
        return DecodeJobAck(request_id=job.request_id, accepted=False, reason="full")

    for worker in WORKERS:
        await bus.serve(bus.subjects.sim_decode(worker), None, DecodeJob, refuse)
    router = StandInRouter(bus)
    await router.start()
    async with TrafficDriver(bus, traces, config(send_jobs=True)) as driver:
        summary = await driver.run(2)
    assert summary.jobs_refused == 2
    assert all("full" in (r.error or "") for r in driver.records)


async def test_simprefill_service_replays_its_count_and_stops(
    bus: Bus, bus_settings: BusSettings, retention: RetentionSettings
) -> None:
    from eldr_services.simprefill.service import setup as simprefill_setup
    from eldr_services.simprefill.settings import SimPrefillSettings

    router = StandInRouter(bus)
    await router.start()
    settings = SimPrefillSettings(
        **bus_settings.model_dump(),
        **retention.model_dump(),
        instance_id="simprefill-test",
        simprefill_synthetic_requests=8,
        simprefill_synthetic_layers=2,
        simprefill_synthetic_experts=8,
        simprefill_rate_per_s=0.0,
        simprefill_count=5,
        simprefill_send_jobs=False,
    )
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(
        run_service(
            "simprefill",
            settings,
            simprefill_setup,
            stop=stop,
            ready=ready,
            install_signal_handlers=False,
        )
    )
    await asyncio.wait_for(ready.wait(), timeout=WAIT_S)
    await router.wait_events(5)
    stop.set()
    await asyncio.wait_for(task, timeout=WAIT_S)
    assert len(router.events) == 5
    assert len({e.request_id for e in router.events}) == 5
