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

Everything shares this machine's cores: the numbers include the replayer's own CPU use.

Besides latency, each rate reports what the record of truth says (the DECISIONS stream:
decisions and distinct request ids among this run's requests, so lost = sent - distinct and
doubled = decisions - distinct) and the resident memory of every process, sampled every
second (`--rss-every`): at the start of the rate, its peak and at its end, so a process
whose memory keeps growing under a steady load shows. The sustained load test of
docs/RELIABILITY.md is `eldr bench-pipeline --rates 1000 --duration 60`.
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

from eldr.bus import Bus, Delivery, stream_name
from eldr.bus.topology import DECISIONS
from eldr.core.partition.partition import fit_partition
from eldr.core.routing.profile import DEFAULT_PROFILE
from eldr.core.workload.synthetic import SyntheticSpec, generate
from eldr.core.workload.trace import TraceSet, counts_matrix
from eldr.dev.stack import SERVICES, Stack, StackConfig
from eldr.partitions.codec import blob_sha256, partition_to_blob
from eldr.progress import NO_PROGRESS, Progress
from eldr.runtime import run_async
from eldr.sim.traffic import ReplayConfig, TraceReplayer
from eldr.wire import Decision, PartitionAnnouncement, RouterControl, RouterControlReply

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
    policy: str = DEFAULT_PROFILE.name
    """The routers' policy, with its default parameters (`ELDR_POLICY`)."""
    """Resident-memory sampling period of every process (0 = off)."""


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

    replay = await bus.replay(
        stream_name(bus.subjects.namespace, DECISIONS),
        bus.subjects.decisions_all,
        Decision,
        on_decision,
        start_time_s=since_s,
        stop_at_end=True,
    )
    await replay.wait_caught_up(timeout_s=120)
    return sum(seen.values()), len(seen)


async def install_partition(bus: Bus, traces: TraceSet, workers: list[str], seed: int) -> int:
    """Fit a partition on the synthetic set and announce it, as the trainer would."""
    prefill = counts_matrix(traces.traces, traces.geometry, "prefill")
    decode = counts_matrix(traces.traces, traces.geometry, "decode")
    partition, _ = fit_partition(
        prefill, decode, traces.geometry, workers, version=1, model=MODEL, seed=seed
    )
    blob = partition_to_blob(partition)
    bucket = f"{bus.subjects.namespace}-partitions"
    ref = await bus.object_put(bucket, "v1", blob)
    assert ref.sha256 == blob_sha256(blob)
    await bus.js_publish(
        bus.subjects.partition_active,
        PartitionAnnouncement(
            version=1,
            model=MODEL,
            object_name="v1",
            sha256=ref.sha256,
            created_ts_s=time.time(),
            k=partition.k,
            dim=partition.calibration.dim,
            workers=list(partition.workers),
        ),
    )
    return partition.k


async def wait_routers_ready(bus: Bus, routers: int, decoders: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    query = RouterControl(policy=None, tau=None, load_measure=None)
    while True:
        replies = [
            r
            for r in await bus.request_many(
                bus.subjects.control_router,
                query,
                RouterControlReply,
                timeout_s=1.0,
                max_replies=routers,
            )
            if isinstance(r, RouterControlReply)
        ]
        if len(replies) == routers and all(
            r.partition_version == 1 and r.live_workers == decoders for r in replies
        ):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"routers not ready with partition 1 and all workers: {replies}")
        await asyncio.sleep(0.2)


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


async def drive(
    config: PipelineConfig,
    stack: Stack,
    sampler: RssSampler | None = None,
    progress: Progress = NO_PROGRESS,
) -> dict[str, Any]:
    """Install a partition, wait for the routers, then replay each rate; `progress` gets
    each rate's `duration_s` in seconds as it runs."""
    spec = SyntheticSpec(num_topics=8, num_moe_layers=24, num_experts=128, top_k=1)
    rng = np.random.default_rng(config.seed)
    calibration = generate(spec, 600, rng, id_prefix="cal")
    traffic = generate(spec, 2000, rng, id_prefix="req")
    bus = await Bus.connect(stack.bus_settings(), "eldr-bench-pipeline")
    results = []
    try:
        workers = [f"decode-{i}" for i in range(config.decoders)]
        await install_partition(bus, calibration, workers, config.seed)
        await wait_routers_ready(bus, config.routers, config.decoders)
        # The replayer is a Python process too: keep full collections of its start-up
        # heap from pausing it mid-measurement (see eldr.runtime).
        gc.collect()
        gc.freeze()
        for rate in config.rates:
            progress.describe(f"{rate:g}/s")
            n = int(rate * config.duration_s)
            if sampler is not None:
                sampler.window()  # start this rate's window
            since_s = time.time() - 1.0
            replay = TraceReplayer(
                bus,
                traffic,
                ReplayConfig(
                    model=MODEL,
                    rate_per_s=rate,
                    seed=config.seed,
                    send_jobs=False,
                    decision_timeout_s=5.0,
                ),
            )
            ticker = _WallTicker(progress, config.duration_s)
            ticking = asyncio.create_task(ticker.run())
            try:
                async with replay:
                    summary = await replay.run(n)
            finally:
                ticking.cancel()
            ticker.finish()
            rss = sampler.window() if sampler is not None else {}
            latencies = np.array(
                [r.decision_latency_s for r in replay.records if r.decision_latency_s is not None]
            )
            in_router = np.array(
                [
                    r.router_decide_s
                    for r in replay.records
                    if r.decision_latency_s is not None and r.router_decide_s is not None
                ]
            )
            sent_ids = {r.request_id for r in replay.records if r.sent}
            decisions, distinct = await count_decisions(bus, since_s, sent_ids)
            row = {
                "rate": rate,
                "sent": summary.sent,
                "decided": summary.decided,
                "lost": summary.lost,
                "conflicting": summary.conflicting,
                "achieved_rate": round(summary.achieved_rate_per_s, 1),
                "latency_p50_ms": round(float(np.percentile(latencies, 50)) * 1e3, 3),
                "latency_p99_ms": round(float(np.percentile(latencies, 99)) * 1e3, 3),
                "latency_max_ms": round(float(latencies.max()) * 1e3, 3),
                "router_p50_ms": round(float(np.percentile(in_router, 50)) * 1e3, 3),
                "router_p99_ms": round(float(np.percentile(in_router, 99)) * 1e3, 3),
                "fallbacks": dict(summary.fallbacks),
                "max_lag_ms": round(summary.max_lag_s * 1e3, 1),
                "stream_decisions": decisions,
                "stream_lost": len(sent_ids) - distinct,
                "stream_doubled": decisions - distinct,
                "rss": rss,
            }
            log.info("rate %.0f: %s", rate, row)
            results.append(row)
    finally:
        await bus.drain()
    return {
        "input": {
            "synthetic": True,
            "routers": config.routers,
            "policy": config.policy,
            "signature_replicas": config.signatures,
            "decoders": config.decoders,
            "duration_s": config.duration_s,
            "geometry": "24 MoE layers x 128 experts, top-1, 16-token blocks",
        },
        "results": results,
    }


