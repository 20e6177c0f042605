"""`eldr bench-pipeline`: prefill-done -> decision latency through NATS at fixed rates.

Starts the local stack (embedded nats-server, signature replicas, routers, simulated decode
workers that report load) as separate processes, installs an ELDR partition fitted on a
synthetic calibration set (so routers take the full locality path: signature assembly over
NATS, hnswlib/exact scoring, band, commit), then, per rate, replays requests as a Poisson
stream: block summaries and a PrefillDone per request, each decision awaited on a reply
inbox. Latency is measured in the replaying process from just before the PrefillDone
publish to the decision's arrival (monotonic clock). Requests are not sent on to the decode
workers (routing is what is measured); the workers only report load. The router's own
share (`Decision.decide_s`: PrefillDone taken -> decision built, signature fetch included)
is reported beside it.

Everything shares this machine's cores: the numbers include the driver's own CPU use.

Besides latency, each rate reports what the record of truth says (the DECISIONS stream:
decisions and distinct request ids among this run's requests, so lost = sent - distinct and
doubled = decisions - distinct) and the resident memory of every process, sampled every
second (`--rss-every`): at the start of the rate, its peak and at its end, so a process
whose memory keeps growing under a steady load shows. The sustained load test of
docs/RELIABILITY.md is `eldr bench-pipeline --rates 1000 --duration 60`.

In the same run (issue 14, "measure what users feel"):

- the same rates again with `--compare` (JSQ by default) through the same pipeline, the
  routers switched at run time (`RouterControl`), and per rate the policy's P50, P99 and
  router CPU as ratios of it: what the locality path costs over load-only routing;
- every process's CPU seconds over each rate (`/proc/<pid>/stat`) and the routers' CPU
  per decision (their CPU over the run / the decisions the DECISIONS stream holds), and
  what the processes use with no request at all (load reports, timers);
- with `--saturation-rates`, those rates stepped through in order until one's P99 passes
  `--saturation-p99-ms` (50 ms) or a request is lost or doubled: the saturation rate is
  the last one under;
- with `--replicas 1,2,4`, a stack per replica count, each offered `--throughput-rate`
  for `--duration`: decisions per second with that many routers sharing the consumer.

Each row carries the machine's load average at its end: on shared cores, the numbers
move with whatever else runs.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from eldr.bus import Bus, BusError, Delivery, stream_name
from eldr.bus.topology import DECISIONS
from eldr.core.partition.partition import fit_partition
from eldr.core.routing.profile import DEFAULT_PROFILE, as_routing_profile, profile_type
from eldr.core.workload.synthetic import SyntheticSpec, generate
from eldr.core.workload.trace import TraceSet, counts_matrix
from eldr.dev.stack import SERVICES, Stack, StackConfig
from eldr.partitions.announce import announce_version
from eldr.partitions.writer import blob_for_version
from eldr.progress import NO_PROGRESS, Progress
from eldr.runtime import run_async
from eldr.sim.traffic import TrafficConfig, TrafficDriver
from eldr.wire import Decision, RouterControl, RouterControlReply

log = logging.getLogger(__name__)

MODEL = "bench"


@dataclass(frozen=True)
class PipelineConfig:
    rates: tuple[float, ...] = (500.0, 1000.0, 2000.0)
    duration_s: float = 10.0
    routers: int = 1
    signatures: int = 1
    decoders: int = 16
    seed: int = 0
    namespace: str | None = None
    state_dir: Path = Path(".eldr")
    rss_every_s: float = 1.0
    """Resident-memory sampling period of every process (0 = off)."""
    policy: str = DEFAULT_PROFILE.name
    """The routers' policy, with its default parameters (`ELDR_POLICY`)."""
    compare_policy: str | None = "jsq"
    """Run the same rates again with this policy through the same pipeline (the routers
    switched at run time), for the locality path's overhead as a ratio; None: skip."""
    saturation_rates: tuple[float, ...] = ()
    """Rates stepped through in order with `policy` until one's P99 passes
    `saturation_p99_ms` (or loses a request): the saturation rate is the last one under."""
    saturation_p99_ms: float = 50.0
    replica_counts: tuple[int, ...] = ()
    """Router replica counts to measure throughput with (a stack each, `throughput_rate`
    offered for `duration_s`); empty: skip."""
    throughput_rate: float = 2000.0
    settle_s: float = 2.0
    """Pause between two runs: the routers forget the previous run's requests (their
    pending loads and activity expire after 2 s here)."""
    local_signatures: bool = True
    """The driver's prefill worker sends the whole signature for prefix hits on blocks
    it holds (`TrafficConfig.local_signatures`); False: the service supplies every hit."""
    local_summary_blocks: int | None = None
    """Bound of that local store, in blocks (`TrafficConfig.local_summary_blocks`)."""


