"""`eldr compare-live`: the same requests through the live stack and through the simulator.

The live side is `eldr demo`'s run (local stack: embedded nats-server, 2 signature
replicas, the trainer, simulated decode workers in real time, 2 routers; calibration under
round-robin, a refit, then one evaluation pass per policy). While each evaluation pass runs,
a probe on the bus records what the routers hear and when: every decision (its replica, its
worker, the fleet load it saw, when it was built), every load report, finish event and
decode summary, each with its send time (the messages' own wall-clock stamps, one machine,
one clock) and receive time.

The simulated side replays each live pass in `eldr.sim.cluster.simulate` with the same
requests in the same order at the same times (the live decisions' times), the same decode
workers (count, batch limit, deployment), the live trainer's partition (fetched from the
object store: the paper rule's scores are the live router's), and the live router's demand
estimate for `eldr_cost`. Three simulations per policy:

- **sim, live information**: the policy, routed through simulated router replicas that
  know what the live ones know (`eldr.sim.information`), with every delay measured by the
  probe in this very run;
- **sim, perfect information**: the policy with the true fleet state at every decision;
- **replay of the live assignments**: each request on the worker the live router chose, at
  the time its job reached it: what the simulator's workers make of the live routing.

So the difference between the live numbers and the replay is the workers' execution in
real time (timing), between the replay and the live-information simulation what routing
the information model does not capture, and between the two simulations what the
information delays cost. The probe also measures how stale each live decision's load view
was (`Decision.fleet` against the requests truly in flight then, rebuilt from decisions and
finishes), beside the same measure in the simulation.

What it checks and what it cannot: the live decode workers (`simdecode`) step on the cost
model's own schedule, the same cost model the simulator's workers use. So agreement here
says that the simulator models what routers know and when (the information model: load
reports, decision and finish hops, the replica split) and the routing it leads to; it says
nothing of whether the cost model's step time is right, which is the cost model in both
(that needs real engines: `eldr bench-moe-step`, the vLLM tests). The evaluation arrivals
are the demo's (`eldr.dev.demo`: copies of a request kept apart), and every policy is
compared with the best load-only baseline of each statistic, live and in each simulation.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from eldr.bus import Bus, BusError, Delivery, RemoteError, Subscription
from eldr.core.costmodel import Deployment
from eldr.core.partition.partition import Partition
from eldr.core.routing.activity import ExpertDemand
from eldr.core.routing.decide import RouteRequest, request_demand
from eldr.core.routing.pipeline import FixedAssignment, Policy, make_policy
from eldr.core.routing.profile import ProfileBase
from eldr.core.workload.trace import TraceSet, expert_counts
from eldr.data.deployments import load_catalog
from eldr.dev.demo import (
    DemoConfig,
    DemoResult,
    PolicyResult,
    add_run_arguments,
    against_best_baseline,
    best_baselines,
    demo_requests,
    format_arrivals,
    load_input,
    run_config_fields,
    run_demo,
)
from eldr.dev.stack import Stack
from eldr.partitions.codec import partition_from_blob
from eldr.progress import terminal_progress
from eldr.replay.source import fetch_partition_version
from eldr.sim.cluster import (
    SimConfig,
    SimRequest,
    SimResult,
    flatten_decode_ids,
    simulate,
    worker_name,
)
from eldr.sim.information import InformationModel
from eldr.sim.information import describe as describe_information
from eldr.sim.traffic import TrafficDriver, TrafficSummary
from eldr.wire import Decision, DecodeSummary, LoadReport, RequestFinished

log = logging.getLogger(__name__)

POLICIES: tuple[ProfileBase, ...] = DemoConfig.policies
"""Compared, in this order: the four load-only baselines, the paper's rule, the default."""
CHECKS = (
    "checks the information model (what routers know and when: load reports, decision and "
    "finish hops, the replica split) and the routing it leads to; cannot check the step "
    "cost: the live decode workers step on the cost model's schedule, so TPOT is the cost "
    "model's in both"
)
"""What agreement between live and simulated means (printed with every report)."""
KINDS: tuple[str, ...] = (
    "live",
    "sim_live_information",
    "sim_perfect",
    "replay_live_assignments",
)
WORKER_PREFIX = "decode-"
"""The local stack's simulated decode worker ids: prefix + slot."""
PROBE_GRACE_S = 0.3
"""After a pass, how long the probe keeps listening for the last finish events."""
UNION_TARGET_PCT = 2.0
TPOT_TARGET_PCT = 1.0
"""Issue 17's target: live union within 2% of the simulator's, TPOT P50 and P99 within 1%."""


