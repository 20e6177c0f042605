"""Trainer service: refits the partition from recent traffic and publishes new versions.

A shell around `eldr.training.trainer.Trainer` (the window, the triggers, the fit, the shadow gate,
storing and announcing; see that module for how a refit goes): this module builds it from
the settings, feeds it, answers `RefitRequest`s, runs the refit schedule and exports what
it reports as metrics.

Inputs: every routing decision (`{ns}.decisions.*`, with the request's prefill counts),
decode summaries (`{ns}.profiles.*`), the gateways' finish events (`{ns}.finished.*`) and
decode workers' load reports (`{ns}.load.*`). At start the training window
(`eldr.core.training.trainwindow`) is rebuilt by replaying the last `window_max_age_s` of DECISIONS,
PROFILES and FINISHED (and the last `worker_ttl_s` of LOAD); the same replays then deliver
live messages.

Refits run on a `RefitRequest` on `{ns}.trainer.refit` ("request"), and when the trainer
says one is due, checked every TICK_S: every `refit_interval_s` ("schedule"), worker churn
("churn") or drift ("drift"). A promoted version is stored in the database, put in the
object store bucket `{ns}-partitions` as `v{version}` and announced on
`{ns}.partition.active` (JetStream PARTITIONS); a rejected one is stored as rejected
(`eldr_trainer_refits_total{outcome="rejected"}`, `eldr_trainer_shadow_union_per_layer`).
"""

from __future__ import annotations

import asyncio
import logging
import time

from eldr.bus import Delivery, Reject, build_topology
from eldr.bus.topology import DECISIONS, FINISHED, IDENTITY, LOAD, PARTITIONS, PROFILES
from eldr.core.partition.partition import geometry_problem
from eldr.runtime import ServiceContext, service_main
from eldr.training.trainer import (
    PartitionAnnouncer,
    SystemClock,
    Trainer,
    TrainerConfig,
    TrainerDatabase,
)
from eldr.wire import (
    Decision,
    DecodeSummary,
    LoadReport,
    RefitReply,
    RefitRequest,
    RequestFinished,
)

from .metrics import TrainerMetrics
from .settings import TrainerSettings

log = logging.getLogger(__name__)

TRAINER_QUEUE = "trainer"
"""Queue group on `{ns}.trainer.refit`: one trainer replica answers each request."""
TICK_S = 1.0


class TrainerService:
    def __init__(self, ctx: ServiceContext[TrainerSettings]) -> None:
        self.ctx = ctx
        s = ctx.settings
        self.settings = s
        self.topology = build_topology(s.namespace, s)
        self.metrics = TrainerMetrics(ctx.registry)
        self.limits = s.geometry_limits()
        clock = SystemClock()
        self.database = TrainerDatabase(
            s.database_url,
            migrate_on_start=s.migrate_on_start,
            connect_timeout_s=s.database_connect_timeout_s,
            sqlite_timeout_s=s.write_lock_timeout_s,
        )
        announcer = PartitionAnnouncer(
            ctx.bus,
            bucket=self.topology.partitions_bucket,
            subject=ctx.bus.subjects.partition_active,
            stream=self.topology.stream_name(PARTITIONS),
            clock=clock,
        )
        self.trainer = Trainer(
            TrainerConfig.from_settings(s), self.database, announcer, self.metrics, clock
        )

    def _check_geometry(self, model: str | None, shape: list[int]) -> None:
        """Refuse counts of a geometry this trainer does not fit (`geometry_problem`, the
        router's check), before they enter the window; a profile names no model."""
        n_layers, n_experts = shape
        problem = geometry_problem(self.trainer.active, self.limits, model, n_layers, n_experts)
        if problem is not None:
            raise Reject("geometry_mismatch", problem)

    async def on_decision(self, msg: Decision, delivery: Delivery) -> None:
        if msg.signature is not None:
            self._check_geometry(msg.model, msg.signature.shape)
        self.trainer.add_decision(msg, delivery.timestamp_s)

    async def on_summary(self, msg: DecodeSummary, delivery: Delivery) -> None:
        self._check_geometry(None, msg.counts.shape)
        self.trainer.add_summary(msg, delivery.timestamp_s)

    async def on_finished(self, msg: RequestFinished, delivery: Delivery) -> None:
        self.trainer.add_finished(msg, delivery.timestamp_s)

    async def on_load(self, msg: LoadReport, delivery: Delivery) -> None:
        self.trainer.add_load(msg, delivery.timestamp_s)

    async def on_refit_request(self, msg: RefitRequest) -> RefitReply:
        log.info("refit requested: %s (k=%s)", msg.reason or "-", msg.k)
        return await self.trainer.refit(msg.reason or "requested", msg.k, trigger="request")

    async def housekeeping(self) -> None:
        """Every TICK_S: age the window, refresh gauges, and refit when one is due."""
        due = self.trainer.due()
        if due is not None:
            trigger, reason = due
            await self.trainer.refit(reason, None, trigger=trigger)


