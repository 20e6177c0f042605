"""`eldr soak`: the local stack under steady load for a long time, watching what must stay
bounded.

The question it answers: with decode workers that never publish decode summaries (real vLLM
decode instances without the capture plugin), do the gateway's finish events alone keep
the routers' activity tables bounded and the default policy working? It starts the local
stack (`eldr.dev.stack`) with the simulated decode workers' profiles on or off
(`--decode-summaries/--no-decode-summaries`), replays requests through the simulated gateway (which
publishes a `RequestFinished` per request, as the real gateway does) at a fixed rate for a
fixed time, and samples every few seconds:

- each router replica's resident memory (`/proc/<pid>/status` VmRSS),
- its activity table: entries, bytes, and per worker entries minus in-flight requests
  (`/metrics`), and the evictions it counted,

then reports the decode workers' measurements over the whole run (expert union per step,
TPOT P50/P99) beside the memory at the start (after a warm-up) and at the end.

Not a test: a measurement, recorded in docs/BENCHMARKS.md with the command that ran it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import time
import urllib.request
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from eldr.core.routing.profile import DEFAULT_PROFILE, profile_from_params
from eldr.dev.demo import (
    DemoConfig,
    load_input,
    set_profile,
    summarize_workers,
    wait_idle,
    worker_stats,
)
from eldr.dev.stack import Stack, StackConfig
from eldr.runtime import run_async
from eldr.settings import BusSettings
from eldr.sim.traffic import TrafficConfig, TrafficDriver

log = logging.getLogger(__name__)

_METRIC = re.compile(r"^(eldr_router_[a-z_]+)(?:\{([^}]*)\})? (\S+)$")


@dataclass(frozen=True)
class SoakConfig:
    duration_s: float = 600.0
    rate_per_s: float = 200.0
    decoders: int = 8
    decode_summaries: bool = False
    """Whether the simulated decode workers publish decode summaries."""
    policy: str = DEFAULT_PROFILE.name
    """The routers' policy, with its default parameters."""
    traces: Path | None = None
    sample_every_s: float = 5.0
    warmup_s: float = 30.0
    """The memory 'at the start' is taken after this long (imports, caches, first tables)."""
    seed: int = 0
    state_dir: Path = Path(".eldr")
    router_replicas: int = 2


@dataclass
class Sample:
    t_s: float
    rss_mib: dict[str, float]
    activity_entries: dict[str, float]
    activity_bytes: dict[str, float]
    excess_over_in_flight: float
    """Largest (activity entries - in-flight requests) of any worker on any router."""