# --- the live side: what the routers heard --------------------------------------------------


@dataclass
class _Heard:
    decisions: dict[str, tuple[Decision, float]] = field(default_factory=dict)
    """request id -> (decision, wall time the probe received it)."""
    report_hops_s: list[float] = field(default_factory=list)
    finished: dict[str, tuple[RequestFinished, float]] = field(default_factory=dict)
    summaries: dict[str, DecodeSummary] = field(default_factory=dict)


class LiveProbe:
    """Subscribes to what every router subscribes to and notes when each message arrived."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.heard = _Heard()
        self._subs: list[Subscription] = []

    async def start(self) -> None:
        s = self.bus.subjects
        self.heard = _Heard()
        self._subs = [
            await self.bus.subscribe(s.decisions_all, Decision, self._on_decision),
            await self.bus.subscribe(s.load_all, LoadReport, self._on_report),
            await self.bus.subscribe(s.finished_all, RequestFinished, self._on_finished),
            await self.bus.subscribe(s.profiles_all, DecodeSummary, self._on_summary),
        ]

    async def stop(self) -> None:
        for sub in self._subs:
            await sub.stop()
        self._subs = []

    async def _on_decision(self, msg: Decision, _: Delivery) -> None:
        self.heard.decisions.setdefault(msg.request_id, (msg, time.time()))

    async def _on_report(self, msg: LoadReport, _: Delivery) -> None:
        self.heard.report_hops_s.append(time.time() - msg.ts_s)

    async def _on_finished(self, msg: RequestFinished, _: Delivery) -> None:
        self.heard.finished.setdefault(msg.request_id, (msg, time.time()))

    async def _on_summary(self, msg: DecodeSummary, _: Delivery) -> None:
        self.heard.summaries.setdefault(msg.request_id, msg)


@dataclass
class LivePass:
    """One live evaluation pass, per request in the order the decisions were built."""

    policy: str
    trace_index: np.ndarray
    """int64: index into the evaluation pool."""
    decided_s: np.ndarray
    """Decision built (`Decision.ts_s`), seconds after the pass's first decision."""
    worker: np.ndarray
    """int64: the slot of the worker the router chose."""
    router: np.ndarray
    """int64: index of the replica that decided (routers sorted by id)."""
    seen_in_flight: np.ndarray
    """int64 [requests, workers]: the in-flight counts the decision saw (`Decision.fleet`);
    -1 for a worker it did not list (a fleet-scale profile records only its candidates)."""
    finish_s: np.ndarray
    """The request's last token at its worker (estimated, see `delays`), same clock."""
    delays: dict[str, float]
    """Median measured delays, seconds (the information model's inputs)."""
    fallbacks: dict[str, int]


def _median(values: list[float]) -> float:
    return float(np.median(values)) if values else float("nan")


