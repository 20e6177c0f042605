"""Every inbound subject of every service, as a fuzz target: the bus path that receives it
(core subscription, request/reply service, durable consumer, ordered read-back) wired to the
service's real handler over a `FakeNats`, plus valid seed messages to mutate.

A target's `feed(data)` delivers one payload the way the bus would and returns the outcome
the bus recorded: rejected by size, rejected as invalid (both must be dead-lettered), handled,
or the handler raised.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
from prometheus_client import CollectorRegistry

from eldr.bus import REFUSAL_REASONS, Bus
from eldr.bus.consumer import Consumer
from eldr.bus.readback import ReadBack
from eldr.bus.receivers import Service, Subscription
from eldr.bus.topology import IDENTITY
from eldr.core.routing.profile import EldrCostProfile, EldrProfile
from eldr.core.signature.blocks import summarize_blocks, trace_token_ids
from eldr.core.workload.synthetic import SyntheticSpec, generate
from eldr.data.deployments import DEFAULT_DEPLOYMENT_FOR_TRACES, load_catalog
from eldr.runtime import ServiceContext
from eldr.wire import (
    AssembleReply,
    AssembleRequest,
    BlockSummaryBatch,
    BlockSummaryMsg,
    Decision,
    DecodeJob,
    DecodeSummary,
    LoadReport,
    Message,
    NdArray,
    PartitionAnnouncement,
    PrefillDone,
    RefitRequest,
    RequestFinished,
    RouterControl,
    SimStatsRequest,
    SparseCounts,
    encode,
)
from eldr_services.router.service import RouterService
from eldr_services.router.settings import RouterSettings
from eldr_services.signature.service import Replica
from eldr_services.signature.settings import SignatureSettings
from eldr_services.simdecode.host import HostConfig, SimDecodeHost
from eldr_services.simdecode.metrics import SimDecodeMetrics
from eldr_services.trainer.service import TrainerService
from eldr_services.trainer.settings import TrainerSettings

from .fakebus import FakeNats, core_msg, fake_bus, js_msg

NS = "fuzz"
L, E = 4, 16
WORKERS = ("w0", "w1")

Outcome = str
""""too_large", "invalid", "handled", "handler_error" or a refusal reason (a well-formed
message refused for what it claims, `eldr.bus.REFUSAL_REASONS`), from the bus metrics."""


@dataclass
class Target:
    name: str
    """`subject family/service`, e.g. `prefill.done/router`."""
    message_type: type[Message]
    bus: Bus
    nc: FakeNats
    registry: CollectorRegistry
    deliver: Callable[[bytes], Awaitable[None]]
    seeds: list[Message]
    family: str
    dlq_subject: str
    refusals_ok: bool = False
    """A request handler that refuses a well-formed but unacceptable request by raising
    (answered with an error reply, code 500, and counted as `handler_error`), e.g. a router
    control naming an unknown policy."""
    reply_path: bool = False
    """The fuzzed bytes are a reply the handler asked for: a bad one must cost the request
    its signature (a fallback), never its decision, so every case is `handled`."""

    def rejected(self, reason: str) -> float:
        # The counter itself: a registry lookup collects every metric, per case.
        counter = self.bus.metrics.rejected.labels(self.family, reason)
        return float(counter._value.get())

    def dead_letters(self) -> int:
        return len(self.nc.js.stored.get(self.dlq_subject, []))

    async def feed(self, data: bytes) -> Outcome:
        reasons = ("too_large", "invalid", "handler_error", *REFUSAL_REASONS)
        counts = {r: self.rejected(r) for r in reasons}
        await self.deliver(data)
        for reason, before in counts.items():
            if self.rejected(reason) > before:
                return reason
        return "handled"


# --- valid messages ------------------------------------------------------------------------


def _counts(rng: np.random.Generator) -> SparseCounts:
    dense = rng.integers(0, 3, size=(L, E)).astype(np.uint32)
    return SparseCounts.from_dense(dense)


def seed_messages() -> dict[type[Message], list[Message]]:
    """A few valid messages of every inbound type, in the fuzz geometry."""
    rng = np.random.default_rng(0)
    spec = SyntheticSpec(num_topics=2, num_moe_layers=L, num_experts=E, top_k=2)
    traces = generate(spec, 3, rng, id_prefix="seed")
    now = time.time()
    batches: list[Message] = []
    dones: list[Message] = []
    assembles: list[Message] = []
    for i, trace in enumerate(traces.traces):
        full, partial = summarize_blocks(trace_token_ids(trace), trace.prefill, 16, E)
        blocks = [
            BlockSummaryMsg(
                block_hash=int(b.block_hash),
                parent_hash=b.parent_hash,
                n_tokens=b.n_tokens,
                counts=SparseCounts.from_dense(b.counts),
            )
            for b in full
            if b.block_hash is not None
        ]
        part = SparseCounts.from_dense(partial.counts) if partial is not None else None
        batches.append(
            BlockSummaryBatch(
                worker_id="p0",
                seq=i,
                ts_s=now,
                model="m",
                num_moe_layers=L,
                num_experts=E,
                block_size=16,
                blocks=blocks,
            )
        )
        hashes = [b.block_hash for b in blocks]
        dones.append(
            PrefillDone(
                request_id=f"seed-{i}",
                model="m",
                prefill_worker="p0",
                ts_s=now,
                block_size=16,
                block_hashes=hashes,
                n_prompt_tokens=trace.prompt_tokens,
                partial=part,
                num_moe_layers=L,
                num_experts=E,
                reply_to="_INBOX.seed",
                cached_prefix_blocks=len(hashes) // 2,
                computed=_counts(rng) if i % 2 else None,
                attrs={"label": "x"},
            )
        )
        assembles.append(
            AssembleRequest(
                request_id=f"seed-{i}", model="m", block_hashes=hashes, partial=part, wait_ms=0
            )
        )
    decision = Decision(
        request_id="seed-0",
        ts_s=now,
        router_id="r0",
        model="m",
        worker_id="w0",
        policy="eldr",
        profile=EldrProfile(),
        partition_version=1,
        fallback=None,
        scores=[("w0", 0.9), ("w1", 0.5)],
        band=["w0"],
        loads=[("w0", 1.0), ("w1", 2.0)],
        signature=_counts(rng),
        missing_blocks=0,
        decide_s=0.001,
        rng_seed=7,
        fleet=[("w0", 1, 10), ("w1", 2, 20)],
        prompt_tokens=40,
    )
    report = LoadReport(
        worker_id="w0",
        incarnation="inc-1",
        seq=1,
        ts_s=now,
        running=2,
        waiting=1,
        kv_tokens=100,
        kv_capacity_tokens=10_000,
        admitted=["seed-0"],
    )
    profile = DecodeSummary(
        request_id="seed-0", worker_id="w0", ts_s=now, tokens=12, counts=_counts(rng), tpot_s=0.02
    )
    announcement = PartitionAnnouncement(
        version=3,
        model="m",
        object_name="v3",
        sha256="0" * 64,
        created_ts_s=now,
        k=2,
        dim=8,
        workers=list(WORKERS),
    )
    job = DecodeJob(
        request_id="seed-0",
        worker_id="w0",
        model="m",
        prompt_tokens=40,
        decode_ids=NdArray.from_numpy(rng.integers(0, E, size=(5, L, 2)).astype(np.int16)),
    )
    reply = AssembleReply(
        request_id="seed-0",
        counts=NdArray.from_numpy(rng.integers(0, 4, size=(L, E)).astype(np.uint32)),
        blocks_total=3,
        blocks_found=2,
        missing=[12345],
    )
    return {
        BlockSummaryBatch: batches,
        PrefillDone: dones,
        AssembleRequest: assembles,
        Decision: [decision],
        LoadReport: [report],
        DecodeSummary: [profile],
        PartitionAnnouncement: [announcement],
        RouterControl: [
            RouterControl(),
            RouterControl(policy="eldr", tau=0.2),
            RouterControl(profile=EldrCostProfile(locality_weight=60.0)),
        ],
        RefitRequest: [RefitRequest(reason="fuzz", k=2)],
        DecodeJob: [job],
        SimStatsRequest: [SimStatsRequest(reset=False)],
        AssembleReply: [reply],
        RequestFinished: [
            RequestFinished(
                request_id="seed-0",
                gateway_id="w0",
                ts_s=now,
                reason="stop",
                worker_id="w0",
                output_tokens=12,
                decode_s=0.3,
            ),
            RequestFinished(
                request_id="seed-1",
                gateway_id="w0",
                ts_s=now,
                reason="moved",
                worker_id="w0",
                moved_to="w1",
            ),
        ],
    }


# --- services over a fake bus --------------------------------------------------------------


def _ctx(bus: Bus, registry: CollectorRegistry, settings: Any, name: str) -> ServiceContext[Any]:
    return ServiceContext(
        name=name,
        settings=settings,
        bus=bus,
        registry=registry,
        stack=AsyncExitStack(),
        stopping=asyncio.Event(),
    )


def _common(**extra: Any) -> dict[str, Any]:
    return {"namespace": NS, "instance_id": "fuzz", **extra}


def _router(bus: Bus, registry: CollectorRegistry) -> RouterService:
    settings = RouterSettings(
        **_common(stale_after_s=1e5, pending_ttl_s=1e5, no_worker_wait_s=0.0, policy="eldr")
    )
    svc = RouterService(_ctx(bus, registry, settings, "router"))
    for wid in WORKERS:
        svc.table.on_report(_report(wid), time.monotonic())
    return svc


def _report(wid: str) -> Any:
    from eldr.core.routing.loadtable import Report

    return Report(
        worker_id=wid,
        incarnation="fuzz",
        seq=1,
        running=0,
        waiting=0,
        kv_tokens=0,
        kv_capacity_tokens=1000,
        admitted=(),
        draining=False,
    )


def _trainer(bus: Bus, registry: CollectorRegistry) -> TrainerService:
    settings = TrainerSettings(**_common(database_url="sqlite://", refit_interval_s=0))
    return TrainerService(_ctx(bus, registry, settings, "trainer"))


def _simdecode(bus: Bus, registry: CollectorRegistry) -> SimDecodeHost:
    cost = load_catalog().get(DEFAULT_DEPLOYMENT_FOR_TRACES)
    config = HostConfig(worker_ids=WORKERS, cost=cost, num_experts=E)
    return SimDecodeHost(bus, config, SimDecodeMetrics(registry))


TargetFactory = Callable[[dict[type[Message], list[Message]]], Target]


def _target(
    name: str,
    message_type: type[Message],
    subject: str,
    kind: str,
    handler_for: Callable[[Bus, CollectorRegistry], Callable[..., Awaitable[Any]]],
    seeds: dict[type[Message], list[Message]],
    *,
    stream: str = "FUZZ_STREAM",
    max_payload_bytes: int = 1 << 16,
    refusals_ok: bool = False,
) -> Target:
    bus, nc, registry = fake_bus(NS, max_payload_bytes=max_payload_bytes)
    handler = handler_for(bus, registry)
    family = bus.subjects.family(subject)
    # As the services subscribe: a message naming its sender is checked against the subject.
    identity = IDENTITY.get(message_type)
    deliver: Callable[[bytes], Awaitable[None]]
    if kind == "subscribe":
        sub: Subscription[Any] = Subscription(
            bus, subject, message_type, handler, identity=identity
        )

        async def deliver(data: bytes) -> None:
            await sub.on_msg(core_msg(nc, subject, data))

        dlq = bus.subjects.dlq("core")
    elif kind == "serve":
        service: Service[Any, Any] = Service(bus, subject, message_type, handler, 8)

        async def deliver(data: bytes) -> None:
            await service._handle(core_msg(nc, subject, data, reply="_INBOX.fuzz.reply"))

        dlq = bus.subjects.dlq("core")
    elif kind == "consume":
        consumer: Consumer[Any] = Consumer(
            bus,
            stream,
            "router",
            message_type,
            handler,
            next_subject="$JS.API.CONSUMER.MSG.NEXT.x.y",
            max_deliver=5,
            batch=1,
            max_concurrency=1,
            error_backoff_s=1.0,
            identity=identity,
        )

        async def deliver(data: bytes) -> None:
            await consumer._process(js_msg(nc, stream, "router", subject, data))

        dlq = bus.subjects.dlq(stream)
    elif kind == "read_back":
        reader: ReadBack[Any] = ReadBack(
            bus, stream, subject, message_type, handler, False, identity=identity
        )

        async def deliver(data: bytes) -> None:
            await reader.on_msg(js_msg(nc, stream, "ordered", subject, data))

        dlq = bus.subjects.dlq(stream)
    else:
        raise ValueError(kind)
    return Target(
        name=name,
        message_type=message_type,
        bus=bus,
        nc=nc,
        registry=registry,
        deliver=deliver,
        seeds=list(seeds[message_type]),
        family=family,
        dlq_subject=dlq,
        refusals_ok=refusals_ok,
    )


def _sig_reply_target(seeds: dict[type[Message], list[Message]]) -> Target:
    """The signature service's *reply* as the router receives it: a valid PrefillDone whose
    assembly request gets the fuzzed bytes as its answer."""
    from nats.aio.msg import Msg

    bus, nc, registry = fake_bus(NS, max_payload_bytes=1 << 16)
    router = _router(bus, registry)
    # Both ways a router uses a reply: the whole signature (no `computed`), and the cached
    # prefix added to what the prefill computed.
    dones = [m for m in seeds[PrefillDone] if isinstance(m, PrefillDone) and m.block_hashes]
    reply_data = {"data": b""}

    async def request(subject: str, payload: bytes = b"", timeout: float = 1.0) -> Msg:  # noqa: ASYNC109
        return Msg(_client=nc, subject="_INBOX.x", data=reply_data["data"])  # type: ignore[arg-type]

    nc.request = request  # type: ignore[method-assign]
    consumer: Consumer[Any] = Consumer(
        bus,
        "FUZZ_PREFILL",
        "router",
        PrefillDone,
        router.on_prefill_done,
        next_subject="$JS.API.CONSUMER.MSG.NEXT.x.y",
        max_deliver=5,
        batch=1,
        max_concurrency=1,
        error_backoff_s=1.0,
    )
    counter = {"n": 0}

    async def deliver(data: bytes) -> None:
        reply_data["data"] = data
        counter["n"] += 1
        done = dones[counter["n"] % len(dones)]
        event = msgspec.structs.replace(done, request_id=f"sigreply-{counter['n']}")
        subject = bus.subjects.prefill_done("p0")
        await consumer._process(js_msg(nc, "FUZZ_PREFILL", "router", subject, encode(event)))

    return Target(
        name="sig.assemble reply/router",
        message_type=AssembleReply,
        bus=bus,
        nc=nc,
        registry=registry,
        deliver=deliver,
        seeds=list(seeds[AssembleReply]),
        family=bus.subjects.family(bus.subjects.prefill_done("p0")),
        dlq_subject=bus.subjects.dlq("FUZZ_PREFILL"),
        reply_path=True,
    )


def build_targets() -> list[Target]:
    seeds = seed_messages()
    s = lambda family, token="w0": f"{NS}.{family}.{token}"  # noqa: E731

    def router_handler(attr: str) -> Callable[[Bus, CollectorRegistry], Any]:
        return lambda bus, reg: getattr(_router(bus, reg), attr)

    def trainer_handler(attr: str) -> Callable[[Bus, CollectorRegistry], Any]:
        return lambda bus, reg: getattr(_trainer(bus, reg), attr)

    def signature_handler(attr: str) -> Callable[[Bus, CollectorRegistry], Any]:
        def make(bus: Bus, reg: CollectorRegistry) -> Any:
            replica = Replica(SignatureSettings(**_common(max_wait_ms=0)), reg)
            for batch in seeds[BlockSummaryBatch]:
                assert isinstance(batch, BlockSummaryBatch)
                replica.state.ingest(batch)
            return getattr(replica, attr)

        return make

    def sim_job(bus: Bus, reg: CollectorRegistry) -> Any:
        host = _simdecode(bus, reg)

        async def handle(job: DecodeJob) -> Any:
            return host.submit("w0", job)

        return handle

    def sim_stats(bus: Bus, reg: CollectorRegistry) -> Any:
        host = _simdecode(bus, reg)

        async def handle(request: SimStatsRequest) -> Any:
            return host.stats("w0", reset=request.reset)

        return handle

    return [
        _target(
            "blocks/signature",
            BlockSummaryBatch,
            s("blocks", "p0"),
            "read_back",
            signature_handler("on_batch"),
            seeds,
        ),
        _target(
            "sig.assemble/signature",
            AssembleRequest,
            f"{NS}.sig.assemble",
            "serve",
            signature_handler("on_assemble"),
            seeds,
        ),
        _target(
            "prefill.done/router",
            PrefillDone,
            s("prefill.done", "p0"),
            "consume",
            router_handler("on_prefill_done"),
            seeds,
        ),
        _sig_reply_target(seeds),
        _target(
            "load/router",
            LoadReport,
            s("load"),
            "subscribe",
            router_handler("on_load_report"),
            seeds,
        ),
        _target(
            "decisions/router",
            Decision,
            s("decisions", "abc"),
            "subscribe",
            router_handler("on_decision"),
            seeds,
        ),
        _target(
            "finished/router",
            RequestFinished,
            s("finished"),
            "subscribe",
            router_handler("on_finished"),
            seeds,
        ),
        _target(
            "partition.active/router",
            PartitionAnnouncement,
            f"{NS}.partition.active",
            "read_back",
            router_handler("on_announcement"),
            seeds,
        ),
        _target(
            "control.router/router",
            RouterControl,
            f"{NS}.control.router",
            "serve",
            router_handler("on_control"),
            seeds,
            refusals_ok=True,
        ),
        _target(
            "decisions/trainer",
            Decision,
            s("decisions", "abc"),
            "read_back",
            trainer_handler("on_decision"),
            seeds,
        ),
        _target(
            "profiles/trainer",
            DecodeSummary,
            s("profiles"),
            "read_back",
            trainer_handler("on_summary"),
            seeds,
        ),
        _target(
            "finished/trainer",
            RequestFinished,
            s("finished"),
            "read_back",
            trainer_handler("on_finished"),
            seeds,
        ),
        _target(
            "load/trainer", LoadReport, s("load"), "read_back", trainer_handler("on_load"), seeds
        ),
        _target(
            "trainer.refit/trainer",
            RefitRequest,
            f"{NS}.trainer.refit",
            "serve",
            trainer_handler("on_refit_request"),
            seeds,
        ),
        _target("sim.decode/simdecode", DecodeJob, s("sim.decode"), "serve", sim_job, seeds),
        _target(
            "sim.stats/simdecode", SimStatsRequest, f"{NS}.sim.stats", "serve", sim_stats, seeds
        ),
    ]