SPEC = SyntheticSpec(num_topics=8, num_moe_layers=24, num_experts=128, top_k=1)
"""The benchmark's synthetic workload (what its partition is fitted on and its requests)."""


def synthetic_sets(seed: int) -> tuple[TraceSet, TraceSet]:
    """(calibration set the partition is fitted on, the requests replayed)."""
    rng = np.random.default_rng(seed)
    calibration = generate(SPEC, 600, rng, id_prefix="cal")
    return calibration, generate(SPEC, 2000, rng, id_prefix="req")


def synthetic_traffic(seed: int) -> TraceSet:
    """The requests the benchmark replays for `seed`."""
    return synthetic_sets(seed)[1]


def rss_bytes(pid: int) -> int | None:
    """Resident set size of a process (Linux /proc), None if it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


class RssSampler:
    """Samples the RSS of named processes every `every_s` in a thread; `window()` returns
    (first, peak, last) MiB per process since the last call."""

    def __init__(self, pids: Callable[[], Mapping[str, int]], every_s: float) -> None:
        self._pids = pids
        self._every_s = every_s
        self._samples: dict[str, list[int]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss sampler", daemon=True)

    def start(self) -> RssSampler:
        if self._every_s > 0:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            self.sample()

    def sample(self) -> None:
        for name, pid in self._pids().items():
            rss = rss_bytes(pid)
            if rss is not None:
                with self._lock:
                    self._samples.setdefault(name, []).append(rss)

    def window(self) -> dict[str, dict[str, float]]:
        self.sample()
        with self._lock:
            samples, self._samples = self._samples, {}
        mib = 1 << 20
        return {
            name: {
                "first_mib": round(values[0] / mib, 1),
                "peak_mib": round(max(values) / mib, 1),
                "last_mib": round(values[-1] / mib, 1),
            }
            for name, values in sorted(samples.items())
            if values
        }


async def count_decisions(bus: Bus, since_s: float, request_ids: set[str]) -> tuple[int, int]:
    """(decisions, distinct request ids) in DECISIONS since `since_s` among `request_ids`."""
    seen: dict[str, int] = {}

    async def on_decision(decision: Decision, _: Delivery) -> None:
        if decision.request_id in request_ids:
            seen[decision.request_id] = seen.get(decision.request_id, 0) + 1

    reader = await bus.read_back(
        stream_name(bus.subjects.namespace, DECISIONS),
        bus.subjects.decisions_all,
        Decision,
        on_decision,
        start_time_s=since_s,
        stop_at_end=True,
    )
    await reader.wait_caught_up(timeout_s=120)
    return sum(seen.values()), len(seen)


async def install_partition(bus: Bus, traces: TraceSet, workers: list[str], seed: int) -> int:
    """Fit a partition on the synthetic set and announce it, as the trainer would."""
    prefill = counts_matrix(traces.traces, traces.geometry, "prefill")
    decode = counts_matrix(traces.traces, traces.geometry, "decode")
    partition, _ = fit_partition(
        prefill, decode, traces.geometry, workers, version=1, model=MODEL, seed=seed
    )
    await announce_version(
        bus,
        blob_for_version(partition, partition.version),
        bucket=f"{bus.subjects.namespace}-partitions",
        subject=bus.subjects.partition_active,
        created_ts_s=time.time(),
    )
    return partition.k


async def _until_routers(
    bus: Bus,
    control: RouterControl,
    routers: int,
    done: Callable[[RouterControlReply], bool],
    timeout_s: float,
    what: str,
) -> None:
    """Send `control` to every router replica every 0.2 s until all `routers` answer and
    every answer satisfies `done`; TimeoutError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        replies = [
            r
            for r in await bus.request_many(
                bus.subjects.control_router,
                control,
                RouterControlReply,
                timeout_s=1.0,
                max_replies=routers,
            )
            if isinstance(r, RouterControlReply)
        ]
        if len(replies) == routers and all(done(r) for r in replies):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"routers {what}: {replies}")
        await asyncio.sleep(0.2)