def build_pass(
    policy: str,
    heard: _Heard,
    driver: TrafficDriver,
    decoders: int,
    time_scale: float,
) -> LivePass:
    """Join the driver's records with what the probe heard."""
    records = [r for r in driver.records if r.worker_id is not None]
    rows = [(r, heard.decisions[r.request_id]) for r in records if r.request_id in heard.decisions]
    if not rows:
        raise RuntimeError(f"the probe heard no decision of the {policy} pass")
    rows.sort(key=lambda rd: rd[1][0].ts_s)
    t0 = rows[0][1][0].ts_s
    routers = sorted({d.router_id for _, (d, _) in rows})
    report_hop = _median(heard.report_hops_s)
    decision_hops = [recv - d.ts_s for _, (d, recv) in rows]
    finish_hops: list[float] = []
    dispatch: list[float] = []
    finish_lag: list[float] = []
    n = len(rows)
    finish_s = np.full(n, np.nan)
    for i, (r, (d, _)) in enumerate(rows):
        fin = heard.finished.get(r.request_id)
        if fin is None:
            continue
        msg, recv = fin
        finish_hops.append(recv - msg.ts_s)
        prof = heard.summaries.get(r.request_id)
        if msg.decode_s is None or prof is None or prof.tpot_s is None:
            finish_s[i] = msg.ts_s - t0
            continue
        # The gateway sent the job decode_s before it published the finish; the worker
        # took it one hop later and produced its last token tokens x TPOT after that
        # (TPOT in simulated seconds, scaled to real ones).
        job_sent = msg.ts_s - msg.decode_s
        dispatch.append(job_sent - d.ts_s + report_hop)
        last_token = job_sent + report_hop + prof.tokens * prof.tpot_s * time_scale
        finish_s[i] = last_token - t0
        finish_lag.append(recv - last_token)
    seen = seen_in_flight([d for _, (d, _) in rows], decoders)
    fallbacks: dict[str, int] = {}
    for _, (d, _) in rows:
        if d.fallback:
            fallbacks[d.fallback] = fallbacks.get(d.fallback, 0) + 1
    return LivePass(
        policy=policy,
        trace_index=np.array([r.trace_index for r, _ in rows], dtype=np.int64),
        decided_s=np.array([d.ts_s - t0 for _, (d, _) in rows]),
        worker=np.array([_slot(d.worker_id) for _, (d, _) in rows], dtype=np.int64),
        router=np.array([routers.index(d.router_id) for _, (d, _) in rows], dtype=np.int64),
        seen_in_flight=seen,
        finish_s=finish_s,
        delays={
            "report_hop_s": report_hop,
            "decision_hop_s": _median(decision_hops),
            "finish_hop_s": _median(finish_hops),
            "dispatch_s": _median(dispatch),
            "finish_lag_s": _median(finish_lag),
            "decide_s": _median([d.decide_s for _, (d, _) in rows]),
        },
        fallbacks=fallbacks,
    )


def seen_in_flight(decisions: Sequence[Decision], decoders: int) -> np.ndarray:
    """int64 [decisions, workers]: the in-flight count each decision read of each worker, -1
    where it read none. A fleet-scale profile's record lists its candidates' loads in
    `considered` and leaves `fleet` empty; the others list the whole fleet in `fleet`."""
    seen = np.full((len(decisions), decoders), -1, dtype=np.int64)
    for i, d in enumerate(decisions):
        for wid, in_flight, *_ in d.fleet or d.considered:
            seen[i, _slot(wid)] = in_flight
    return seen


def _slot(worker_id: str) -> int:
    if not worker_id.startswith(WORKER_PREFIX):
        raise ValueError(f"unexpected decode worker id {worker_id!r}")
    return int(worker_id[len(WORKER_PREFIX) :])


def true_in_flight(live: LivePass) -> np.ndarray:
    """int64 [requests, workers]: requests truly on each worker (decided, last token not yet
    produced) when each decision was built, that decision excluded."""
    n, w = live.seen_in_flight.shape
    out = np.zeros((n, w), dtype=np.int64)
    finish = np.where(np.isnan(live.finish_s), np.inf, live.finish_s)
    for i in range(n):
        t = live.decided_s[i]
        before = np.flatnonzero((live.decided_s[:i] <= t) & (finish[:i] > t))
        out[i] = np.bincount(live.worker[before], minlength=w)
    return out


def live_view_error(live: LivePass) -> float:
    """Mean |in-flight the router saw - truly in flight| per worker over the decisions,
    over the workers each decision listed (a fleet-scale profile lists its candidates)."""
    truth = true_in_flight(live)
    listed = live.seen_in_flight >= 0
    return float(np.abs(live.seen_in_flight - truth)[listed].mean()) if listed.any() else math.nan


def split_pattern(router: np.ndarray) -> dict[str, Any]:
    """How arrivals were split between replicas: shares, and how often two consecutive
    decisions came from the same replica (0.5 for an even random split of two, 0 when they
    alternate)."""
    counts = np.bincount(router)
    same = float(np.mean(router[1:] == router[:-1])) if router.size > 1 else float("nan")
    return {
        "shares": [round(float(c) / router.size, 3) for c in counts],
        "consecutive_same_replica": round(same, 3),
    }


Lateness = tuple[float, float, float, float]
"""(late seconds, late steps, steps, lost seconds) of the simulated decode workers."""


def worker_lateness(urls: list[str]) -> Lateness:
    """Lateness summed over the simulated decode workers, read from their processes'
    /metrics (`eldr_simdecode_late_seconds_total`, ...)."""
    wanted = {
        "eldr_simdecode_late_seconds_total": 0,
        "eldr_simdecode_late_steps_total": 1,
        "eldr_simdecode_steps_total": 2,
        "eldr_simdecode_lost_seconds_total": 3,
    }
    totals = [0.0, 0.0, 0.0, 0.0]
    for url in urls:
        with urllib.request.urlopen(f"{url}/metrics", timeout=5.0) as response:
            text = response.read().decode()
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in wanted and not line.startswith("#"):
                totals[wanted[name]] += float(line.rsplit(" ", 1)[1])
    return totals[0], totals[1], totals[2], totals[3]


