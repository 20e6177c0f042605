"""`eldr serve simprefill`: a simulated prefill worker + gateway replaying traces forever.

A thin shell over `eldr.sim.traffic.TrafficDriver`: load or generate the traces, replay
them in rounds at the configured rate, log each round's summary and count its outcomes.
On stop (an `on_stopping` callback, run while still connected): stop starting requests, let
those in flight get their decision and job, then disconnect.
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np

from eldr.core.workload.synthetic import SyntheticSpec, generate
from eldr.core.workload.trace import TraceSet
from eldr.data.traces import load_trace_dir
from eldr.runtime import ServiceContext, service_main
from eldr.sim.traffic import TrafficConfig, TrafficDriver

from .metrics import SimPrefillMetrics
from .settings import SimPrefillSettings

log = logging.getLogger(__name__)

NAME = "simprefill"


def load_traces(settings: SimPrefillSettings) -> TraceSet:
    if settings.simprefill_traces_dir is not None:
        return load_trace_dir(
            settings.simprefill_traces_dir, num_experts=settings.simprefill_num_experts
        )
    spec = SyntheticSpec(
        num_topics=settings.simprefill_synthetic_topics,
        num_moe_layers=settings.simprefill_synthetic_layers,
        num_experts=settings.simprefill_synthetic_experts,
        top_k=settings.simprefill_synthetic_top_k,
        block_size=settings.simprefill_block_size,
    )
    rng = np.random.default_rng(settings.simprefill_seed)
    return generate(spec, settings.simprefill_synthetic_requests, rng, id_prefix="simprefill")


def replay_config(settings: SimPrefillSettings) -> TrafficConfig:
    rate = settings.simprefill_rate_per_s
    return TrafficConfig(
        prefill_worker=settings.simprefill_worker_id,
        model=settings.simprefill_model,
        block_size=settings.simprefill_block_size,
        rate_per_s=rate if rate > 0 else None,
        seed=settings.simprefill_seed,
        decision_timeout_s=settings.simprefill_decision_timeout_s,
        job_timeout_s=settings.simprefill_job_timeout_s,
        send_jobs=settings.simprefill_send_jobs,
        max_in_flight=settings.simprefill_max_in_flight,
        local_signatures=settings.simprefill_local_signatures,
        local_summary_blocks=settings.simprefill_local_summary_blocks,
        block_hash_key=settings.block_hash_key_bytes(),
    )


async def replay_forever(
    driver: TrafficDriver, settings: SimPrefillSettings, metrics: SimPrefillMetrics
) -> None:
    remaining = settings.simprefill_count or None
    while remaining is None or remaining > 0:
        n = (
            settings.simprefill_round
            if remaining is None
            else min(remaining, settings.simprefill_round)
        )
        summary = await driver.run(n)
        metrics.observe(driver, summary)
        log.info(
            "simprefill round: %d sent, %d decided (%d from the stream), %d lost, "
            "p50 %.2f ms, p99 %.2f ms, %d errors",
            summary.sent,
            summary.decided,
            summary.recovered,
            summary.lost,
            summary.latency_p50_ms,
            summary.latency_p99_ms,
            summary.errors,
        )
        if remaining is not None:
            remaining -= n
        if len(driver.records) < n:
            return  # asked to stop
    log.info("simprefill replayed its %d requests; idle", settings.simprefill_count)


async def setup(ctx: ServiceContext[SimPrefillSettings]) -> None:
    settings = ctx.settings
    traces = await asyncio.to_thread(load_traces, settings)
    log.info("simprefill replaying %d traces from %s", len(traces), traces.source)
    driver = TrafficDriver(ctx.bus, traces, replay_config(settings))
    await driver.start()
    metrics = SimPrefillMetrics(ctx.registry)
    # A crash is logged and makes the service not ready (ServiceContext.spawn).
    replay = ctx.spawn("replay", lambda: replay_forever(driver, settings, metrics))
    ctx.set_ready()

    async def drain() -> None:
        driver.request_stop()
        await replay.wait()  # the requests in flight get their decision and job
        await driver.close()

    ctx.on_stopping(drain)


def main() -> int:
    return service_main(NAME, SimPrefillSettings, setup)