async def setup(ctx: ServiceContext[TrainerSettings]) -> None:
    svc = TrainerService(ctx)
    trainer = svc.trainer
    s, bus, subjects, topo = ctx.settings, ctx.bus, ctx.bus.subjects, svc.topology
    ctx.stack.callback(svc.database.close)
    await asyncio.to_thread(trainer.load_active_version)
    now_s = time.time()
    replays = [
        await bus.read_back(
            topo.stream_name(PROFILES),
            subjects.profiles_all,
            DecodeSummary,
            svc.on_summary,
            start_time_s=now_s - s.window_max_age_s,
            identity=IDENTITY[DecodeSummary],
        ),
        await bus.read_back(
            topo.stream_name(DECISIONS),
            subjects.decisions_all,
            Decision,
            svc.on_decision,
            start_time_s=now_s - s.window_max_age_s,
        ),
        await bus.read_back(
            topo.stream_name(FINISHED),
            subjects.finished_all,
            RequestFinished,
            svc.on_finished,
            start_time_s=now_s - s.window_max_age_s,
            identity=IDENTITY[RequestFinished],
        ),
    ]
    if not s.trainer_workers:
        replays.append(
            await bus.read_back(
                topo.stream_name(LOAD),
                subjects.load_all,
                LoadReport,
                svc.on_load,
                start_time_s=now_s - s.worker_ttl_s,
                identity=IDENTITY[LoadReport],
            )
        )
    try:
        await asyncio.gather(*(r.wait_caught_up(timeout_s=s.replay_timeout_s) for r in replays))
    except TimeoutError:
        log.warning(
            "window replay not caught up after %.0f s; serving with %d requests so far",
            s.replay_timeout_s,
            len(trainer.window),
        )
    log.info(
        "training window rebuilt: %d requests (%d with decode summaries), %d live workers",
        len(trainer.window),
        trainer.window.with_summary,
        len(trainer.workers(time.time())),
    )
    await trainer.reconcile_announcement()
    trainer.restart_schedule()
    ctx.every("housekeeping", TICK_S, svc.housekeeping, first_after_s=TICK_S, until="stop")

    async def cancel_fit() -> None:
        # A fit under way stops at its next checkpoint, so the drain does not wait for it.
        trainer.cancel_fit()

    ctx.on_stopping(cancel_fit)
    await bus.serve(subjects.trainer_refit, TRAINER_QUEUE, RefitRequest, svc.on_refit_request)
    ctx.set_ready()
    log.info(
        "trainer %s ready: refit every %s, window %d requests / %.0f s, workers %s",
        s.instance_id,
        f"{s.refit_interval_s:g} s" if s.refit_interval_s > 0 else "(on request only)",
        s.window_max_samples,
        s.window_max_age_s,
        ",".join(s.trainer_workers) if s.trainer_workers else "from load reports",
    )


def main() -> int:
    return service_main("trainer", TrainerSettings, setup)