# --- the observer: what `eldr demo` hands over ------------------------------------------------


class CompareObserver:
    """Records each live pass (`eldr.dev.demo.DemoObserver`)."""

    def __init__(self, decoders: int, time_scale: float) -> None:
        self.decoders = decoders
        self.time_scale = time_scale
        self.evaluation: TraceSet | None = None
        self.rate_per_s = 0.0
        self.partition: Partition | None = None
        self.passes: dict[str, LivePass] = {}
        self.late: dict[str, Lateness] = {}
        """policy -> the simulated workers' lateness during its pass."""
        self._probe: LiveProbe | None = None
        self._simdecode_urls: list[str] = []
        self._late_before: Lateness = (0.0, 0.0, 0.0, 0.0)

    def on_stack(self, stack: Stack) -> None:
        self._simdecode_urls = [p.url for p in stack.processes if p.name == "simdecode"]

    async def on_start(self, bus: Bus, evaluation: TraceSet, rate_per_s: float) -> None:
        self.evaluation = evaluation
        self.rate_per_s = rate_per_s

    async def on_partition(self, bus: Bus, version: int) -> None:
        blob = await fetch_partition_version(bus, version, timeout_s=10.0)
        if blob is None:
            raise RuntimeError(f"partition version {version} is not in the object store")
        self.partition = partition_from_blob(blob)

    async def before_pass(self, bus: Bus, policy: str) -> None:
        self._late_before = await asyncio.to_thread(worker_lateness, self._simdecode_urls)
        self._probe = LiveProbe(bus)
        await self._probe.start()

    async def after_pass(
        self, bus: Bus, policy: str, driver: TrafficDriver, summary: TrafficSummary
    ) -> None:
        probe = self._probe
        assert probe is not None
        await asyncio.sleep(PROBE_GRACE_S)  # the last finish events are on their way
        await probe.stop()
        self.passes[policy] = build_pass(
            policy, probe.heard, driver, self.decoders, self.time_scale
        )
        after = await asyncio.to_thread(worker_lateness, self._simdecode_urls)
        before = self._late_before
        self.late[policy] = (
            after[0] - before[0],
            after[1] - before[1],
            after[2] - before[2],
            after[3] - before[3],
        )


# --- the simulated side ------------------------------------------------------------------------


@dataclass(frozen=True)
class SimInputs:
    requests: list[SimRequest]
    counts: list[np.ndarray]
    prompt_tokens: list[int]
    scores: np.ndarray | None
    num_moe_layers: int
    union_slots: int


def sim_inputs(
    evaluation: TraceSet, partition: Partition | None, decoders: int, tau: float | None
) -> SimInputs:
    """The simulations' requests and their scores (`tau`: the widest band of the compared
    profiles, which an approximate centroid index keeps exact; None: no band)."""
    geometry = evaluation.geometry
    counts = [expert_counts(t.prefill, geometry.num_experts) for t in evaluation.traces]
    scores = None
    if partition is not None:
        ids = [f"{WORKER_PREFIX}{i}" for i in range(decoders)]
        scores = np.stack([partition.scores_for(c, ids, tau=tau) for c in counts]).astype(
            np.float32
        )
    return SimInputs(
        requests=[
            SimRequest(
                request_id=t.request_id,
                label=t.label,
                prompt_tokens=t.prompt_tokens,
                decode_flat=flatten_decode_ids(t.decode, geometry.num_experts),
            )
            for t in evaluation.traces
        ],
        counts=counts,
        prompt_tokens=[t.prompt_tokens for t in evaluation.traces],
        scores=scores,
        num_moe_layers=geometry.num_moe_layers,
        union_slots=geometry.signature_dim,
    )


def router_demands(policy: Policy, inputs: SimInputs) -> list[ExpertDemand]:
    """Each request's demand exactly as the live router computes it (`request_demand`)."""
    out = []
    for i, (c, tokens) in enumerate(zip(inputs.counts, inputs.prompt_tokens, strict=True)):
        demand = request_demand(policy.profile, RouteRequest(str(i), "", tokens, counts=c))
        if demand is None:
            raise ValueError(f"evaluation request {i} has no prefill counts")
        out.append(demand)
    return out