def run(config: PipelineConfig, progress: Progress = NO_PROGRESS) -> dict[str, Any]:
    services = tuple(s for s in SERVICES if s.name in ("signature", "simdecode", "router"))
    stack_config = StackConfig(
        namespace=config.namespace or f"bench{uuid.uuid4().hex[:8]}",
        state_dir=config.state_dir,
        decoders=config.decoders,
        replicas={"signature": config.signatures, "router": config.routers},
        services=tuple(
            s if s.name != "router" else type(s)(s.name, s.replicas, ("signature", "simdecode"))
            for s in services
        ),
        env={
            "ELDR_POLICY": config.policy,
            "OPENBLAS_NUM_THREADS": "1",
            "ELDR_PENDING_TTL_S": "2",
            # Requests are not sent on, so no decode profile ends them: the routers forget
            # them after 2 s (pending load; cost-aware routing's per-worker activity).
            "ELDR_ACTIVITY_TTL_S": "2",
        },
        log_level="WARNING",
        echo=False,
        log_dir=config.state_dir / "logs",
    )
    with Stack(stack_config) as stack:

        def pids() -> dict[str, int]:
            found = {p.instance_id: p.pid for p in stack.processes if p.returncode is None}
            if stack.nats is not None and stack.nats.pid is not None:
                found["nats-server"] = stack.nats.pid
            found["bench (replayer)"] = os.getpid()
            return found

        sampler = RssSampler(pids, config.rss_every_s).start()
        try:
            return run_async(drive(config, stack, sampler, progress))
        finally:
            sampler.stop()


def format_table(result: dict[str, Any]) -> str:
    inp = result["input"]
    lines = [
        f"pipeline: {inp['routers']} router(s) (policy {inp['policy']}), "
        f"{inp['signature_replicas']} signature "
        f"replica(s), {inp['decoders']} simulated decode workers, {inp['duration_s']} s per "
        f"rate, SYNTHETIC requests ({inp['geometry']})",
        f"{'rate/s':>7} {'achieved':>8} {'sent':>6} {'decided':>7} {'lost':>4} {'P50 ms':>7} "
        f"{'P99 ms':>7} {'max ms':>7} {'router P50':>10} {'router P99':>10}",
    ]
    for r in result["results"]:
        lines.append(
            f"{r['rate']:>7.0f} {r['achieved_rate']:>8.1f} {r['sent']:>6} {r['decided']:>7} "
            f"{r['lost']:>4} {r['latency_p50_ms']:>7.2f} {r['latency_p99_ms']:>7.2f} "
            f"{r['latency_max_ms']:>7.1f} {r['router_p50_ms']:>10.2f} {r['router_p99_ms']:>10.2f}"
        )
    lines.append(
        "P50/P99/max: PrefillDone publish -> decision received, in the replayer; router P50/P99: "
        "the router's own part (PrefillDone taken -> decision built, signature fetch "
        "included; Decision.decide_s)"
    )
    for r in result["results"]:
        lines.append(
            f"rate {r['rate']:.0f}: DECISIONS stream holds {r['stream_decisions']} decisions for "
            f"{r['sent']} requests sent: {r['stream_lost']} lost, {r['stream_doubled']} doubled"
        )
        if r["rss"]:
            lines.append(f"  {'process':<18} {'start MiB':>9} {'peak MiB':>9} {'end MiB':>9}")
            for name, m in r["rss"].items():
                lines.append(
                    f"  {name:<18} {m['first_mib']:>9.1f} {m['peak_mib']:>9.1f} "
                    f"{m['last_mib']:>9.1f}"
                )
    return "\n".join(lines)
