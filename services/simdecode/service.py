"""`eldr serve simdecode`: simulated decode workers for development and tests.

Wiring only: settings -> deployment -> `SimDecodeHost` (services/simdecode/host.py), whose
batching logic is the pure `eldr.sim.worker.BatchingWorker`. On stop (an `on_stopping`
callback, run while still connected): refuse new jobs and publish a draining report, let
accepted requests finish for `simdecode_drain_grace_s`, abandon the rest.
"""

from __future__ import annotations

from eldr.data.deployments import load_catalog
from eldr.runtime import ServiceContext, service_main

from .host import HostConfig, SimDecodeHost
from .metrics import SimDecodeMetrics
from .settings import SimDecodeSettings

NAME = "simdecode"


def host_config(settings: SimDecodeSettings) -> HostConfig:
    cost = load_catalog(settings.simdecode_profiles_file).get(settings.simdecode_profile)
    return HostConfig(
        worker_ids=tuple(settings.worker_ids()),
        cost=cost,
        num_experts=settings.simdecode_num_experts or cost.model.num_experts,
        time_scale=settings.simdecode_time_scale,
        max_batch=settings.simdecode_max_batch,
        kv_capacity_tokens=settings.simdecode_kv_capacity_tokens,
        report_interval_s=settings.simdecode_report_interval_s,
        drain_grace_s=settings.simdecode_drain_grace_s,
        max_lag_s=settings.simdecode_max_lag_s,
        summary_queue=settings.simdecode_profile_queue,
        publish_summaries=settings.simdecode_publish_profiles,
    )


async def setup(ctx: ServiceContext[SimDecodeSettings]) -> None:
    host = SimDecodeHost(ctx.bus, host_config(ctx.settings), SimDecodeMetrics(ctx.registry))
    await host.start()

    async def drain() -> None:
        await host.drain()

    ctx.on_stopping(drain)
    ctx.set_ready()


def main() -> int:
    return service_main(NAME, SimDecodeSettings, setup)
