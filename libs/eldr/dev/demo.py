"""`eldr demo`: the whole pipeline on one machine, the load-only baselines against ELDR.

1. Start the local stack (`eldr.dev.stack`): embedded nats-server, SQLite (or the given
   database), 2 signature replicas, the trainer, simulated decode workers, 2 routers.
2. Calibration: replay a calibration set of requests under round-robin, so the trainer sees
   signatures (from the decision records) and decode summaries (from the workers).
3. Refit: ask the trainer for a partition; wait until every router has loaded it.
4. Evaluation: replay the *same* evaluation requests at the same arrival times under each
   policy in turn, and compare what the simulated decode workers measured: distinct experts
   per MoE layer per step, TPOT P50/P99, plus decisions, fallbacks and decision latency.
   The arrivals are drawn as `eldr bench` draws them (`eldr.core.workload.arrivals`): no
   request again while an earlier copy of it is still decoding, where the evaluation pool
   allows (otherwise the report says how many were forced), since two identical requests
   on one worker share every expert and flatter a locality policy. Each policy is compared
   with the best load-only baseline of each statistic (lowest union, lowest TPOT P50,
   lowest TPOT P99 among round-robin, random, JSQ and P2C), each named.

The decode workers are simulated (no GPU here): each step costs what the cost model says for
the experts its batch really activates, in real time (`--time-scale` stretches it). The
input is synthetic unless `--traces` is given, and the report says which.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from eldr.bus import Bus, BusError, Delivery, RemoteError, Subscription, stream_name
from eldr.bus.topology import DECISIONS
from eldr.core.costmodel import Deployment
from eldr.core.routing.profile import (
    DEFAULT_PROFILE,
    LOAD_ONLY_PROFILES,
    PAPER_PROFILE,
    ProfileBase,
    RoundRobinProfile,
    as_routing_profile,
    decode_profile,
    encode_profile,
    params_taken,
    profile_from_params,
)
from eldr.core.stats import best_baselines as core_best_baselines
from eldr.core.workload.arrivals import (
    ArrivalDraw,
    copy_overlap,
    draw_apart,
    draw_with_replacement,
)
from eldr.core.workload.sizing import (
    expected_step_s,
    rates_for_batch_targets,
    stratified_split,
)
from eldr.core.workload.synthetic import SyntheticSpec, generate
from eldr.core.workload.synthetic_fit import FITTED_SPEC
from eldr.core.workload.trace import TraceSet
from eldr.data.deployments import DEFAULT_DEPLOYMENT_FOR_TRACES, load_catalog
from eldr.dev.stack import Stack, StackConfig
from eldr.progress import NO_PROGRESS, Progress, terminal_progress
from eldr.runtime import run_async
from eldr.settings import BusSettings
from eldr.sim.traffic import TrafficConfig, TrafficDriver, TrafficSummary
from eldr.wire import (
    RefitReply,
    RefitRequest,
    RequestFinished,
    RouterControl,
    RouterControlReply,
    SimStats,
    SimStatsRequest,
)

log = logging.getLogger(__name__)

BASELINES: tuple[str, ...] = tuple(p.name for p in LOAD_ONLY_PROFILES)
"""The load-only baselines; every other policy is compared with the best of them."""
STATISTICS: tuple[str, ...] = ("union", "tpot_p50", "tpot_p99")
"""What a policy is compared on, each against its own best baseline."""
FINISH_GRACE_S = 0.3
"""After a pass, how long the demo keeps listening for its last finish events."""


@dataclass(frozen=True)
class DemoConfig:
    traces: Path | None = None
    """Trace directory (`<label>/<n>.json`); None = a synthetic workload."""
    num_experts: int | None = None
    synthetic_requests: int = 600
    synthetic_spec: SyntheticSpec | None = None
    """The synthetic workload; None = the one fitted to the real traces
    (`eldr.core.workload.synthetic_fit.FITTED_SPEC`)."""
    decoders: int = 8
    calibration_requests: int = 600
    evaluation_requests: int = 1500
    target_batch: float = 16.0
    """Arrival rate chosen so that a worker holds about this many requests (Little's law)."""
    rate_per_s: float | None = None
    """Explicit arrival rate; overrides target_batch."""
    time_scale: float = 1.0
    policies: tuple[ProfileBase, ...] = (*LOAD_ONLY_PROFILES, PAPER_PROFILE, DEFAULT_PROFILE)
    """Routing profiles compared on the same requests: the load-only ones among them
    (`BASELINES`) are the baselines; `eldr` is the paper's locality band, `eldr_band_cost`
    the router's default (docs/ONLINE.md)."""
    arrivals_apart: bool = True
    """Keep copies of one evaluation request apart (`draw_apart`); False: with replacement."""
    seed: int = 0
    deployment: str = DEFAULT_DEPLOYMENT_FOR_TRACES
    database_url: str | None = None
    nats_url: str | None = None
    namespace: str | None = None
    state_dir: Path = Path(".eldr")
    signature_replicas: int = 2
    router_replicas: int = 2
    echo_services: bool = False
    service_log_level: str = "WARNING"
    max_batch: int = 64
    """Most requests a simulated decode worker runs at once (`ELDR_SIMDECODE_MAX_BATCH`)."""
    report_interval_s: float = 0.1
    """Load-report period of the simulated decode workers (`ELDR_SIMDECODE_REPORT_INTERVAL_S`)."""


@dataclass
class PolicyResult:
    policy: str
    sent: int
    decided: int
    lost: int
    conflicting: int
    fallbacks: dict[str, int]
    decision_latency_p50_ms: float
    decision_latency_p99_ms: float
    expert_union_mean: float
    batch_mean: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    finished: int
    per_worker: dict[str, int] = field(default_factory=dict)
    params: dict[str, float | int | str] = field(default_factory=dict)
    """The profile's parameters (`ProfileBase.params`)."""
    copies_in_flight_share: float | None = None
    """Share of its arrivals that decoded while a copy of the same request decoded (any
    worker), from the finish events; None: not measured."""
    copies_same_worker_share: float | None = None
    """... on the same worker (where a copy shares every expert)."""

    def statistics(self) -> tuple[float, float, float]:
        """(union, TPOT P50, TPOT P99), the compared statistics (`STATISTICS`)."""
        return self.expert_union_mean, self.tpot_p50_ms, self.tpot_p99_ms


@dataclass
class DemoResult:
    input: dict[str, Any]
    rate_per_s: float
    partition_version: int | None
    refit_message: str
    calibration: dict[str, Any]
    requests_sent: int
    """PrefillDone events published over the whole demo (calibration + evaluation)."""
    decisions_recorded: int
    """Decisions in the DECISIONS stream: equal to requests_sent when every request was
    decided exactly once."""
    results: list[PolicyResult]
    wall_s: float
    arrivals: dict[str, Any] = field(default_factory=dict)
    """How the evaluation arrivals were drawn (`ArrivalDraw.describe`)."""

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["against_best_baseline_pct"] = against_best_baseline(
            {r.policy: r.statistics() for r in self.results}
        )
        return out


def best_baselines(stats: dict[str, tuple[float, float, float]]) -> dict[str, str]:
    """The best load-only baseline of each statistic among those in `stats` (policy ->
    (union, TPOT P50, TPOT P99)), by `eldr bench`'s rule (`core.stats.best_baselines`).
    Empty when no baseline ran."""
    named = {policy: dict(zip(STATISTICS, values, strict=True)) for policy, values in stats.items()}
    return core_best_baselines(named, BASELINES)


def against_best_baseline(
    stats: dict[str, tuple[float, float, float]],
) -> dict[str, dict[str, Any]]:
    """Each policy that is not a baseline against the best baseline of each statistic:
    policy -> {statistic: percent change, statistic + "_baseline": the baseline's name}."""
    best = best_baselines(stats)
    out: dict[str, dict[str, Any]] = {}
    if not best:
        return out
    for policy, values in stats.items():
        if policy in BASELINES:
            continue
        row: dict[str, Any] = {}
        for i, stat in enumerate(STATISTICS):
            base = stats[best[stat]][i]
            row[stat] = round(100.0 * (values[i] / base - 1.0), 2) if base else float("nan")
            row[f"{stat}_baseline"] = best[stat]
        out[policy] = row
    return out


def with_baselines(profiles: tuple[ProfileBase, ...]) -> tuple[ProfileBase, ...]:
    """`profiles` after the load-only baselines they lack (so that each statistic has its
    best baseline to be compared with)."""
    named = {p.name for p in profiles}
    return (*(p for p in LOAD_ONLY_PROFILES if p.name not in named), *profiles)


def evaluation_draw(
    config: DemoConfig, traces: TraceSet, pool: np.ndarray, cost: Deployment, rate_per_s: float
) -> ArrivalDraw:
    """Which evaluation request arrives when, identical for every policy's pass.

    Poisson arrivals at `rate_per_s` (real seconds); each request is held for its decode
    tokens x the step time the cost model expects at this load (in simulated seconds, x the
    time scale), as `eldr bench` holds it; `pool`: indices into `traces`."""
    rng = np.random.default_rng([config.seed, 1])
    arrival_s = np.cumsum(rng.exponential(1.0 / rate_per_s, size=config.evaluation_requests))
    arrival_s -= arrival_s[0] if arrival_s.size else 0.0
    step_s = expected_step_s(cost, traces, config.decoders, rate_per_s * config.time_scale)
    tokens = np.array([t.decode_tokens for t in traces.traces], dtype=np.float64)
    hold_s = tokens * step_s * config.time_scale
    draw = draw_apart if config.arrivals_apart else draw_with_replacement
    return draw(pool, hold_s, arrival_s, np.random.default_rng([config.seed, 3]))


class FinishClock:
    """When each request of a pass decoded, from the finish events the driver publishes
    as the gateway does: (job sent, last token reported, worker)."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.decoded: dict[str, tuple[float, float, str]] = {}
        self._sub: Subscription | None = None

    async def __aenter__(self) -> FinishClock:
        self._sub = await self.bus.subscribe(
            self.bus.subjects.finished_all, RequestFinished, self._on_finished
        )
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._sub is not None:
            await self._sub.stop()

    async def _on_finished(self, msg: RequestFinished, _: Delivery) -> None:
        if msg.decode_s is not None and msg.worker_id is not None:
            self.decoded[msg.request_id] = (msg.ts_s - msg.decode_s, msg.ts_s, msg.worker_id)

    def copies(self, driver: TrafficDriver) -> tuple[float, float] | None:
        """(in flight anywhere, on the same worker): the shares of the pass's decoded
        requests whose decode overlapped a copy's (`copy_overlap`); None: none decoded."""
        rows = [
            (r.trace_index, *self.decoded[r.request_id])
            for r in driver.records
            if r.request_id in self.decoded
        ]
        if not rows:
            return None
        workers = sorted({w for *_, w in rows})
        overlap = copy_overlap(
            np.array([t for t, *_ in rows], dtype=np.int64),
            np.array([workers.index(w) for *_, w in rows], dtype=np.int64),
            np.array([start for _, start, _, _ in rows]),
            np.array([end for _, _, end, _ in rows]),
            measured_from=0,
        )
        return overlap.in_flight_share, overlap.same_worker_share


def load_input(config: DemoConfig) -> TraceSet:
    if config.traces is not None:
        from eldr.data.traces import load_trace_dir

        return load_trace_dir(config.traces, num_experts=config.num_experts)
    # Fitted to the real Llama-4-Maverick traces (`eldr.core.workload.synthetic_fit.FITTED_SPEC`):
    # their routing geometry (the model of the default deployment), topics, skew,
    # correlation and lengths.
    spec = config.synthetic_spec or FITTED_SPEC
    return generate(spec, config.synthetic_requests, np.random.default_rng(config.seed))


async def _routers(bus: Bus, control: RouterControl, expected: int) -> list[RouterControlReply]:
    replies = await bus.request_many(
        bus.subjects.control_router,
        control,
        RouterControlReply,
        timeout_s=2.0,
        max_replies=expected,
    )
    return [r for r in replies if isinstance(r, RouterControlReply)]


async def set_profile(bus: Bus, profile: ProfileBase, routers: int) -> None:
    """Every router routes with `profile` from now on."""
    control = RouterControl(profile=as_routing_profile(profile))
    replies = await _routers(bus, control, routers)
    if len(replies) != routers or any(r.profile != profile for r in replies):
        raise RuntimeError(f"could not switch {routers} routers to {profile}: {replies}")


async def wait_for_partition(bus: Bus, version: int, routers: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    query = RouterControl(policy=None, tau=None, load_measure=None)
    while True:
        replies = await _routers(bus, query, routers)
        if len(replies) == routers and all(r.partition_version == version for r in replies):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"routers did not load partition version {version}: {replies}")
        await asyncio.sleep(0.2)


async def worker_stats(bus: Bus, decoders: int, reset: bool = False) -> list[SimStats]:
    replies = await bus.request_many(
        bus.subjects.sim_stats,
        SimStatsRequest(reset=reset),
        SimStats,
        timeout_s=2.0,
        max_replies=decoders,
    )
    return [r for r in replies if isinstance(r, SimStats)]


async def wait_idle(bus: Bus, decoders: int, timeout_s: float) -> None:
    """Wait until every simulated decode worker has finished its requests."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = await worker_stats(bus, decoders)
        if len(stats) == decoders and all(s.running == 0 and s.waiting == 0 for s in stats):
            return
        if time.monotonic() > deadline:
            raise TimeoutError("decode workers still busy")
        await asyncio.sleep(0.2)


def summarize_workers(stats: list[SimStats]) -> dict[str, float]:
    steps = sum(s.steps for s in stats)
    tpot = np.concatenate([s.tpot_s.to_numpy() for s in stats]) if stats else np.zeros(0)
    return {
        "expert_union_mean": sum(s.union_per_layer_sum for s in stats) / steps if steps else 0.0,
        "batch_mean": sum(s.batch_sum for s in stats) / steps if steps else 0.0,
        "tpot_p50_ms": float(np.percentile(tpot, 50) * 1e3) if tpot.size else float("nan"),
        "tpot_p99_ms": float(np.percentile(tpot, 99) * 1e3) if tpot.size else float("nan"),
        "finished": float(sum(s.finished for s in stats)),
    }


class DemoObserver(Protocol):
    """Hooks into a demo run (`eldr compare-live` records what the live stack did)."""

    def on_stack(self, stack: Stack) -> None:
        """The local stack is up (its processes and their metrics URLs)."""

    async def on_start(self, bus: Bus, evaluation: TraceSet, rate_per_s: float) -> None:
        """Before calibration: the evaluation pool and the arrival rate."""

    async def on_partition(self, bus: Bus, version: int) -> None:
        """Every router has loaded partition `version`."""

    async def before_pass(self, bus: Bus, policy: str) -> None:
        """The routers run `policy`; its evaluation pass starts next."""

    async def after_pass(
        self, bus: Bus, policy: str, driver: TrafficDriver, summary: TrafficSummary
    ) -> None:
        """Its evaluation pass is over: every request decoded and its finish published."""


async def _with_progress(
    run: Awaitable[TrafficSummary], driver: TrafficDriver, progress: Progress
) -> TrafficSummary:
    """Await a replay run, advancing `progress` by the requests it starts."""
    task = asyncio.ensure_future(run)
    shown = 0
    while not task.done():
        await asyncio.wait({task}, timeout=0.25)
        now = driver.started_requests
        progress.advance(now - shown)
        shown = now
    return task.result()


async def drive(
    config: DemoConfig,
    settings: BusSettings,
    traces: TraceSet,
    observer: DemoObserver | None = None,
    progress: Progress = NO_PROGRESS,
) -> DemoResult:
    started = time.perf_counter()
    cal_idx, ev_idx = stratified_split(
        [t.label for t in traces.traces], 0.4, np.random.default_rng(config.seed)
    )
    cal, ev = traces.subset(cal_idx.tolist()), traces.subset(ev_idx.tolist())
    cost = load_catalog().get(config.deployment)
    rate = (
        config.rate_per_s
        or rates_for_batch_targets(cost, traces, config.decoders, [config.target_batch])[0]
        / config.time_scale
    )
    draw = evaluation_draw(config, traces, ev_idx, cost, rate)
    # The driver indexes the evaluation subset, in `ev_idx` order.
    position = {int(i): n for n, i in enumerate(ev_idx)}
    planned = (np.array([position[int(r)] for r in draw.requests]), draw.arrival_s)
    if not draw.apart:
        log.warning(
            "evaluation arrivals: %s (pool %d, about %.0f in flight): %.1f%% of arrivals "
            "drawn while every request had a copy in flight",
            draw.method,
            draw.pool_size,
            draw.expected_in_flight,
            100 * draw.forced_share,
        )
    model = "sim-" + ("traces" if config.traces else "synthetic")
    routers = config.router_replicas
    bus = await Bus.connect(settings, "eldr-demo")
    try:
        if observer is not None:
            await observer.on_start(bus, ev, rate)
        progress.describe("calibration (round-robin)")
        log.info(
            "calibration: %d requests under round-robin at %.1f req/s",
            config.calibration_requests,
            rate,
        )
        await set_profile(bus, RoundRobinProfile(), routers)
        driver = TrafficDriver(
            bus, cal, TrafficConfig(model=model, rate_per_s=rate, seed=config.seed)
        )
        async with driver:
            calibration = await _with_progress(
                driver.run(config.calibration_requests), driver, progress
            )
            await wait_idle(bus, config.decoders, timeout_s=120)
            await driver.wait_decoded(timeout_s=30)
        progress.describe("refit")
        log.info("refit")
        reply = await bus.request(
            bus.subjects.trainer_refit,
            RefitRequest(reason="demo", k=None),
            RefitReply,
            timeout_s=120.0,
        )
        if reply.version is None:
            raise RuntimeError(
                f"the trainer did not fit a partition: {reply.status}: {reply.message}"
            )
        await wait_for_partition(bus, reply.version, routers, timeout_s=60)
        if observer is not None:
            await observer.on_partition(bus, reply.version)
        results = []
        for i, profile in enumerate(config.policies):
            policy = profile.name
            log.info("evaluation %d/%d: %s", i + 1, len(config.policies), profile.describe())
            progress.describe(f"{policy} ({i + 1}/{len(config.policies)})")
            await set_profile(bus, profile, routers)
            await worker_stats(bus, config.decoders, reset=True)
            if observer is not None:
                await observer.before_pass(bus, policy)
            driver = TrafficDriver(
                bus, ev, TrafficConfig(model=model, rate_per_s=rate, seed=config.seed + 1)
            )
            async with driver, FinishClock(bus) as clock:
                summary = await _with_progress(
                    driver.run(config.evaluation_requests, planned), driver, progress
                )
                await wait_idle(bus, config.decoders, timeout_s=120)
                await driver.wait_decoded(timeout_s=30)
                await asyncio.sleep(FINISH_GRACE_S)  # the last finish events are on their way
            measured = summarize_workers(await worker_stats(bus, config.decoders))
            if observer is not None:
                await observer.after_pass(bus, policy, driver, summary)
            result = _policy_result(profile, summary, measured)
            copies = clock.copies(driver)
            if copies is not None:
                result.copies_in_flight_share, result.copies_same_worker_share = copies
            results.append(result)
        # The record of truth: one message per decided request id in DECISIONS (the
        # first write per request id wins; a second decision could not be stored).
        decisions = await bus.stream_state(stream_name(settings.namespace, DECISIONS))
    finally:
        await bus.drain()
    return DemoResult(
        input={
            "traces": traces.source,
            "synthetic": traces.synthetic,
            "requests": len(traces),
            "calibration_pool": len(cal),
            "evaluation_pool": len(ev),
            "decoders": config.decoders,
            "cost_profile": cost.name,
            "time_scale": config.time_scale,
            "profiles": [p.describe() for p in config.policies],
        },
        rate_per_s=round(rate, 2),
        partition_version=reply.version,
        refit_message=reply.message,
        calibration=calibration.as_dict(),
        requests_sent=calibration.sent + sum(r.sent for r in results),
        decisions_recorded=decisions.messages,
        results=results,
        wall_s=round(time.perf_counter() - started, 1),
        arrivals=draw.describe(),
    )


def _policy_result(profile: ProfileBase, s: TrafficSummary, m: dict[str, float]) -> PolicyResult:
    return PolicyResult(
        policy=profile.name,
        params=profile.params(),
        sent=s.sent,
        decided=s.decided,
        lost=s.lost,
        conflicting=s.conflicting,
        fallbacks=dict(s.fallbacks),
        decision_latency_p50_ms=round(s.latency_p50_ms, 3),
        decision_latency_p99_ms=round(s.latency_p99_ms, 3),
        expert_union_mean=round(m["expert_union_mean"], 3),
        batch_mean=round(m["batch_mean"], 2),
        tpot_p50_ms=round(m["tpot_p50_ms"], 3),
        tpot_p99_ms=round(m["tpot_p99_ms"], 3),
        finished=int(m["finished"]),
        per_worker=dict(s.per_worker),
    )


def stack_config(config: DemoConfig, traces: TraceSet) -> StackConfig:
    """The local stack a demo runs on."""
    namespace = config.namespace or f"demo{uuid.uuid4().hex[:8]}"
    return StackConfig(
        namespace=namespace,
        nats_url=config.nats_url,
        database_url=config.database_url,
        state_dir=config.state_dir,
        decoders=config.decoders,
        replicas={"signature": config.signature_replicas, "router": config.router_replicas},
        env={
            "ELDR_SIMDECODE_TIME_SCALE": str(config.time_scale),
            "ELDR_SIMDECODE_PROFILE": config.deployment,
            "ELDR_SIMDECODE_NUM_EXPERTS": str(traces.geometry.num_experts),
            "ELDR_SIMDECODE_MAX_BATCH": str(config.max_batch),
            "ELDR_SIMDECODE_REPORT_INTERVAL_S": str(config.report_interval_s),
            "ELDR_REFIT_INTERVAL_S": "0",
            "ELDR_MIN_SAMPLES": str(min(256, config.calibration_requests // 2)),
            # Calibration runs round-robin (each pass then switches the routers' profile).
            "ELDR_ROUTING_PROFILE": encode_profile(RoundRobinProfile()),
            "OPENBLAS_NUM_THREADS": "1",
        },
        log_level=config.service_log_level,
        echo=config.echo_services,
        log_dir=config.state_dir / "logs",
    )


def demo_requests(config: DemoConfig) -> int:
    """Requests a demo replays in all (the unit of its progress bar)."""
    return config.calibration_requests + len(config.policies) * config.evaluation_requests


def run_demo(
    config: DemoConfig,
    observer: DemoObserver | None = None,
    progress: Progress = NO_PROGRESS,
    traces: TraceSet | None = None,
) -> DemoResult:
    traces = traces if traces is not None else load_input(config)
    with Stack(stack_config(config, traces)) as stack:
        if observer is not None:
            observer.on_stack(stack)
        return run_async(drive(config, stack.bus_settings(), traces, observer, progress))


def format_result(result: DemoResult) -> str:
    inp = result.input
    kind = "real traces" if not inp["synthetic"] else "SYNTHETIC workload"
    lines = [
        f"input: {inp['traces']} ({kind}), {inp['requests']} distinct requests "
        f"(calibration pool {inp['calibration_pool']}, evaluation pool {inp['evaluation_pool']})",
        f"{inp['decoders']} simulated decode workers, deployment {inp['cost_profile']}, "
        f"time scale {inp['time_scale']}, arrival rate {result.rate_per_s} req/s",
        f"partition version {result.partition_version}: {result.refit_message}",
        format_arrivals(result.arrivals),
        "",
        f"{'policy':<14} {'sent':>5} {'decided':>7} {'lost':>4} {'union':>7} {'batch':>6} "
        f"{'TPOT P50':>9} {'TPOT P99':>9} {'decide P50':>10} {'decide P99':>10} "
        f"{'copies':>13}  fallbacks",
    ]
    for r in result.results:
        lines.append(
            f"{r.policy:<14} {r.sent:>5} {r.decided:>7} {r.lost:>4} {r.expert_union_mean:>7.3f} "
            f"{r.batch_mean:>6.2f} {r.tpot_p50_ms:>7.2f}ms {r.tpot_p99_ms:>7.2f}ms "
            f"{r.decision_latency_p50_ms:>8.2f}ms {r.decision_latency_p99_ms:>8.2f}ms "
            f"{_copies(r):>13}  {r.fallbacks or '-'}"
        )
    lines.append(
        "copies: share of a pass's requests that decoded beside a copy of themselves, "
        "anywhere / on their worker (measured from the finish events)"
    )
    lines.extend(format_against_best({r.policy: r.statistics() for r in result.results}))
    lines.append(
        f"requests sent {result.requests_sent}, decisions recorded {result.decisions_recorded} "
        "(one per request: none lost, none doubled)"
        if result.requests_sent == result.decisions_recorded
        else f"requests sent {result.requests_sent} but decisions recorded "
        f"{result.decisions_recorded}: NOT exactly once"
    )
    lines.append(f"demo wall time {result.wall_s} s")
    return "\n".join(lines)


def _copies(r: PolicyResult) -> str:
    if r.copies_in_flight_share is None or r.copies_same_worker_share is None:
        return "-"
    return f"{100 * r.copies_in_flight_share:.1f}% / {100 * r.copies_same_worker_share:.1f}%"


def format_arrivals(arrivals: dict[str, Any]) -> str:
    """One line: how the evaluation arrivals were drawn, and how far copies stayed apart."""
    if not arrivals:
        return "evaluation arrivals: not recorded"
    line = (
        f"evaluation arrivals: {arrivals['method']} from a pool of {arrivals['pool_requests']} "
        f"requests, about {arrivals['expected_in_flight']:g} in flight"
    )
    if arrivals["apart"]:
        return line + ": no request drawn while a copy of it was in flight (estimated)"
    if arrivals["method"] == "apart":
        return line + (
            f": the pool is too small for the load, {100 * arrivals['forced_share']:.1f}% of "
            "arrivals drawn while every request had a copy in flight"
        )
    return line + ": copies of a request may be in flight together"


def format_against_best(stats: dict[str, tuple[float, float, float]]) -> list[str]:
    """Lines: each policy against the best baseline of each statistic, that baseline named."""
    versus = against_best_baseline(stats)
    if not versus:
        return ["no load-only baseline in the run: nothing to compare against"]
    best = best_baselines(stats)
    lines = [
        "against the best baseline of each statistic (among "
        f"{', '.join(p for p in stats if p in BASELINES)}): union {best['union']}, "
        f"TPOT P50 {best['tpot_p50']}, TPOT P99 {best['tpot_p99']}"
    ]
    for policy, v in versus.items():
        lines.append(
            f"  {policy}: expert union {v['union']:+.1f}% (vs {v['union_baseline']}), "
            f"TPOT P50 {v['tpot_p50']:+.1f}% (vs {v['tpot_p50_baseline']}), "
            f"TPOT P99 {v['tpot_p99']:+.1f}% (vs {v['tpot_p99_baseline']})"
        )
    return lines


def plot_result(result: DemoResult, path: Path) -> None:
    """PNG: expert union per step and TPOT P50/P99 per policy; each policy that is not a
    baseline annotated against the best baseline of that statistic."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result.results
    names = [r.policy for r in rows]
    x = np.arange(len(rows))
    versus = against_best_baseline({r.policy: r.statistics() for r in rows})
    fig, (ax_u, ax_t) = plt.subplots(1, 2, figsize=(13, 4.8))
    unions = [r.expert_union_mean for r in rows]
    bars = ax_u.bar(x, unions, color=["0.6" if r.policy in BASELINES else "C0" for r in rows])
    for bar, r in zip(bars, rows, strict=True):
        label = f"{r.expert_union_mean:.2f}"
        if r.policy in versus:
            label += f"\n{versus[r.policy]['union']:+.1f}%"
        ax_u.annotate(
            label,
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax_u.set_xticks(x, names, rotation=25, ha="right")
    ax_u.set_ylabel("distinct experts / MoE layer / step")
    ax_u.set_title("expert union (lower is better; % against the best baseline)")
    ax_u.set_ylim(0, max(unions) * 1.2 if unions else 1)
    width = 0.38
    for offset, key, stat, label in (
        (-width / 2, "tpot_p50_ms", "tpot_p50", "P50"),
        (width / 2, "tpot_p99_ms", "tpot_p99", "P99"),
    ):
        values = [getattr(r, key) for r in rows]
        tb = ax_t.bar(x + offset, values, width, label=label)
        for bar, r in zip(tb, rows, strict=True):
            text = f"{getattr(r, key):.2f}"
            if r.policy in versus:
                text += f"\n{versus[r.policy][stat]:+.1f}%"
            ax_t.annotate(
                text,
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=7,
            )
    lo = min(min(r.tpot_p50_ms for r in rows), min(r.tpot_p99_ms for r in rows))
    hi = max(r.tpot_p99_ms for r in rows)
    ax_t.set_ylim(lo * 0.97, hi * 1.03)
    ax_t.set_xticks(x, names, rotation=25, ha="right")
    ax_t.set_ylabel("ms (simulated; axis not from 0)")
    ax_t.set_title("TPOT (lower is better)")
    ax_t.legend(loc="upper right")
    inp = result.input
    kind = "real traces" if not inp["synthetic"] else "SYNTHETIC workload"
    fig.suptitle(
        f"eldr demo: {inp['decoders']} decode workers, {result.rate_per_s} req/s, {kind}",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


DEFAULT_PNG = Path("out/demo.png")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "demo",
        help="run the local stack and compare the load-only baselines with ELDR on the same "
        "requests",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_run_arguments(p)
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--nats-url", default=None, help="default: an embedded nats-server")
    p.add_argument("--echo-services", action="store_true", help="show the services' logs")
    p.add_argument(
        "--png",
        type=Path,
        default=DEFAULT_PNG,
        help=f"write the chart here (default {DEFAULT_PNG})",
    )
    p.set_defaults(func=_main)


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """What `eldr demo` and `eldr compare-live` both take: the workload, the cluster, the
    compared profiles, the seed, the stack's state and the JSON result
    (`run_config_fields` maps them onto `DemoConfig`)."""
    p.add_argument("--traces", type=Path, help="trace directory; default: synthetic workload")
    p.add_argument("--num-experts", type=int, default=None)
    p.add_argument("--decoders", type=int, default=8)
    p.add_argument("--calibration-requests", type=int, default=600)
    p.add_argument("--evaluation-requests", type=int, default=1500)
    p.add_argument("--target-batch", type=float, default=16.0)
    p.add_argument("--rate", type=float, default=None, help="arrival rate (req/s)")
    p.add_argument(
        "--with-replacement",
        action="store_true",
        help="draw the evaluation arrivals with replacement (copies of a request may decode "
        "side by side; the demos before issue 24 did)",
    )
    add_profile_arguments(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--database-url", default=None, help="default: SQLite in the state directory")
    p.add_argument(
        "--state-dir", type=Path, default=Path(".eldr"), help="local stack state (default .eldr)"
    )
    p.add_argument("--json", type=Path, help="write the result as JSON here")


def run_config_fields(
    args: argparse.Namespace, default_policies: tuple[ProfileBase, ...]
) -> dict[str, Any]:
    """The `DemoConfig` fields of `add_run_arguments`' arguments."""
    return {
        "traces": args.traces,
        "num_experts": args.num_experts,
        "decoders": args.decoders,
        "calibration_requests": args.calibration_requests,
        "evaluation_requests": args.evaluation_requests,
        "target_batch": args.target_batch,
        "rate_per_s": args.rate,
        "arrivals_apart": not args.with_replacement,
        "policies": with_baselines(profiles_from_args(args, default_policies)),
        "seed": args.seed,
        "database_url": args.database_url,
        "state_dir": args.state_dir,
    }


def add_profile_arguments(p: argparse.ArgumentParser) -> None:
    """`--profile` (repeatable) and `--tau`: the routing profiles a run compares."""
    p.add_argument(
        "--profile",
        action="append",
        type=decode_profile,
        metavar="JSON",
        help='a routing profile to compare, e.g. \'{"policy": "eldr", "tau": 0.2}\' (repeat; '
        "the load-only baselines round_robin, random, jsq and p2c always run too; default: "
        "eldr, eldr_band_cost)",
    )
    p.add_argument(
        "--tau",
        type=float,
        default=None,
        help="band width of every compared band policy (default: each profile's own)",
    )


def profiles_from_args(
    args: argparse.Namespace, default: tuple[ProfileBase, ...]
) -> tuple[ProfileBase, ...]:
    """The compared profiles: `--profile`s (else `default`), with `--tau` on those that
    take it."""
    profiles: tuple[ProfileBase, ...] = tuple(args.profile or default)
    if args.tau is None:
        return profiles
    return tuple(
        profile_from_params(p.name, params_taken(p.name, {"tau": args.tau}), keep=p)
        for p in profiles
    )


def _main(args: argparse.Namespace) -> int:
    for out in (args.json, args.png):
        if out is not None:  # fail now, not after the run
            out.parent.mkdir(parents=True, exist_ok=True)
    config = DemoConfig(
        **run_config_fields(args, DemoConfig.policies),
        time_scale=args.time_scale,
        nats_url=args.nats_url,
        echo_services=args.echo_services,
    )
    try:
        with terminal_progress(demo_requests(config), "eldr demo", unit="req") as progress:
            result = run_demo(config, progress=progress)
    except (BusError, RemoteError, RuntimeError, TimeoutError) as exc:
        log.error("demo failed: %s (service logs in %s)", exc, config.state_dir / "logs")
        return 1
    print(format_result(result))
    if args.json:
        args.json.write_text(json.dumps(result.as_dict(), indent=2))
        print(f"result: {args.json}")
    if args.png:
        plot_result(result, args.png)
        print(f"chart: {args.png}")
    return 0