def information_from(live: LivePass, routers: int, report_interval_s: float) -> InformationModel:
    """The information model with this pass's measured delays and replica shares."""
    d = live.delays
    counts = np.bincount(live.router, minlength=routers)[:routers].astype(np.float64)
    shares = tuple(float(x) for x in counts / counts.sum()) if counts.sum() else None

    def ok(x: float) -> float:
        return max(0.0, x) if np.isfinite(x) else 0.0

    return InformationModel(
        routers=routers,
        report_interval_s=report_interval_s,
        report_hop_s=ok(d["report_hop_s"]),
        commit_s=0.0,  # the live router counts its own decisions when it makes them
        propagation_s=ok(d["decision_hop_s"]),
        dispatch_s=ok(d["dispatch_s"]),
        finish_lag_s=ok(d["finish_lag_s"]),
        shares=shares if routers > 1 else None,
    )


def simulate_pass(
    live: LivePass,
    policy: Policy,
    inputs: SimInputs,
    cost: Deployment,
    config: DemoConfig,
    rate_per_s: float,
    information: InformationModel | None,
    *,
    submit_delay_s: float = 0.0,
) -> SimResult:
    """The pass's requests at its decision times (+ `submit_delay_s`) through `policy`."""
    arrivals = live.trace_index
    return simulate(
        inputs.requests,
        arrivals,
        policy,
        cost,
        SimConfig(
            num_workers=config.decoders,
            arrival_rate_per_s=rate_per_s,
            num_arrivals=int(arrivals.size),
            max_batch=config.max_batch,
            warmup_fraction=0.0,
            seed=config.seed,
            count_drain=True,
        ),
        num_moe_layers=inputs.num_moe_layers,
        union_slots=inputs.union_slots,
        scores=inputs.scores if policy.wants_scores else None,
        demands=router_demands(policy, inputs) if policy.uses_activity else None,
        information=information,
        arrival_times_s=live.decided_s + submit_delay_s,
    )


@dataclass
class Measured:
    union: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    batch: float
    view_error: float | None = None
    activity_excess: float | None = None


def _of_sim(res: SimResult) -> Measured:
    return Measured(
        union=round(res.expert_union_mean, 4),
        tpot_p50_ms=round(res.tpot_percentile_ms(50), 4),
        tpot_p99_ms=round(res.tpot_percentile_ms(99), 4),
        batch=round(res.batch_mean, 3),
        view_error=round(float(res.view_error.mean()), 3) if res.view_error.size else None,
        activity_excess=(
            round(float(res.activity_excess.mean()), 2) if res.activity_excess.size else None
        ),
    )


def _of_live(r: PolicyResult, view_error: float) -> Measured:
    return Measured(
        union=r.expert_union_mean,
        tpot_p50_ms=r.tpot_p50_ms,
        tpot_p99_ms=r.tpot_p99_ms,
        batch=r.batch_mean,
        view_error=None if math.isnan(view_error) else round(view_error, 3),
    )


@dataclass
class PolicyComparison:
    policy: str
    live: Measured
    sim_live_information: Measured
    sim_perfect: Measured
    replay_live_assignments: Measured
    information: dict[str, Any]
    delays_ms: dict[str, float]
    split: dict[str, Any]
    fallbacks: dict[str, int]
    worker_lateness: dict[str, float] = field(default_factory=dict)
    """The simulated workers' event-loop lateness during the live pass (timing)."""

    def diff_pct(self, sim: Measured) -> dict[str, float]:
        """Live against a simulated measurement, percent of the simulated value."""
        return {
            "union": _pct(self.live.union, sim.union),
            "tpot_p50": _pct(self.live.tpot_p50_ms, sim.tpot_p50_ms),
            "tpot_p99": _pct(self.live.tpot_p99_ms, sim.tpot_p99_ms),
        }

    def meets_target(self) -> bool:
        d = self.diff_pct(self.sim_live_information)
        return (
            abs(d["union"]) <= UNION_TARGET_PCT
            and abs(d["tpot_p50"]) <= TPOT_TARGET_PCT
            and abs(d["tpot_p99"]) <= TPOT_TARGET_PCT
        )


def _pct(new: float, base: float) -> float:
    return round(100.0 * (new - base) / base, 2) if base else float("nan")