@dataclass
class SoakResult:
    config: dict[str, Any]
    sent: int
    decided: int
    lost: int
    conflicting: int
    finished_published: int
    expert_union_mean: float
    batch_mean: float
    """Requests per decode step: a slower (CPU-starved) run holds more at the same rate."""
    tpot_p50_ms: float
    tpot_p99_ms: float
    rss_start_mib: dict[str, float]
    rss_end_mib: dict[str, float]
    activity_entries_max: float
    excess_over_in_flight_max: float
    evictions: dict[str, float]
    cpu_s: dict[str, float] = field(default_factory=dict)
    """CPU seconds each service process used over the run (the machine's budget)."""
    samples: list[Sample] = field(default_factory=list)
    wall_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used (`/proc/<pid>/stat`)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def router_metrics(url: str) -> list[tuple[str, dict[str, str], float]]:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out = []
    for line in text.splitlines():
        m = _METRIC.match(line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            out.append((m.group(1), labels, float(m.group(3))))
    return out


def take_sample(stack: Stack, t_s: float) -> Sample:
    sample = Sample(t_s, {}, {}, {}, 0.0)
    for p in stack.processes:
        if p.name != "router":
            continue
        sample.rss_mib[p.instance_id] = round(rss_mib(p.pid), 1)
        per_worker: dict[str, dict[str, float]] = {}
        for name, labels, value in router_metrics(p.url):
            if name == "eldr_router_activity_requests":
                sample.activity_entries[p.instance_id] = value
            elif name == "eldr_router_activity_bytes":
                sample.activity_bytes[p.instance_id] = value
            elif name in ("eldr_router_worker_activity_requests", "eldr_router_worker_requests"):
                per_worker.setdefault(labels["worker"], {})[name] = value
        for values in per_worker.values():
            excess = values.get("eldr_router_worker_activity_requests", 0.0) - values.get(
                "eldr_router_worker_requests", 0.0
            )
            sample.excess_over_in_flight = max(sample.excess_over_in_flight, excess)
    return sample


def evictions(stack: Stack) -> dict[str, float]:
    out: dict[str, float] = {}
    for p in stack.processes:
        if p.name == "router":
            for name, labels, value in router_metrics(p.url):
                if name == "eldr_router_activity_evictions_total":
                    out[labels["reason"]] = out.get(labels["reason"], 0.0) + value
    return out


async def drive(config: SoakConfig, stack: Stack, settings: BusSettings) -> SoakResult:
    from eldr.bus import Bus

    traces = load_input(DemoConfig(traces=config.traces, seed=config.seed))
    started = time.monotonic()
    samples: list[Sample] = []
    bus = await Bus.connect(settings, "eldr-soak")
    cpu_before = {p.instance_id: cpu_s(p.pid) for p in stack.processes}
    try:
        await set_profile(bus, profile_from_params(config.policy), config.router_replicas)
        await worker_stats(bus, config.decoders, reset=True)
        count = int(config.rate_per_s * config.duration_s)
        driver = TrafficDriver(
            bus, traces, TrafficConfig(model="soak", rate_per_s=config.rate_per_s, seed=config.seed)
        )

        async def sampler() -> None:
            while True:
                samples.append(take_sample(stack, time.monotonic() - started))
                last = samples[-1]
                log.info(
                    "t=%.0f s rss %s MiB, activity %s, excess over in-flight %.0f",
                    last.t_s,
                    last.rss_mib,
                    last.activity_entries,
                    last.excess_over_in_flight,
                )
                await asyncio.sleep(config.sample_every_s)

        task = asyncio.create_task(sampler())
        try:
            async with driver:
                summary = await driver.run(count)
                await wait_idle(bus, config.decoders, timeout_s=300)
                undecoded = await driver.wait_decoded(timeout_s=30)
            await asyncio.sleep(1.0)  # the last finish events reach the routers
            if undecoded:
                log.warning("%d jobs never said their decode ended", undecoded)
            samples.append(take_sample(stack, time.monotonic() - started))
        finally:
            task.cancel()
        measured = summarize_workers(await worker_stats(bus, config.decoders))
        used = {
            p.instance_id: round(cpu_s(p.pid) - cpu_before.get(p.instance_id, 0.0), 1)
            for p in stack.processes
        }
    finally:
        await bus.drain()
    warm = next((s for s in samples if s.t_s >= config.warmup_s), samples[0])
    return SoakResult(
        config={k: str(v) for k, v in asdict(config).items()},
        sent=summary.sent,
        decided=summary.decided,
        lost=summary.lost,
        conflicting=summary.conflicting,
        finished_published=driver.finished_published,
        expert_union_mean=round(measured["expert_union_mean"], 3),
        batch_mean=round(measured["batch_mean"], 2),
        tpot_p50_ms=round(measured["tpot_p50_ms"], 3),
        tpot_p99_ms=round(measured["tpot_p99_ms"], 3),
        rss_start_mib=warm.rss_mib,
        rss_end_mib=samples[-1].rss_mib,
        activity_entries_max=max(max(s.activity_entries.values(), default=0.0) for s in samples),
        excess_over_in_flight_max=max(s.excess_over_in_flight for s in samples),
        evictions=evictions(stack),
        cpu_s=used,
        samples=samples,
        wall_s=round(time.monotonic() - started, 1),
    )


def run_soak(config: SoakConfig) -> SoakResult:
    stack_config = StackConfig(
        namespace=f"soak{uuid.uuid4().hex[:8]}",
        state_dir=config.state_dir,
        decoders=config.decoders,
        replicas={"router": config.router_replicas},
        env={
            "ELDR_SIMDECODE_PUBLISH_PROFILES": "1" if config.decode_summaries else "0",
            "ELDR_REFIT_INTERVAL_S": "0",
            "ELDR_POLICY": config.policy,
            "OPENBLAS_NUM_THREADS": "1",
        },
        log_level="WARNING",
        log_dir=config.state_dir / "logs",
    )
    with Stack(stack_config) as stack:
        return run_async(drive(config, stack, stack.bus_settings()))


def format_result(r: SoakResult) -> str:
    nan = float("nan")
    rss = ", ".join(
        f"{k} {r.rss_start_mib.get(k, nan):.0f} -> {r.rss_end_mib.get(k, nan):.0f}"
        for k in sorted(r.rss_end_mib)
    )
    per_sample = np.array([max(s.activity_entries.values(), default=0.0) for s in r.samples])
    return "\n".join(
        [
            f"soak: {r.config['duration_s']} s at {r.config['rate_per_s']} req/s, "
            f"{r.config['decoders']} decoders, policy {r.config['policy']}, decode summaries "
            f"{'on' if r.config['profiles'] == 'True' else 'off'}",
            f"requests sent {r.sent}, decided {r.decided}, lost {r.lost}, conflicting "
            f"{r.conflicting}, finish events {r.finished_published}",
            f"expert union/layer/step {r.expert_union_mean:.3f} at a mean batch of "
            f"{r.batch_mean:.1f}, TPOT P50 {r.tpot_p50_ms:.2f} ms, P99 {r.tpot_p99_ms:.2f} ms",
            f"router RSS MiB (after {r.config['warmup_s']} s -> end): {rss}",
            f"activity entries per router: max {r.activity_entries_max:.0f}, median of samples "
            f"{float(np.median(per_sample)) if per_sample.size else 0:.0f}; largest excess over "
            f"a worker's in-flight {r.excess_over_in_flight_max:.0f}",
            f"evictions {r.evictions}",
            f"CPU seconds used: {r.cpu_s} (total {sum(r.cpu_s.values()):.0f})",
            f"wall {r.wall_s} s",
        ]
    )


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "soak",
        help="the local stack under steady load: router memory and activity bounds",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    p.add_argument("--rate", type=float, default=200.0, help="requests per second")
    p.add_argument("--decoders", type=int, default=8)
    p.add_argument(
        "--decode-summaries",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="simulated decode workers publish decode summaries (default: off)",
    )
    p.add_argument("--policy", default=DEFAULT_PROFILE.name)
    p.add_argument("--traces", type=Path, default=None, help="default: synthetic workload")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the result (with every sample) here")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    config = SoakConfig(
        duration_s=args.duration,
        rate_per_s=args.rate,
        decoders=args.decoders,
        decode_summaries=args.decode_summaries,
        policy=args.policy,
        traces=args.traces,
        seed=args.seed,
    )
    result = run_soak(config)
    print(format_result(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result.as_dict(), indent=2))
    return 0