async def wait_routers_ready(bus: Bus, routers: int, decoders: int, timeout_s: float = 60) -> None:
    await _until_routers(
        bus,
        RouterControl(policy=None, tau=None, load_measure=None),
        routers,
        lambda r: r.partition_version == 1 and r.live_workers == decoders,
        timeout_s,
        "not ready with partition 1 and all workers",
    )


class _WallTicker:
    """Counts wall seconds into a progress bar while a rate runs, `budget_s` at most."""

    def __init__(self, progress: Progress, budget_s: float) -> None:
        self.progress = progress
        self.budget_s = budget_s
        self.done_s = 0.0

    async def run(self, every_s: float = 0.5) -> None:
        started = time.monotonic()
        while True:
            await asyncio.sleep(every_s)
            self._to(min(self.budget_s, time.monotonic() - started))

    def finish(self) -> None:
        self._to(self.budget_s)

    def _to(self, at_s: float) -> None:
        if at_s > self.done_s:
            self.progress.advance(at_s - self.done_s)
            self.done_s = at_s


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds a process has used (Linux /proc), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # After the command name: state is field 3, utime and stime fields 14 and 15.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU seconds of named processes between `start` and `stop`."""

    def __init__(self, pids: Callable[[], Mapping[str, int]]) -> None:
        self._pids = pids
        self._at: dict[str, tuple[int, float]] = {}
        self._wall = 0.0

    def start(self) -> None:
        self._wall = time.monotonic()
        self._at = {}
        for name, pid in self._pids().items():
            used = cpu_seconds(pid)
            if used is not None:
                self._at[name] = (pid, used)

    def stop(self) -> dict[str, Any]:
        """{"wall_s", "cpu_s": {process: seconds}} since `start`."""
        wall = time.monotonic() - self._wall
        used: dict[str, float] = {}
        for name, (pid, before) in sorted(self._at.items()):
            after = cpu_seconds(pid)
            if after is not None:
                used[name] = round(after - before, 2)
        return {"wall_s": round(wall, 2), "cpu_s": used}


async def switch_policy(bus: Bus, policy: str, routers: int, timeout_s: float = 10) -> None:
    """Every router replica routes with `policy` (its default parameters) from now on."""
    await _until_routers(
        bus,
        RouterControl(profile=as_routing_profile(profile_type(policy)())),
        routers,
        lambda r: r.policy == policy,
        timeout_s,
        f"did not switch to {policy}",
    )