@dataclass
class CompareResult:
    demo: DemoResult
    comparisons: list[PolicyComparison]
    wall_s: float

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"demo": self.demo.as_dict(), "wall_s": self.wall_s}
        out["comparisons"] = []
        for c in self.comparisons:
            row = asdict(c)
            row["live_vs_sim_live_information_pct"] = c.diff_pct(c.sim_live_information)
            row["live_vs_sim_perfect_pct"] = c.diff_pct(c.sim_perfect)
            row["live_vs_replay_pct"] = c.diff_pct(c.replay_live_assignments)
            row["meets_target"] = c.meets_target()
            out["comparisons"].append(row)
        out["checks"] = CHECKS
        out["cuts_vs_best_baseline_pct"] = cuts(self.comparisons)
        out["best_baselines"] = {
            kind: best_baselines(_statistics(self.comparisons, kind)) for kind in KINDS
        }
        return out


def _statistics(
    comparisons: list[PolicyComparison], kind: str
) -> dict[str, tuple[float, float, float]]:
    out = {}
    for c in comparisons:
        m: Measured = getattr(c, kind)
        out[c.policy] = (m.union, m.tpot_p50_ms, m.tpot_p99_ms)
    return out


def cuts(comparisons: list[PolicyComparison]) -> dict[str, dict[str, dict[str, Any]]]:
    """Each policy that is not a baseline against the best baseline of each statistic,
    live and in each simulation (the best baseline chosen within each, and named)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for kind in KINDS:
        for policy, v in against_best_baseline(_statistics(comparisons, kind)).items():
            out.setdefault(policy, {})[kind] = v
    return out


def compare(
    demo: DemoResult, observer: CompareObserver, config: DemoConfig, cost: Deployment
) -> list[PolicyComparison]:
    """The three simulations of every live pass, beside it."""
    assert observer.evaluation is not None
    bands = [p.band_tau for p in config.policies if p.band_tau is not None]
    tau = max(bands) if bands else None
    inputs = sim_inputs(observer.evaluation, observer.partition, config.decoders, tau)
    out = []
    for profile, r in zip(config.policies, demo.results, strict=True):
        live = observer.passes[r.policy]
        info = information_from(live, config.router_replicas, config.report_interval_s)
        with_info = simulate_pass(
            live, make_policy(profile), inputs, cost, config, observer.rate_per_s, info
        )
        perfect = simulate_pass(
            live, make_policy(profile), inputs, cost, config, observer.rate_per_s, None
        )
        replay = simulate_pass(
            live,
            FixedAssignment([worker_name(int(w)) for w in live.worker]),
            inputs,
            cost,
            config,
            observer.rate_per_s,
            None,
            submit_delay_s=info.dispatch_s,
        )
        out.append(
            PolicyComparison(
                policy=r.policy,
                live=_of_live(r, live_view_error(live)),
                sim_live_information=_of_sim(with_info),
                sim_perfect=_of_sim(perfect),
                replay_live_assignments=_of_sim(replay),
                information={**info.as_dict(), "description": describe_information(info)},
                delays_ms={k: round(1e3 * v, 3) for k, v in live.delays.items()},
                split=split_pattern(live.router),
                fallbacks=live.fallbacks,
                worker_lateness=_lateness(observer.late.get(r.policy)),
            )
        )
    return out


def _lateness(late: Lateness | None) -> dict[str, float]:
    if late is None or not late[2]:
        return {}
    seconds, steps_late, steps, lost = late
    return {
        "late_s": round(seconds, 3),
        "late_steps_share": round(steps_late / steps, 4),
        "late_ms_per_step": round(1e3 * seconds / steps, 4),
        "lost_s": round(lost, 3),
    }


def run_compare(config: DemoConfig) -> CompareResult:
    started = time.perf_counter()
    if config.time_scale <= 0:
        raise ValueError("time_scale must be positive")
    traces = load_input(config)
    cost = load_catalog().get(config.deployment)
    observer = CompareObserver(config.decoders, config.time_scale)
    with terminal_progress(demo_requests(config), "eldr compare-live", unit="req") as progress:
        demo = run_demo(config, observer=observer, progress=progress, traces=traces)
    comparisons = compare(demo, observer, config, cost)
    return CompareResult(demo, comparisons, round(time.perf_counter() - started, 1))


# --- report ----------------------------------------------------------------------------------


def format_compare(result: CompareResult) -> str:
    demo = result.demo
    inp = demo.input
    kind = "real traces" if not inp["synthetic"] else "SYNTHETIC workload"
    lines = [
        f"input: {inp['traces']} ({kind}), evaluation pool {inp['evaluation_pool']}; "
        f"{inp['decoders']} decode workers, {inp['cost_profile']}, {demo.rate_per_s} req/s",
        format_arrivals(demo.arrivals),
        "live: the local stack; sim: the same requests at the live decision times, the live "
        "partition; replay: the live assignments through the simulator's workers",
        f"this {CHECKS}",
        "",
        f"{'policy':<14} {'metric':<9} {'live':>9} {'sim live-info':>14} {'diff':>7} "
        f"{'sim perfect':>12} {'diff':>7} {'replay':>9} {'diff':>7}",
    ]
    for c in result.comparisons:
        d_info = c.diff_pct(c.sim_live_information)
        d_perf = c.diff_pct(c.sim_perfect)
        d_rep = c.diff_pct(c.replay_live_assignments)
        for metric, attr, key in (
            ("union", "union", "union"),
            ("P50 ms", "tpot_p50_ms", "tpot_p50"),
            ("P99 ms", "tpot_p99_ms", "tpot_p99"),
        ):
            lines.append(
                f"{c.policy if metric == 'union' else '':<14} {metric:<9} "
                f"{getattr(c.live, attr):>9.3f} {getattr(c.sim_live_information, attr):>14.3f} "
                f"{d_info[key]:>+6.2f}% {getattr(c.sim_perfect, attr):>12.3f} "
                f"{d_perf[key]:>+6.2f}% {getattr(c.replay_live_assignments, attr):>9.3f} "
                f"{d_rep[key]:>+6.2f}%"
            )
        lines.append(
            f"{'':<14} load error: live {c.live.view_error}, sim "
            f"{c.sim_live_information.view_error} requests/worker; activity excess (sim) "
            f"{c.sim_live_information.activity_excess}; "
            f"target {'met' if c.meets_target() else 'MISSED'}"
        )
    lines.append("")
    lines.append(
        "against the best baseline of each statistic, chosen within each column (live / sim "
        "live-info / sim perfect / replay; the baseline in brackets):"
    )
    for policy, kinds in cuts(result.comparisons).items():
        for metric in ("union", "tpot_p50", "tpot_p99"):
            vals = " / ".join(
                f"{kinds[k][metric]:+.2f}% ({kinds[k][metric + '_baseline']})" for k in KINDS
            )
            lines.append(f"  {policy:<14} {metric:<9} {vals}")
    lines.append("")
    live = {r.policy: r for r in demo.results}
    for c in result.comparisons:
        lines.append(
            f"{c.policy}: measured delays (median, ms) {c.delays_ms}; split {c.split}; "
            f"workers late {c.worker_lateness or '-'}; fallbacks {c.fallbacks or '-'}; "
            f"beside a copy live {_copies(live.get(c.policy))}"
        )
    lines.append(f"wall time {result.wall_s} s")
    return "\n".join(lines)


def _copies(r: PolicyResult | None) -> str:
    if r is None or r.copies_in_flight_share is None or r.copies_same_worker_share is None:
        return "-"
    return (
        f"{100 * r.copies_in_flight_share:.1f}% anywhere, "
        f"{100 * r.copies_same_worker_share:.1f}% on its worker"
    )


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "compare-live",
        help="the same requests through the live stack and the simulator, side by side",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_run_arguments(p)
    p.add_argument("--synthetic-requests", type=int, default=600)
    p.add_argument("--routers", type=int, default=2, help="router replicas (default 2)")
    p.add_argument(
        "--report-interval", type=float, default=0.1, help="simdecode load-report period, s"
    )
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
    config = DemoConfig(
        **run_config_fields(args, POLICIES),
        synthetic_requests=args.synthetic_requests,
        router_replicas=args.routers,
        report_interval_s=args.report_interval,
    )
    try:
        result = run_compare(config)
    except (BusError, RemoteError, RuntimeError, TimeoutError) as exc:
        log.error("compare-live failed: %s (service logs in %s)", exc, config.state_dir / "logs")
        return 1
    print(format_compare(result))
    if args.json:
        args.json.write_text(json.dumps(result.as_dict(), indent=2))
        print(f"result: {args.json}")
    return 0
