"""The simulated decode workers (`eldr serve simdecode`) in-process against a real nats-server:
jobs in; load reports, decode summaries and statistics out; a draining shutdown."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import numpy as np
import pytest

from eldr.bus import Bus, Delivery
from eldr.core.workload.trace import expert_counts
from eldr.runtime import run_service
from eldr.settings import BusSettings, RetentionSettings
from eldr.wire import (
    DecodeJob,
    DecodeJobAck,
    DecodeJobDone,
    DecodeSummary,
    LoadReport,
    NdArray,
    SimStats,
    SimStatsRequest,
)
from eldr_services.simdecode.service import setup as simdecode_setup
from eldr_services.simdecode.settings import SimDecodeSettings

pytestmark = pytest.mark.integration

WAIT_S = 10.0
E = 16
L = 4
WORKERS = ("dA", "dB")


@dataclass
class Running:
    settings: SimDecodeSettings
    stop: asyncio.Event
    task: asyncio.Task[None]


ServiceFactory = Callable[..., Awaitable[Running]]


@pytest.fixture
async def simdecode(
    bus_settings: BusSettings, retention: RetentionSettings
) -> AsyncIterator[ServiceFactory]:
    started: list[Running] = []

    async def start(**overrides: object) -> Running:
        fields: dict[str, object] = {
            **bus_settings.model_dump(),
            **retention.model_dump(),
            "instance_id": "simdecode-test",
            "simdecode_workers": ",".join(WORKERS),
            "simdecode_num_experts": E,
            "simdecode_time_scale": 0.01,
            "simdecode_report_interval_s": 0.05,
            "simdecode_drain_grace_s": 5.0,
            **overrides,
        }
        settings = SimDecodeSettings(**fields)  # type: ignore[arg-type]
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
        ready_wait = asyncio.create_task(ready.wait())
        await asyncio.wait({task, ready_wait}, timeout=WAIT_S, return_when="FIRST_COMPLETED")
        ready_wait.cancel()
        if task.done():
            task.result()  # raises the service's startup error
        assert ready.is_set(), "simdecode did not become ready"
        running = Running(settings, stop, task)
        started.append(running)
        return running

    yield start
    for running in started:
        running.stop.set()
        await asyncio.wait_for(running.task, timeout=WAIT_S)


def job(request_id: str, worker: str, tokens: int = 5, seed: int = 0) -> DecodeJob:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, E, size=(tokens, L, 2)).astype(np.int16)
    return DecodeJob(
        request_id=request_id,
        worker_id=worker,
        model="m",
        prompt_tokens=7,
        decode_ids=NdArray.from_numpy(ids),
        label="math",
    )


class Inbox:
    """Messages of one type on a subject, awaitable by predicate."""

    def __init__(self) -> None:
        self.items: list[object] = []
        self._changed = asyncio.Condition()

    async def handler(self, message: object, _: Delivery) -> None:
        async with self._changed:
            self.items.append(message)
            self._changed.notify_all()

    async def wait_for(self, predicate: Callable[[object], bool]) -> object:
        async def find() -> object:
            async with self._changed:
                while True:
                    for item in self.items:
                        if predicate(item):
                            return item
                    await self._changed.wait()

        return await asyncio.wait_for(find(), timeout=WAIT_S)


async def listen(bus: Bus, subject: str, message_type: type) -> Inbox:
    inbox = Inbox()
    await bus.subscribe(subject, message_type, inbox.handler)
    return inbox


async def test_job_is_acknowledged_and_reported_as_admitted(
    simdecode: ServiceFactory, bus: Bus
) -> None:
    await simdecode()
    loads = await listen(bus, bus.subjects.load("dA"), LoadReport)
    ack = await bus.request(bus.subjects.sim_decode("dA"), job("r1", "dA"), DecodeJobAck)
    assert ack.accepted
    assert ack.request_id == "r1"
    report = await loads.wait_for(lambda r: "r1" in r.admitted)  # type: ignore[attr-defined]
    assert isinstance(report, LoadReport)
    assert report.worker_id == "dA"
    assert report.kv_capacity_tokens > 0
    assert not report.draining


async def test_admitted_id_appears_in_two_consecutive_reports(
    simdecode: ServiceFactory, bus: Bus
) -> None:
    await simdecode()
    loads = await listen(bus, bus.subjects.load("dA"), LoadReport)
    await bus.request(bus.subjects.sim_decode("dA"), job("r1", "dA", tokens=50), DecodeJobAck)
    first = await loads.wait_for(lambda r: "r1" in r.admitted)  # type: ignore[attr-defined]
    assert isinstance(first, LoadReport)
    second = await loads.wait_for(
        lambda r: r.seq == first.seq + 1  # type: ignore[attr-defined]
    )
    assert isinstance(second, LoadReport)
    assert "r1" in second.admitted
    assert second.incarnation == first.incarnation


async def test_finished_request_publishes_its_decode_summary(
    simdecode: ServiceFactory, bus: Bus
) -> None:
    await simdecode()
    profiles = await listen(bus, bus.subjects.profiles("dB"), DecodeSummary)
    sent = job("r2", "dB", tokens=6, seed=3)
    await bus.request(bus.subjects.sim_decode("dB"), sent, DecodeJobAck)
    profile = await profiles.wait_for(lambda p: p.request_id == "r2")  # type: ignore[attr-defined]
    assert isinstance(profile, DecodeSummary)
    assert profile.worker_id == "dB"
    assert profile.tokens == 6
    assert profile.tpot_s is not None
    assert profile.tpot_s > 0
    dense = np.zeros(profile.counts.shape, dtype=np.int64).ravel()
    dense[profile.counts.indices()] = profile.counts.values()
    expected = expert_counts(sent.decode_ids.to_numpy(), E)
    np.testing.assert_array_equal(dense.reshape(L, E), expected)


async def test_the_end_of_a_decode_goes_to_the_jobs_inbox_with_or_without_profiles(
    simdecode: ServiceFactory, bus: Bus
) -> None:
    # Like a real decode instance without the capture plugin: no profile, but the sender
    # (the simulated gateway) still learns when the response ended.
    await simdecode(simdecode_publish_profiles=False)
    profiles = await listen(bus, bus.subjects.profiles_all, DecodeSummary)
    inbox = bus.new_inbox()
    done = await listen(bus, inbox, DecodeJobDone)
    sent = job("r3", "dA", tokens=4)
    sent = DecodeJob(**{**{f: getattr(sent, f) for f in sent.__struct_fields__}, "done_to": inbox})
    await bus.request(bus.subjects.sim_decode("dA"), sent, DecodeJobAck)
    ended = await done.wait_for(lambda d: d.request_id == "r3")  # type: ignore[attr-defined]
    assert isinstance(ended, DecodeJobDone)
    assert (ended.worker_id, ended.reason, ended.output_tokens) == ("dA", "length", 4)
    await asyncio.sleep(0.3)
    assert profiles.items == []


async def test_every_worker_answers_stats_and_reset_clears_them(
    simdecode: ServiceFactory, bus: Bus
) -> None:
    await simdecode()
    profiles = await listen(bus, bus.subjects.profiles("dA"), DecodeSummary)
    await bus.request(bus.subjects.sim_decode("dA"), job("r3", "dA", tokens=4), DecodeJobAck)
    await profiles.wait_for(lambda p: p.request_id == "r3")  # type: ignore[attr-defined]
    replies = await bus.request_many(
        bus.subjects.sim_stats, SimStatsRequest(reset=True), SimStats, max_replies=len(WORKERS)
    )
    stats = {r.worker_id: r for r in replies if isinstance(r, SimStats)}
    assert sorted(stats) == sorted(WORKERS)
    assert stats["dA"].steps == 4
    assert stats["dA"].finished == 1
    assert stats["dA"].batch_sum == 4
    assert stats["dA"].union_per_layer_sum > 0
    assert stats["dA"].tpot_s.shape == [1]
    assert stats["dB"].steps == 0
    again = await bus.request_many(
        bus.subjects.sim_stats, SimStatsRequest(), SimStats, max_replies=len(WORKERS)
    )
    assert all(isinstance(r, SimStats) and r.steps == 0 and r.finished == 0 for r in again)


async def test_job_for_another_worker_is_refused_with_a_reason(
    simdecode: ServiceFactory, bus: Bus
) -> None:
    await simdecode()
    ack = await bus.request(bus.subjects.sim_decode("dA"), job("r4", "dB"), DecodeJobAck)
    assert not ack.accepted
    assert ack.reason is not None
    assert "dB" in ack.reason


async def test_shutdown_refuses_new_jobs_reports_draining_and_abandons_after_grace(
    simdecode: ServiceFactory, bus: Bus
) -> None:
    running = await simdecode(simdecode_time_scale=1.0, simdecode_drain_grace_s=0.3)
    loads = await listen(bus, bus.subjects.load("dA"), LoadReport)
    long_job = job("r5", "dA", tokens=10_000)  # hours of simulated decoding
    assert (await bus.request(bus.subjects.sim_decode("dA"), long_job, DecodeJobAck)).accepted
    running.stop.set()
    draining = await loads.wait_for(lambda r: r.draining)  # type: ignore[attr-defined]
    assert isinstance(draining, LoadReport)
    refused = await bus.request(bus.subjects.sim_decode("dA"), job("r6", "dA"), DecodeJobAck)
    assert not refused.accepted
    assert refused.reason == "draining"
    final = await loads.wait_for(
        lambda r: r.draining and r.running == 0  # type: ignore[attr-defined]
    )
    assert isinstance(final, LoadReport)
    await asyncio.wait_for(running.task, timeout=WAIT_S)