async def measure_rate(
    config: PipelineConfig,
    bus: Bus,
    traffic: TraceSet,
    rate: float,
    *,
    cpu: CpuMeter | None = None,
    sampler: RssSampler | None = None,
    progress: Progress = NO_PROGRESS,
) -> dict[str, Any]:
    """Replay `rate` requests per second for `duration_s`; one result row."""
    n = int(rate * config.duration_s)
    if sampler is not None:
        sampler.window()  # start this rate's window
    since_s = time.time() - 1.0
    driver = TrafficDriver(
        bus,
        traffic,
        TrafficConfig(
            model=MODEL,
            rate_per_s=rate,
            seed=config.seed,
            send_jobs=False,
            decision_timeout_s=5.0,
            local_signatures=config.local_signatures,
            local_summary_blocks=config.local_summary_blocks,
        ),
    )
    ticker = _WallTicker(progress, config.duration_s)
    ticking = asyncio.create_task(ticker.run())
    if cpu is not None:
        cpu.start()
    try:
        async with driver:
            summary = await driver.run(n)
    finally:
        ticking.cancel()
    used = cpu.stop() if cpu is not None else {"wall_s": None, "cpu_s": {}}
    ticker.finish()
    rss = sampler.window() if sampler is not None else {}
    latencies = np.array(
        [r.decision_latency_s for r in driver.records if r.decision_latency_s is not None]
    )
    in_router = np.array(
        [
            r.router_decide_s
            for r in driver.records
            if r.decision_latency_s is not None and r.router_decide_s is not None
        ]
    )
    sent_ids = {r.request_id for r in driver.records if r.sent}
    decisions, distinct = await count_decisions(bus, since_s, sent_ids)

    def ms(values: np.ndarray, q: float) -> float | None:
        return round(float(np.percentile(values, q)) * 1e3, 3) if values.size else None

    router_cpu = sum(v for k, v in used["cpu_s"].items() if k.startswith("router-"))
    row = {
        "rate": rate,
        "sent": summary.sent,
        "decided": summary.decided,
        "lost": summary.lost,
        "conflicting": summary.conflicting,
        "achieved_rate": round(summary.achieved_rate_per_s, 1),
        "latency_p50_ms": ms(latencies, 50),
        "latency_p99_ms": ms(latencies, 99),
        "latency_max_ms": round(float(latencies.max()) * 1e3, 3) if latencies.size else None,
        "router_p50_ms": ms(in_router, 50),
        "router_p99_ms": ms(in_router, 99),
        "fallbacks": dict(summary.fallbacks),
        "max_lag_ms": round(summary.max_lag_s * 1e3, 1),
        "stream_decisions": decisions,
        "stream_lost": len(sent_ids) - distinct,
        "stream_doubled": decisions - distinct,
        "rss": rss,
        "decided_per_s": round(summary.decided / summary.elapsed_s, 1)
        if summary.elapsed_s > 0
        else None,
        "cpu": used,
        "router_cpu_us_per_decision": round(router_cpu / decisions * 1e6, 1) if decisions else None,
        "load_average": load_average(),
        "errors": summary.errors,
        "error_samples": summary.error_samples[:3],
        "signature_sources": dict(summary.signature_sources),
        **signature_shares(summary.signature_sources),
    }
    log.info("rate %.0f: %s", rate, row)
    return row


def signature_shares(sources: Mapping[str, int]) -> dict[str, float | None]:
    """The share of the events sent whose signature needed the signature service
    (`service_share`) and of those that carried it whole (`event_share`), from what the
    driver sent (`TrafficSummary.signature_sources`); None with nothing sent."""
    sent = sum(sources.values())
    if not sent:
        return {"event_share": None, "service_share": None}
    return {
        "event_share": round(sources.get("event", 0) / sent, 4),
        "service_share": round(sources.get("service", 0) / sent, 4),
    }


def load_average() -> list[float]:
    """The machine's 1, 5 and 15 minute load averages (benchmarks on shared cores)."""
    return [round(x, 2) for x in os.getloadavg()]


def passes(row: Mapping[str, Any], p99_limit_ms: float) -> bool:
    """Whether a rate is sustained: nothing lost or doubled, P99 within the limit."""
    p99 = row["latency_p99_ms"]
    return (
        p99 is not None
        and p99 <= p99_limit_ms
        and row["lost"] == 0
        and row["stream_lost"] == 0
        and row["stream_doubled"] == 0
    )


async def drive(
    config: PipelineConfig,
    stack: Stack,
    sampler: RssSampler | None = None,
    progress: Progress = NO_PROGRESS,
    cpu: CpuMeter | None = None,
) -> dict[str, Any]:
    """Install a partition, wait for the routers, then replay each rate with each policy
    and step the saturation rates; `progress` gets each run's `duration_s` in seconds."""
    calibration, traffic = synthetic_sets(config.seed)
    bus = await Bus.connect(stack.bus_settings(), "eldr-bench-pipeline")
    per_policy: dict[str, list[dict[str, Any]]] = {}
    saturation: dict[str, Any] | None = None
    try:
        workers = [f"decode-{i}" for i in range(config.decoders)]
        await install_partition(bus, calibration, workers, config.seed)
        await wait_routers_ready(bus, config.routers, config.decoders)
        # The driver is a Python process too: keep full collections of its start-up
        # heap from pausing it mid-measurement (see eldr.runtime).
        gc.collect()
        gc.freeze()
        idle = None
        if cpu is not None:
            # What the processes use with no request: load reports and timers.
            cpu.start()
            await asyncio.sleep(config.settle_s)
            idle = cpu.stop()
        policies = [config.policy]
        if config.compare_policy and config.compare_policy != config.policy:
            policies.append(config.compare_policy)
        for policy in policies:
            await switch_policy(bus, policy, config.routers)
            rows = per_policy[policy] = []
            for rate in config.rates:
                progress.describe(f"{policy} {rate:g}/s")
                rows.append(
                    await measure_rate(
                        config, bus, traffic, rate, cpu=cpu, sampler=sampler, progress=progress
                    )
                )
                await asyncio.sleep(config.settle_s)
        if config.saturation_rates:
            await switch_policy(bus, config.policy, config.routers)
            steps: list[dict[str, Any]] = []
            sustained: float | None = None
            failed: str | None = None
            for rate in config.saturation_rates:
                progress.describe(f"saturation {rate:g}/s")
                try:
                    row = await measure_rate(config, bus, traffic, rate, cpu=cpu, progress=progress)
                except (BusError, RuntimeError) as exc:  # the driver itself overloaded
                    log.warning("saturation step %g/s failed: %s", rate, exc)
                    failed = f"{type(exc).__name__}: {exc}"
                    break
                steps.append(row)
                await asyncio.sleep(config.settle_s)
                if not passes(row, config.saturation_p99_ms):
                    break
                sustained = rate
            saturation = {
                "policy": config.policy,
                "p99_limit_ms": config.saturation_p99_ms,
                "saturation_rate": sustained,
                "steps": steps,
                "failed": failed,
            }
    finally:
        await bus.drain()
    result: dict[str, Any] = {
        "input": {
            "synthetic": True,
            "routers": config.routers,
            "policy": config.policy,
            "signature_replicas": config.signatures,
            "decoders": config.decoders,
            "duration_s": config.duration_s,
            "geometry": "24 MoE layers x 128 experts, top-1, 16-token blocks",
            "cpus": os.cpu_count(),
            "local_signatures": config.local_signatures,
            "local_summary_blocks": config.local_summary_blocks,
        },
        "results": per_policy[config.policy],
        "policies": per_policy,
        "idle_cpu": idle,
        "saturation": saturation,
    }
    if config.compare_policy in per_policy and config.compare_policy != config.policy:
        result["versus"] = versus(per_policy[config.policy], per_policy[config.compare_policy])
        result["versus_policy"] = config.compare_policy
    return result


def versus(rows: list[dict[str, Any]], baseline: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per rate, the policy's P50 and P99 as a ratio of the baseline's (same pipeline)."""
    by_rate = {r["rate"]: r for r in baseline}
    out = []
    for r in rows:
        b = by_rate.get(r["rate"])
        if b is None:
            continue

        def ratio(key: str, r: Mapping[str, Any] = r, b: Mapping[str, Any] = b) -> float | None:
            x, y = r[key], b[key]
            return round(x / y, 2) if x is not None and y else None

        out.append(
            {
                "rate": r["rate"],
                "p50_ratio": ratio("latency_p50_ms"),
                "p99_ratio": ratio("latency_p99_ms"),
                "router_cpu_ratio": ratio("router_cpu_us_per_decision"),
            }
        )
    return out


async def _throughput(
    config: PipelineConfig, stack: Stack, routers: int, progress: Progress, cpu: CpuMeter
) -> dict[str, Any]:
    calibration, traffic = synthetic_sets(config.seed)
    bus = await Bus.connect(stack.bus_settings(), "eldr-bench-pipeline")
    try:
        workers = [f"decode-{i}" for i in range(config.decoders)]
        await install_partition(bus, calibration, workers, config.seed)
        await wait_routers_ready(bus, routers, config.decoders)
        gc.collect()
        progress.describe(f"{routers} router(s) at {config.throughput_rate:g}/s")
        row = await measure_rate(
            config, bus, traffic, config.throughput_rate, cpu=cpu, progress=progress
        )
    finally:
        await bus.drain()
    return {"routers": routers, **row}


def _stack_config(config: PipelineConfig, routers: int) -> StackConfig:
    services = tuple(s for s in SERVICES if s.name in ("signature", "simdecode", "router"))
    return StackConfig(
        namespace=config.namespace or f"bench{uuid.uuid4().hex[:8]}",
        state_dir=config.state_dir,
        decoders=config.decoders,
        replicas={"signature": config.signatures, "router": routers},
        services=tuple(
            s if s.name != "router" else type(s)(s.name, s.replicas, ("signature", "simdecode"))
            for s in services
        ),
        env={
            "ELDR_POLICY": config.policy,
            "OPENBLAS_NUM_THREADS": "1",
            "ELDR_PENDING_TTL_S": "2",
            # Requests are not sent on, so no decode summary ends them: the routers forget
            # them after 2 s (pending load; cost-aware routing's per-worker activity).
            "ELDR_ACTIVITY_TTL_S": "2",
        },
        log_level="WARNING",
        echo=False,
        log_dir=config.state_dir / "logs",
    )


def _pids(stack: Stack) -> Callable[[], dict[str, int]]:
    def pids() -> dict[str, int]:
        found = {p.instance_id: p.pid for p in stack.processes if p.returncode is None}
        if stack.nats is not None and stack.nats.pid is not None:
            found["nats-server"] = stack.nats.pid
        found["bench (driver)"] = os.getpid()
        return found

    return pids


def run(config: PipelineConfig, progress: Progress = NO_PROGRESS) -> dict[str, Any]:
    with Stack(_stack_config(config, config.routers)) as stack:
        sampler = RssSampler(_pids(stack), config.rss_every_s).start()
        try:
            result = run_async(drive(config, stack, sampler, progress, CpuMeter(_pids(stack))))
        finally:
            sampler.stop()
    replicas: list[dict[str, Any]] = []
    result["replicas"] = replicas
    for routers in config.replica_counts:
        try:
            with Stack(_stack_config(config, routers)) as stack:
                replicas.append(
                    run_async(_throughput(config, stack, routers, progress, CpuMeter(_pids(stack))))
                )
        except Exception as exc:  # an overloaded run must not cost the others' results
            log.warning("throughput with %d router(s) failed: %s", routers, exc)
            replicas.append({"routers": routers, "error": f"{type(exc).__name__}: {exc}"})
    return result


def total_seconds(config: PipelineConfig) -> float:
    """Seconds of replay a run does at most (its progress bar's length)."""
    policies = 1 + (config.compare_policy not in (None, config.policy))
    runs = policies * len(config.rates) + len(config.saturation_rates) + len(config.replica_counts)
    return runs * config.duration_s


def _rows_table(rows: list[dict[str, Any]], first: str = "rate/s") -> list[str]:
    def num(x: float | None, width: int, digits: int = 2) -> str:
        return f"{x:>{width}.{digits}f}" if x is not None else f"{'-':>{width}}"

    def pct(x: float | None, width: int) -> str:
        return f"{x * 100:>{width - 1}.1f}%" if x is not None else f"{'-':>{width}}"

    lines = [
        f"{first:>7} {'achieved':>8} {'sent':>6} {'decided':>7} {'lost':>4} {'P50 ms':>7} "
        f"{'P99 ms':>7} {'max ms':>7} {'router P50':>10} {'router P99':>10} "
        f"{'router CPU us/dec':>17} {'load avg':>8} {'sig event':>9} {'sig service':>11}"
    ]
    for r in rows:
        key = r["routers"] if first == "routers" else r["rate"]
        load = r.get("load_average") or [None]
        lines.append(
            f"{key:>7.0f} {r['achieved_rate']:>8.1f} {r['sent']:>6} {r['decided']:>7} "
            f"{r['lost']:>4} {num(r['latency_p50_ms'], 7)} {num(r['latency_p99_ms'], 7)} "
            f"{num(r['latency_max_ms'], 7, 1)} {num(r['router_p50_ms'], 10)} "
            f"{num(r['router_p99_ms'], 10)} {num(r.get('router_cpu_us_per_decision'), 17, 0)} "
            f"{num(load[0], 8)} {pct(r.get('event_share'), 9)} {pct(r.get('service_share'), 11)}"
        )
    return lines


def format_table(result: dict[str, Any]) -> str:
    inp = result["input"]
    lines = [
        f"pipeline: {inp['routers']} router(s) (policy {inp['policy']}), "
        f"{inp['signature_replicas']} signature "
        f"replica(s), {inp['decoders']} simulated decode workers, {inp['duration_s']} s per "
        f"rate, SYNTHETIC requests ({inp['geometry']}); local signatures "
        f"{'on' if inp.get('local_signatures', True) else 'off'}"
        + (
            f" ({inp['local_summary_blocks']} blocks)"
            if inp.get("local_summary_blocks") is not None
            else ""
        ),
    ]
    per_policy = result.get("policies") or {inp["policy"]: result["results"]}
    for policy, rows in per_policy.items():
        lines.append(f"policy {policy}:")
        lines.extend(_rows_table(rows))
    lines.append(
        "P50/P99/max: PrefillDone publish -> decision received, in the driver; router P50/P99: "
        "the router's own part (PrefillDone taken -> decision built, signature fetch "
        "included; Decision.decide_s); router CPU: the router processes' CPU time over the "
        "run / decisions; sig event / sig service: the share of PrefillDone events sent that "
        "carried the whole signature / left cached blocks to the signature service (the rest "
        "had no prefix hit), as the driver sent them"
    )
    for row in result.get("versus") or []:
        lines.append(
            f"rate {row['rate']:.0f}: {inp['policy']} / {result['versus_policy']}: P50 x"
            f"{row['p50_ratio']}, P99 x{row['p99_ratio']}, router CPU x{row['router_cpu_ratio']}"
        )
    idle = result.get("idle_cpu")
    if idle:
        share = ", ".join(
            f"{k} {v / idle['wall_s'] * 100:.0f}%" for k, v in idle["cpu_s"].items() if v
        )
        lines.append(f"idle CPU (no requests, {idle['wall_s']} s): {share or 'none'}")
    sat = result.get("saturation")
    if sat:
        lines.append(
            f"saturation ({sat['policy']}, P99 <= {sat['p99_limit_ms']:g} ms, nothing lost): "
            f"{sat['saturation_rate'] if sat['saturation_rate'] is not None else 'none'}/s"
        )
        lines.extend(_rows_table(sat["steps"]))
        if sat.get("failed"):
            lines.append(f"  the next step failed: {sat['failed']}")
    if result.get("replicas"):
        lines.append(f"throughput by router replicas ({inp['policy']}):")
        lines.extend(_rows_table([r for r in result["replicas"] if "error" not in r], "routers"))
        for r in result["replicas"]:
            if "error" in r:
                lines.append(f"{r['routers']:>7} router(s): failed: {r['error']}")
    for policy, rows in per_policy.items():
        for r in rows:
            lines.append(
                f"{policy} rate {r['rate']:.0f}: DECISIONS stream holds {r['stream_decisions']} "
                f"decisions for {r['sent']} requests sent: {r['stream_lost']} lost, "
                f"{r['stream_doubled']} doubled"
            )
            if r["rss"]:
                lines.append(f"  {'process':<18} {'start MiB':>9} {'peak MiB':>9} {'end MiB':>9}")
                for name, m in r["rss"].items():
                    lines.append(
                        f"  {name:<18} {m['first_mib']:>9.1f} {m['peak_mib']:>9.1f} "
                        f"{m['last_mib']:>9.1f}"
                    )
    return "\n".join(lines)
