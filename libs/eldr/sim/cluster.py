"""Discrete-event simulation of the decode side of a PD-disaggregated MoE cluster.

Requests arrive (after prefill) as a Poisson process, a routing policy assigns each to one of
W decode workers, and each worker runs continuous batching (`eldr.sim.worker.BatchingWorker`,
the state machine simdecode's live workers run): while it has requests it runs decode steps
back to back; a step advances every running request by one token and costs what the cost
model says for the distinct experts that step's batch activates and for the KV its worker
holds (from the routing decision on: `step_kv="held"`). A request assigned to a busy worker
joins the batch at the next step boundary, or waits while the batch is full (`max_batch`).
Each request replays its recorded decode trace, so the experts of every step are the
model's real choices, not a statistical stand-in.

Everything runs in simulated time; the same inputs and seed give the same results.

Beyond a fixed fleet (all optional; without them a run is what it always was):

- **Elastic fleets**: `timeline` lists workers joining and leaving at simulated times
  (`FleetEvent`); `SimConfig.num_workers` is the number of worker slots over the whole
  run and `initial_workers` those live at the start. A leaving worker gets no new request
  from that instant and drains what it holds (its running and waiting requests finish).
- **Mid-run partition swaps**: a `SimController` is called every `period_s` of simulated
  time with what happened since its last call (arrivals with their workers, finished
  requests, the live workers) and may return a `ScoreUpdate`: new per-request scores
  (a refitted partition, -inf for workers without a centroid), applied after its
  `delay_s` (the fit's own duration). Each arrival records the version it was routed with.
- **Worker activity**: policies that use it (`Policy.uses_activity`) see each worker's
  predicted per-step expert activity from the prefill-derived demand of its in-flight
  requests (`eldr.core.routing.activity`), exactly what a live router derives from the decisions
  and profiles streams (`demands`, one per request).
- **What the live router knows** (`information`, `eldr.sim.information`): load reports
  every few hundred milliseconds, decisions counted after their commit and by the other
  router replicas after a hop, finishes seen late, arrivals split between replicas, each
  replica running the live router's own tables (`RouterCore`, `LoadTable`,
  `ActivityTable`). Without it every decision sees the true fleet state at that instant.
- **Given arrival times** (`arrival_times_s`): replay a recorded arrival sequence instead
  of the seeded Poisson one (`eldr compare-live` replays the live run's times).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import numpy as np

from eldr.core.costmodel import Deployment
from eldr.core.routing.activity import ActivityInput, ActivityTable, ExpertDemand
from eldr.core.routing.decide import activity_for, decide_view
from eldr.core.routing.loadtable import Report
from eldr.core.routing.pipeline import Policy
from eldr.sim.information import (
    InformationModel,
    RouterReplica,
    make_replicas,
    split_arrivals,
    view_errors,
)
from eldr.sim.worker import (
    BatchingWorker,
    DecodeTask,
    FinishedRequest,
    StepPlan,
    flatten_decode_ids,
)

MAX_ADMITTED_IDS = 4096
"""Most admitted ids a simulated load report carries (the wire's `MAX_ADMITTED`)."""

__all__ = [
    "FleetEvent",
    "ScoreUpdate",
    "SimConfig",
    "SimController",
    "SimObservation",
    "SimRequest",
    "SimResult",
    "flatten_decode_ids",
    "poisson_arrival_times_s",
    "simulate",
    "worker_name",
]


def worker_name(slot: int) -> str:
    """The id the simulator gives worker slot `slot` in fleet views."""
    return f"w{slot}"


def poisson_arrival_times_s(rate_per_s: float, num_arrivals: int, seed: int) -> np.ndarray:
    """The arrival times `simulate` uses for this rate, count and seed (seconds, ascending).

    Exposed so that a caller can choose which request arrives when (`eldr bench` keeps two
    copies of one request from being in flight at once) before simulating.
    """
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate_per_s, size=num_arrivals)
    return np.asarray(np.cumsum(gaps), dtype=np.float64)


@dataclass(frozen=True)
class SimRequest:
    """One request as the simulator needs it.

    decode_flat: int32 [decode_tokens, moe_layers * top_k], expert ids already offset by
    layer (layer * num_experts + expert), so one step's distinct (layer, expert) pairs are
    the distinct values over the batch's rows.
    """

    request_id: str
    label: str
    prompt_tokens: int
    decode_flat: np.ndarray

    @property
    def decode_tokens(self) -> int:
        return int(self.decode_flat.shape[0])


@dataclass(frozen=True)
class SimConfig:
    num_workers: int
    arrival_rate_per_s: float
    num_arrivals: int
    max_batch: int = 64
    warmup_fraction: float = 0.1
    seed: int = 0
    initial_workers: tuple[int, ...] | None = None
    """Worker slots live at time 0 (default: all `num_workers`)."""
    count_drain: bool = False
    """Count the steps after the last arrival too (the drain), as a live worker's
    statistics do; default: only steps from the first measured to the last arrival."""

    def __post_init__(self) -> None:
        if self.num_workers <= 0:
            raise ValueError("num_workers must be positive")
        if self.initial_workers is not None:
            if not self.initial_workers:
                raise ValueError("initial_workers must name at least one slot")
            if len(set(self.initial_workers)) != len(self.initial_workers):
                raise ValueError("initial_workers must be distinct")
            if min(self.initial_workers) < 0 or max(self.initial_workers) >= self.num_workers:
                raise ValueError(f"initial_workers must be slots in [0, {self.num_workers})")
        if self.arrival_rate_per_s <= 0:
            raise ValueError("arrival_rate_per_s must be positive")
        if self.num_arrivals <= 0:
            raise ValueError("num_arrivals must be positive")
        if self.max_batch <= 0:
            raise ValueError("max_batch must be positive")
        if not 0 <= self.warmup_fraction < 1:
            raise ValueError("warmup_fraction must be in [0, 1)")


@dataclass(frozen=True)
class FleetEvent:
    """Worker slots joining and/or leaving at simulated time `at_s`."""

    at_s: float
    join: tuple[int, ...] = ()
    leave: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.at_s < 0:
            raise ValueError(f"at_s must be non-negative, got {self.at_s}")
        if set(self.join) & set(self.leave):
            raise ValueError("a slot cannot join and leave in the same event")


@dataclass(frozen=True)
class ScoreUpdate:
    """A partition swap: scores [requests, num_workers] (-inf: no centroid), its version."""

    scores: np.ndarray
    version: int
    delay_s: float = 0.0
    """Simulated time from the controller's call to the swap (the fit's duration)."""


@dataclass(frozen=True)
class SimObservation:
    """What a controller sees at one call: events since its previous call.

    arrivals: (arrival index, request index, time, worker slot) of requests routed;
    finished: (arrival index, request index, time, worker slot) of requests that finished.
    """

    now_s: float
    live: tuple[int, ...]
    arrivals: tuple[tuple[int, int, float, int], ...]
    finished: tuple[tuple[int, int, float, int], ...]
    version: int


class SimController(Protocol):
    """Called every `period_s` simulated seconds while requests still arrive."""

    @property
    def period_s(self) -> float: ...

    def on_tick(self, obs: SimObservation) -> ScoreUpdate | None: ...


@dataclass
class SimResult:
    """Per-request outcomes and per-step statistics of one simulated run.

    Only requests that arrived inside the measurement window (after the warm-up share of
    arrivals) count towards TPOT; only steps starting inside the window (from the first
    measured arrival to the last arrival) count towards the expert-union statistics, so the
    ramp-up and drain phases do not dilute either.
    """

    policy: str
    arrival_rate_per_s: float
    tpot_s: np.ndarray
    queue_s: np.ndarray
    worker_of: np.ndarray
    union_per_layer_steps: np.ndarray
    batch_steps: np.ndarray
    imbalance_samples: np.ndarray
    assigned_per_worker: np.ndarray
    fallbacks: dict[str, int] = field(default_factory=dict)
    queued_share: float = 0.0  # share of measured requests that waited for a free batch slot
    sim_end_s: float = 0.0
    assigned_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Per arrival (all, warm-up included): when it was routed."""
    finished_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Per arrival (all, warm-up included): when its last token was produced."""
    version_of: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Per arrival: the partition version it was routed with (-1: none)."""
    union_step_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Start time of each step counted in `union_per_layer_steps`."""
    joined_s: dict[int, float] = field(default_factory=dict)
    """Worker slot -> when it joined (timeline joins only)."""
    left_s: dict[int, float] = field(default_factory=dict)
    """Worker slot -> when it left."""
    swaps: list[tuple[float, int]] = field(default_factory=list)
    """(time, version) of every partition swap applied."""
    submitted_s: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Per arrival: when its job reached its worker (= `assigned_s` without information
    delays); TPOT counts from here."""
    replica_of: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Per arrival: the router replica that routed it (all 0 without information delays)."""
    view_error: np.ndarray = field(default_factory=lambda: np.zeros(0))
    """Per measured decision with information delays: mean |in-flight requests the replica
    saw - true| over the live workers (stale load)."""
    activity_excess: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Per measured decision of an activity-using policy with information delays: entries
    in the replica's activity table - requests truly in flight (finishes not yet seen,
    minus decisions not yet seen)."""

    def union_between(self, start_s: float, end_s: float) -> float:
        """Mean expert union per MoE layer of the counted steps starting in [start, end)."""
        mask = (self.union_step_s >= start_s) & (self.union_step_s < end_s)
        if not mask.any():
            return float("nan")
        return float(self.union_per_layer_steps[mask].mean())

    def tpot_percentile_ms(self, q: float) -> float:
        if self.tpot_s.size == 0:
            return float("nan")
        return float(np.percentile(self.tpot_s, q) * 1e3)

    @property
    def expert_union_mean(self) -> float:
        if self.union_per_layer_steps.size == 0:
            return float("nan")
        return float(self.union_per_layer_steps.mean())

    @property
    def batch_mean(self) -> float:
        if self.batch_steps.size == 0:
            return float("nan")
        return float(self.batch_steps.mean())

    @property
    def imbalance(self) -> float:
        """Mean over arrival instants of max/mean in-flight requests across workers."""
        if self.imbalance_samples.size == 0:
            return float("nan")
        return float(self.imbalance_samples.mean())


def simulate(
    requests: list[SimRequest],
    arrival_requests: np.ndarray,
    policy: Policy,
    cost: Deployment,
    config: SimConfig,
    *,
    num_moe_layers: int,
    union_slots: int,
    scores: np.ndarray | None = None,
    scores_version: int = -1,
    has_centroid: np.ndarray | None = None,
    demands: Sequence[ExpertDemand] | None = None,
    timeline: Sequence[FleetEvent] = (),
    controller: SimController | None = None,
    information: InformationModel | None = None,
    arrival_times_s: np.ndarray | None = None,
) -> SimResult:
    """Run one simulation.

    arrival_requests: index into `requests` for each arrival, in arrival order (the same
    sequence for every policy, so policies are compared on identical traffic).
    scores: float32 [len(requests), num_workers] similarity of each request's signature to
    each worker's centroid, used by policies that route by locality; None for load-only.
    scores_version: the partition version those scores come from (recorded per arrival).
    has_centroid: bool [num_workers], which slots own a centroid (default: the slots with a
    finite score for some request).
    union_slots: size of the (layer, expert) id space (moe_layers * num_experts).
    demands: per request, its predicted per-step expert activation; needed by policies
    that use worker activity.
    timeline: workers joining and leaving (see the module docstring); controller: called
    periodically, may swap the partition.
    information: route through simulated router replicas that know what live ones know
    (`eldr.sim.information`); None: perfect, instant fleet state (not combinable with a
    timeline). arrival_times_s: seconds, non-decreasing, one per arrival (default: Poisson
    at the configured rate and seed).
    """
    _check_inputs(requests, arrival_requests, policy, config, scores, demands, timeline, controller)
    if information is not None and timeline:
        raise ValueError("information delays are not modelled with a fleet timeline")
    run = _Run(
        requests,
        arrival_requests,
        _arrival_times(config, arrival_times_s),
        policy,
        cost,
        config,
        num_moe_layers=num_moe_layers,
        union_slots=union_slots,
        partition=_Partition(scores, scores_version, _centroid_mask(scores, has_centroid)),
        demands=demands if policy.uses_activity else None,
        timeline=timeline,
        controller=controller,
        information=information,
    )
    run.run()
    return run.result()


def _check_inputs(
    requests: list[SimRequest],
    arrival_requests: np.ndarray,
    policy: Policy,
    config: SimConfig,
    scores: np.ndarray | None,
    demands: Sequence[ExpertDemand] | None,
    timeline: Sequence[FleetEvent],
    controller: SimController | None,
) -> None:
    if int(arrival_requests.shape[0]) != config.num_arrivals:
        raise ValueError("arrival_requests must have config.num_arrivals entries")
    if policy.uses_signature and scores is None:
        raise ValueError(f"policy {policy.name} needs scores")
    if policy.uses_activity and demands is None:
        raise ValueError(f"policy {policy.name} needs demands")
    W = config.num_workers
    if scores is not None and scores.shape != (len(requests), W):
        raise ValueError(f"scores has shape {scores.shape}, expected ({len(requests)}, {W})")
    for ev in timeline:
        if any(not 0 <= slot < W for slot in (*ev.join, *ev.leave)):
            raise ValueError(f"fleet event at {ev.at_s} names a slot outside [0, {W})")
    if controller is not None and controller.period_s <= 0:
        raise ValueError("a controller's period_s must be positive")


def _arrival_times(config: SimConfig, given: np.ndarray | None) -> np.ndarray:
    """The given arrival times, checked, or the seeded Poisson ones."""
    n_arr = config.num_arrivals
    if given is None:
        return poisson_arrival_times_s(config.arrival_rate_per_s, n_arr, config.seed)
    arrival_s = np.asarray(given, dtype=np.float64)
    if arrival_s.shape != (n_arr,):
        raise ValueError(f"arrival_times_s has shape {arrival_s.shape}, expected ({n_arr},)")
    if n_arr and (arrival_s[0] < 0 or np.any(np.diff(arrival_s) < 0)):
        raise ValueError("arrival_times_s must be non-negative and non-decreasing")
    return arrival_s


def _decode_workers(
    worker_ids: tuple[str, ...],
    cost: Deployment,
    config: SimConfig,
    num_moe_layers: int,
    union_slots: int,
) -> list[BatchingWorker]:
    """A worker per slot, batching as simdecode's do, with no KV limit; a step is charged
    for all the KV its worker holds (what the simulator's results always rested on)."""
    num_experts = -(-union_slots // num_moe_layers)  # an id space of at least union_slots
    return [
        BatchingWorker(
            wid,
            cost,
            num_experts=num_experts,
            max_batch=config.max_batch,
            kv_capacity_tokens=None,
            step_kv="held",
        )
        for wid in worker_ids
    ]


_FLEET, _TICK, _SWAP = 0, 1, 2
"""Control event kinds: a fleet change, a controller call, a partition swap."""


def _centroid_mask(scores: np.ndarray | None, given: np.ndarray | None) -> np.ndarray | None:
    """Which slots own a centroid: `given`, else those with a finite score somewhere."""
    if given is not None:
        return np.asarray(given, dtype=bool)
    if scores is None:
        return None
    return np.asarray(np.isfinite(scores).any(axis=0), dtype=bool)


class _Fleet:
    """Which worker slots are live, and when slots joined and left."""

    def __init__(self, config: SimConfig, worker_ids: tuple[str, ...]) -> None:
        self.worker_ids = worker_ids
        self.live = np.zeros(config.num_workers, dtype=bool)
        if config.initial_workers is None:
            self.live[:] = True
        else:
            self.live[list(config.initial_workers)] = True
        self.joined_s: dict[int, float] = {}
        self.left_s: dict[int, float] = {}
        self._refresh()

    def _refresh(self) -> None:
        self.idx = np.flatnonzero(self.live)
        self.ids = tuple(self.worker_ids[i] for i in self.idx)
        self.everyone = bool(self.live.all())

    def apply(self, event: FleetEvent, now: float) -> None:
        """A leaving slot takes no new request from now (it drains what it holds)."""
        for slot in event.leave:
            if self.live[slot]:
                self.live[slot] = False
                self.left_s[slot] = now
        for slot in event.join:
            if not self.live[slot]:
                self.live[slot] = True
                self.joined_s[slot] = now
        self._refresh()


class _Partition:
    """The scores the policy routes with; a controller's `ScoreUpdate` swaps them."""

    def __init__(self, scores: np.ndarray | None, version: int, mask: np.ndarray | None) -> None:
        self.scores = scores
        self.version = version
        self.centroid_mask = mask
        self.swaps: list[tuple[float, int]] = []

    def swap(self, update: ScoreUpdate, now: float) -> None:
        self.scores = update.scores
        self.version = update.version
        self.centroid_mask = _centroid_mask(update.scores, None)
        self.swaps.append((now, update.version))

    def row(
        self, req_idx: int, idx: np.ndarray, whole: bool
    ) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Request `req_idx`'s scores over the slots `idx` (`whole`: all of them, in slot
        order) and which of those own a centroid (None: all)."""
        if self.scores is None:
            return None, None
        row = self.scores[req_idx] if whole else self.scores[req_idx, idx]
        mask = None
        if self.centroid_mask is not None:
            sub = self.centroid_mask if whole else self.centroid_mask[idx]
            mask = None if sub.all() else sub
        return row, mask


class _View(NamedTuple):
    """What the deciding router sees of the fleet: the truth, or its replica's tables."""

    replica: RouterReplica | None
    idx: np.ndarray
    """Live worker slots, in slot order."""
    whole: bool
    """`idx` is every slot."""
    ids: tuple[str, ...]
    in_flight: np.ndarray
    kv_tokens: np.ndarray


class _Record:
    """What a run measures: per arrival (warm-up included), per step starting inside the
    measurement window (from the first measured arrival to the last arrival, or on to the
    end with `count_drain`), per measured decision."""

    def __init__(self, config: SimConfig, arrival_s: np.ndarray, delayed_jobs: bool) -> None:
        n_arr = config.num_arrivals
        self.warm_idx = int(config.warmup_fraction * n_arr)
        last = float(arrival_s[-1])
        self.window_start = float(arrival_s[self.warm_idx]) if self.warm_idx < n_arr else last
        self.window_end = np.inf if config.count_drain else last
        self.assigned_s = np.zeros(n_arr)
        # Without information delays a job reaches its worker when it is routed.
        self.submitted_s = np.zeros(n_arr) if delayed_jobs else self.assigned_s
        self.queue_s = np.full(n_arr, np.nan)
        self.finished_s = np.full(n_arr, np.nan)
        self.worker_of = np.full(n_arr, -1, dtype=np.int64)
        self.version_of = np.full(n_arr, -1, dtype=np.int64)
        self.blocked = np.zeros(n_arr, dtype=bool)
        self.union_samples: list[float] = []
        self.union_times: list[float] = []
        self.batch_samples: list[int] = []
        self.imbalance: list[float] = []
        self.fallbacks: dict[str, int] = {}

    def step(self, plan: StepPlan, now: float) -> None:
        if self.window_start <= now <= self.window_end:
            self.union_samples.append(plan.union_per_layer)
            self.union_times.append(now)
            self.batch_samples.append(plan.batch_size)

    def finished(self, a: int, done: FinishedRequest, now: float) -> None:
        self.finished_s[a] = now
        self.queue_s[a] = done.queue_s
        self.blocked[a] = done.blocked


class _Run:
    """One simulation: a `BatchingWorker` per worker slot, the arrivals routed to them, the
    fleet's control events and the router's information, in simulated time order.

    Per worker slot the truth a perfect router sees is kept alongside: `in_flight` (requests
    routed there and not finished) and `kv_tokens` (the worker's KV, counted from the
    routing decision).
    """

    def __init__(
        self,
        requests: list[SimRequest],
        arrival_requests: np.ndarray,
        arrival_s: np.ndarray,
        policy: Policy,
        cost: Deployment,
        config: SimConfig,
        *,
        num_moe_layers: int,
        union_slots: int,
        partition: _Partition,
        demands: Sequence[ExpertDemand] | None,
        timeline: Sequence[FleetEvent],
        controller: SimController | None,
        information: InformationModel | None,
    ) -> None:
        W = config.num_workers
        self.requests = requests
        self.arrival_requests = arrival_requests
        self.arrival_s = arrival_s
        self.policy = policy
        self.config = config
        self.num_moe_layers = num_moe_layers
        self.partition = partition
        self.demands = demands
        self.controller = controller
        # The policy's own randomness (tie-breaks, P2C samples) gets a separate stream so
        # that arrival times are identical across policies for a seed.
        self.policy_rng = np.random.default_rng([config.seed, 1])
        self.worker_ids = tuple(worker_name(i) for i in range(W))
        self.workers = _decode_workers(self.worker_ids, cost, config, num_moe_layers, union_slots)
        self.plans: list[StepPlan | None] = [None] * W
        """Each slot's step in flight (None: idle)."""
        self.in_flight = np.zeros(W, dtype=np.int64)
        self.kv_tokens = np.zeros(W, dtype=np.int64)
        self.fleet = _Fleet(config, self.worker_ids)
        self.activity = (
            ActivityTable(ttl_s=float("inf"))
            if demands is not None and information is None
            else None
        )
        self.info = (
            _Information(information, policy, self.worker_ids, self.workers, demands, config)
            if information is not None
            else None
        )
        self.record = _Record(config, arrival_s, delayed_jobs=information is not None)
        self.seen_arrivals: list[tuple[int, int, float, int]] = []
        self.seen_finished: list[tuple[int, int, float, int]] = []
        self.now = 0.0
        self._tie = itertools.count(1)
        self.step_ends: list[tuple[float, int, int]] = []
        """(time, tie-breaker, worker slot) of the steps in flight."""
        self.control: list[tuple[float, int, int, object]] = []
        """(time, tie-breaker, kind, payload) of the control events (kinds below)."""
        for ev in timeline:
            heapq.heappush(self.control, (ev.at_s, next(self._tie), _FLEET, ev))
        if controller is not None:
            heapq.heappush(self.control, (controller.period_s, next(self._tie), _TICK, None))

    # --- the event loop -------------------------------------------------------------------

    def run(self) -> None:
        """Handle every event in time order until the last request has finished; at equal
        times a step's end goes first, then a control event, an information event and an
        arrival. Control events stop with the last arrival."""
        info, step_ends, control = self.info, self.step_ends, self.control
        arrival_s, n_arr = self.arrival_s, self.config.num_arrivals
        if info is not None:
            info.start(self._submit)
        next_arrival = 0
        now = 0.0
        while next_arrival < n_arr or step_ends or (info is not None and info.busy):
            t_arr = arrival_s[next_arrival] if next_arrival < n_arr else np.inf
            t_step = step_ends[0][0] if step_ends else np.inf
            t_ctl = control[0][0] if control and next_arrival < n_arr else np.inf
            t_info = info.next_s() if info is not None else np.inf
            if t_step <= t_arr and t_step <= t_ctl and t_step <= t_info:
                now, _, w = heapq.heappop(step_ends)
                self._end_step(w, now)
            elif t_ctl <= t_arr and t_ctl <= t_info:
                now, _, kind, payload = heapq.heappop(control)
                self._on_control(now, kind, payload)
            elif info is not None and t_info <= t_arr:
                now = t_info
                info.run_next(next_arrival < n_arr)
            else:
                now = float(t_arr)
                a = next_arrival
                next_arrival += 1
                self._arrive(a, now)
        self.now = now

    # --- steps ----------------------------------------------------------------------------

    def _start_step(self, w: int, now: float) -> None:
        """Worker `w` is at a step boundary: plan its next step (if it has requests) and
        record it when it starts inside the measurement window."""
        plan = self.workers[w].start_step(now)
        self.plans[w] = plan
        if plan is None:
            return
        self.record.step(plan, now)
        heapq.heappush(self.step_ends, (now + plan.duration_s, next(self._tie), w))

    def _end_step(self, w: int, now: float) -> None:
        """Worker `w`'s step ended: its finished requests leave, the next step starts."""
        worker = self.workers[w]
        plan = self.plans[w]
        assert plan is not None
        for done in worker.finish_step(plan, now):
            self._finished(w, done, now)
        self.kv_tokens[w] = worker.kv_tokens
        self._start_step(w, now)

    def _finished(self, w: int, done: FinishedRequest, now: float) -> None:
        a = int(done.request_id)  # the simulator's request ids are arrival indices
        self.record.finished(a, done, now)
        self.in_flight[w] -= 1
        if self.activity is not None:
            self.activity.finish(done.request_id)
        if self.info is not None:
            self.info.finished(done.request_id, now)
        if self.controller is not None:
            self.seen_finished.append((a, int(self.arrival_requests[a]), now, w))

    # --- routing and submission -----------------------------------------------------------

    def _arrive(self, a: int, now: float) -> None:
        """Arrival `a` is routed: the policy decides on what the router sees."""
        req_idx = int(self.arrival_requests[a])
        if not self.fleet.idx.size:
            raise ValueError(f"no live worker at {now:.3f} s (arrival {a})")
        view = self._view(a, now)
        policy = self.policy if view.replica is None else view.replica.policy
        row: np.ndarray | None = None
        mask: np.ndarray | None = None
        if self.policy.wants_scores:
            row, mask = self.partition.row(req_idx, view.idx, view.whole)
        demand: ExpertDemand | None = None
        miss: ActivityInput | None = None
        if self.demands is not None:
            demand = self.demands[req_idx]
            table = self.activity if view.replica is None else view.replica.core.activity
            assert table is not None
            miss = activity_for(policy, table, view.ids)
        decided = decide_view(
            policy,
            workers=view.ids,
            in_flight=view.in_flight,
            kv_tokens=view.kv_tokens,
            rng=self.policy_rng,
            scores=row,
            has_centroid=mask,
            expert_miss=miss,
            demand=demand,
        )
        record = self.record
        if decided.fallback:
            record.fallbacks[decided.fallback] = record.fallbacks.get(decided.fallback, 0) + 1
        w = int(view.idx[decided.index])
        if a >= record.warm_idx:
            self._measure(view)
        record.worker_of[a] = w
        record.version_of[a] = self.partition.version if row is not None else -1
        self._assign(a, req_idx, w, view.replica, now)

    def _view(self, a: int, now: float) -> _View:
        """The fleet as arrival `a`'s router sees it: the truth, or its replica's tables."""
        fleet, info = self.fleet, self.info
        if info is None:
            everyone, idx = fleet.everyone, fleet.idx
            return _View(
                replica=None,
                idx=idx,
                whole=everyone,
                ids=fleet.ids,
                in_flight=self.in_flight if everyone else self.in_flight[idx],
                kv_tokens=self.kv_tokens if everyone else self.kv_tokens[idx],
            )
        replica = info.replica_for(a)
        idx, in_flight, kv = info.loads(replica, now)
        return _View(
            replica=replica,
            idx=idx,
            whole=idx.size == len(self.workers),
            ids=tuple(self.worker_ids[i] for i in idx),
            in_flight=in_flight,
            kv_tokens=kv,
        )

    def _measure(self, view: _View) -> None:
        """A measured decision: its replica's view errors, the fleet's imbalance (both
        before the decision counts)."""
        in_flight = self.in_flight
        if self.info is not None and view.replica is not None:
            self.info.record_errors(view.replica, view.in_flight, in_flight[view.idx])
        fleet = self.fleet
        loads = in_flight if fleet.everyone else in_flight[fleet.idx]
        mean_load = loads.mean()
        if mean_load > 0:
            self.record.imbalance.append(float(loads.max() / mean_load))

    def _assign(
        self, a: int, req_idx: int, w: int, replica: RouterReplica | None, now: float
    ) -> None:
        """Arrival `a` goes to worker `w`: it counts there from now (its KV with it); its
        job reaches the worker now, or after the information model's dispatch."""
        self.record.assigned_s[a] = now
        self.in_flight[w] += 1
        prompt_tokens = self.requests[req_idx].prompt_tokens
        self.workers[w].expect(prompt_tokens)
        self.kv_tokens[w] += prompt_tokens
        if self.activity is not None and self.demands is not None:
            self.activity.add(self.worker_ids[w], str(a), self.demands[req_idx], now)
        if self.controller is not None:
            self.seen_arrivals.append((a, req_idx, now, w))
        if self.info is not None and replica is not None:
            self.info.decided(replica, w, a, req_idx, prompt_tokens, now)
        else:
            self._submit(w, a, now)

    def _submit(self, w: int, a: int, now: float) -> None:
        """Arrival `a`'s job reaches worker `w`; an idle worker starts a step at once."""
        self.record.submitted_s[a] = now
        req = self.requests[int(self.arrival_requests[a])]
        self.workers[w].enqueue(
            DecodeTask(
                request_id=str(a),
                prompt_tokens=req.prompt_tokens,
                flat=req.decode_flat,
                num_moe_layers=self.num_moe_layers,
                submitted_s=now,
                label=req.label,
            ),
            expected=True,
        )
        if self.plans[w] is None:
            self._start_step(w, now)

    # --- control events -------------------------------------------------------------------

    def _on_control(self, now: float, kind: int, payload: object) -> None:
        if kind == _FLEET:
            assert isinstance(payload, FleetEvent)
            self.fleet.apply(payload, now)
        elif kind == _TICK:
            self._tick(now)
        else:
            assert isinstance(payload, ScoreUpdate)
            self.partition.swap(payload, now)

    def _tick(self, now: float) -> None:
        """Call the controller with what happened since its last call; schedule the swap it
        returns (after its delay) and its next call."""
        controller = self.controller
        assert controller is not None
        obs = SimObservation(
            now_s=now,
            live=tuple(int(i) for i in self.fleet.idx),
            arrivals=tuple(self.seen_arrivals),
            finished=tuple(self.seen_finished),
            version=self.partition.version,
        )
        self.seen_arrivals.clear()
        self.seen_finished.clear()
        update = controller.on_tick(obs)
        if update is not None:
            expected = (len(self.requests), self.config.num_workers)
            if update.scores.shape != expected:
                raise ValueError(f"update scores shaped {update.scores.shape}, expected {expected}")
            at_s = now + max(0.0, update.delay_s)
            heapq.heappush(self.control, (at_s, next(self._tie), _SWAP, update))
        heapq.heappush(self.control, (now + controller.period_s, next(self._tie), _TICK, None))

    # --- the result -----------------------------------------------------------------------

    def result(self) -> SimResult:
        n_arr = self.config.num_arrivals
        rec, info = self.record, self.info
        measured = np.arange(rec.warm_idx, n_arr)
        tokens = np.array(
            [self.requests[self.arrival_requests[a]].decode_tokens for a in measured],
            dtype=np.float64,
        )
        return SimResult(
            policy=self.policy.name,
            arrival_rate_per_s=self.config.arrival_rate_per_s,
            tpot_s=(rec.finished_s[measured] - rec.submitted_s[measured]) / tokens,
            queue_s=rec.queue_s[measured],
            worker_of=rec.worker_of,
            union_per_layer_steps=np.asarray(rec.union_samples, dtype=np.float64),
            batch_steps=np.asarray(rec.batch_samples, dtype=np.int64),
            imbalance_samples=np.asarray(rec.imbalance, dtype=np.float64),
            assigned_per_worker=np.bincount(
                rec.worker_of[measured], minlength=self.config.num_workers
            ),
            fallbacks=rec.fallbacks,
            queued_share=float(rec.blocked[measured].mean()) if measured.size else 0.0,
            sim_end_s=self.now,
            assigned_s=rec.assigned_s,
            finished_s=rec.finished_s,
            version_of=rec.version_of,
            union_step_s=np.asarray(rec.union_times, dtype=np.float64),
            joined_s=self.fleet.joined_s,
            left_s=self.fleet.left_s,
            swaps=self.partition.swaps,
            submitted_s=rec.submitted_s,
            replica_of=(info.replica_of if info is not None else np.zeros(n_arr, dtype=np.int64)),
            view_error=(
                np.asarray(info.view_error, dtype=np.float64) if info is not None else np.zeros(0)
            ),
            activity_excess=(
                np.asarray(info.activity_excess, dtype=np.int64)
                if info is not None and self.demands is not None
                else np.zeros(0, dtype=np.int64)
            ),
        )


@dataclass(frozen=True)
class _Emit:
    """Workers publish their load reports (periodic)."""


@dataclass(frozen=True)
class _Reports:
    """Load reports reach the routers."""

    reports: tuple[Report, ...]


@dataclass(frozen=True)
class _Commit:
    """A decision is counted by the replica that made it (its commit acknowledged)."""

    replica: int
    worker_id: str
    request_id: str
    kv_tokens: int
    demand: ExpertDemand | None


@dataclass(frozen=True)
class _Propagate:
    """A decision reaches the other replicas (the decisions stream)."""

    replica: int
    worker_id: str
    request_id: str
    demand: ExpertDemand | None


@dataclass(frozen=True)
class _Dispatch:
    """A decided request's job reaches its worker."""

    worker: int
    arrival: int


@dataclass(frozen=True)
class _Finish:
    """A finish event reaches the routers."""

    request_id: str


@dataclass(frozen=True)
class _Expire:
    """The routers' expiry loop runs (periodic)."""


_InfoEvent = _Emit | _Reports | _Commit | _Propagate | _Dispatch | _Finish | _Expire


class _Information:
    """The simulated router replicas and the events that feed them (`simulate(information=)`).

    Zero delays act at once (no event), so `InformationModel.perfect()` makes the same
    decisions as the perfect-information path.
    """

    def __init__(
        self,
        model: InformationModel,
        policy: Policy,
        worker_ids: tuple[str, ...],
        workers: list[BatchingWorker],
        demands: Sequence[ExpertDemand] | None,
        config: SimConfig,
    ) -> None:
        self.model = model
        self.replicas = make_replicas(policy, model)
        self.worker_ids = worker_ids
        self.slot_of = {w: i for i, w in enumerate(worker_ids)}
        self.workers = workers
        self.demands = demands
        self.replica_of = split_arrivals(model, config.num_arrivals, config.seed)
        self.heap: list[tuple[float, int, _InfoEvent]] = []
        self.tie = 0
        W = len(worker_ids)
        self.seq = [0] * W
        self.admitted_now: list[list[str]] = [[] for _ in range(W)]
        self.admitted_before: list[list[str]] = [[] for _ in range(W)]
        self.view_error: list[float] = []
        self.activity_excess: list[int] = []
        self._submit: Callable[[int, int, float], None] | None = None

    # --- the event queue ------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return bool(self.heap)

    def push(self, at_s: float, event: _InfoEvent) -> None:
        self.tie += 1
        heapq.heappush(self.heap, (at_s, self.tie, event))

    def next_s(self) -> float:
        return self.heap[0][0] if self.heap else np.inf

    def start(self, submit: Callable[[int, int, float], None]) -> None:
        """Every replica has a report of every worker before the first arrival (the stack
        is up and reporting before requests come); then the periodic events begin."""
        self._submit = submit
        self.apply(self.reports(), 0.0)
        if self.model.report_interval_s > 0:
            self.push(self.model.report_interval_s, _Emit())
        self.push(self.model.expire_period_s, _Expire())

    def run_next(self, arrivals_left: bool) -> None:
        """Handle the earliest event; periodic ones recur while arrivals are left."""
        now, _, ev = heapq.heappop(self.heap)
        m = self.model
        if isinstance(ev, _Emit):
            reports = self.reports()
            if m.report_hop_s > 0:
                self.push(now + m.report_hop_s, _Reports(reports))
            else:
                self.apply(reports, now)
            if arrivals_left:
                self.push(now + m.report_interval_s, _Emit())
        elif isinstance(ev, _Reports):
            self.apply(ev.reports, now)
        elif isinstance(ev, _Commit):
            self.replicas[ev.replica].on_decision(
                ev.worker_id, ev.request_id, ev.kv_tokens, ev.demand, now
            )
        elif isinstance(ev, _Propagate):
            for rep in self.replicas:
                if rep.index != ev.replica:
                    rep.on_decision(ev.worker_id, ev.request_id, 0, ev.demand, now)
        elif isinstance(ev, _Dispatch):
            self.submit(ev.worker, ev.arrival, now)
        elif isinstance(ev, _Finish):
            for rep in self.replicas:
                rep.on_finished(ev.request_id, now)
        else:
            if m.report_interval_s == 0:
                self.apply(self.reports(), now)
            for rep in self.replicas:
                rep.expire(now)
            if arrivals_left:
                self.push(now + m.expire_period_s, _Expire())

    # --- reports --------------------------------------------------------------------------

    def reports(self) -> tuple[Report, ...]:
        """Every worker's load report now (admitted: the jobs that reached it this interval
        and the previous one, as simdecode reports them)."""
        out = []
        for w, wk in enumerate(self.workers):
            admitted = (self.admitted_before[w] + self.admitted_now[w])[-MAX_ADMITTED_IDS:]
            self.admitted_before[w], self.admitted_now[w] = self.admitted_now[w], []
            out.append(
                Report(
                    worker_id=self.worker_ids[w],
                    incarnation="sim",
                    seq=self.seq[w],
                    running=len(wk.running),
                    waiting=len(wk.waiting),
                    kv_tokens=wk.kv_tokens,
                    admitted=tuple(admitted),
                )
            )
            self.seq[w] += 1
        return tuple(out)

    def apply(self, reports: tuple[Report, ...], now: float) -> None:
        for rep in self.replicas:
            for report in reports:
                rep.on_report(report, now)

    # --- decisions ------------------------------------------------------------------------

    def replica_for(self, arrival: int) -> RouterReplica:
        return self.replicas[int(self.replica_of[arrival])]

    def loads(
        self, replica: RouterReplica, now: float
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(live worker slots in slot order, their in-flight requests, their KV tokens) as
        the replica's load table has them now."""
        if self.model.report_interval_s == 0:
            self.apply(self.reports(), now)
        table = replica.table
        live = table.live_workers(now)
        if not live:
            raise ValueError(f"router replica {replica.index} sees no live worker at {now:.3f} s")
        idx = np.array(sorted(self.slot_of[w] for w in live), dtype=np.int64)
        in_flight, kv = table.loads([self.worker_ids[i] for i in idx])
        return idx, in_flight, kv

    def record_errors(self, replica: RouterReplica, seen: np.ndarray, truth: np.ndarray) -> None:
        err, excess = view_errors(seen, truth, len(replica.core.activity))
        self.view_error.append(err)
        if self.demands is not None:
            self.activity_excess.append(excess)

    def decided(
        self, replica: RouterReplica, w: int, a: int, req_idx: int, prompt_tokens: int, now: float
    ) -> None:
        """The replica sent arrival `a` to worker `w`: it counts it after `commit_s` (0, at
        once, as the live router does), the other replicas after propagation, the worker
        gets it after dispatch."""
        m = self.model
        replica.decisions += 1
        wid, rid = self.worker_ids[w], str(a)
        demand = self.demands[req_idx] if self.demands is not None else None
        if m.commit_s > 0:
            self.push(now + m.commit_s, _Commit(replica.index, wid, rid, prompt_tokens, demand))
        else:
            replica.on_decision(wid, rid, prompt_tokens, demand, now)
        if len(self.replicas) > 1:
            if m.propagation_s > 0:
                self.push(now + m.propagation_s, _Propagate(replica.index, wid, rid, demand))
            else:
                for rep in self.replicas:
                    if rep is not replica:
                        rep.on_decision(wid, rid, 0, demand, now)
        if m.dispatch_s > 0:
            self.push(now + m.dispatch_s, _Dispatch(w, a))
        else:
            self.submit(w, a, now)

    def submit(self, w: int, a: int, now: float) -> None:
        self.admitted_now[w].append(str(a))
        assert self._submit is not None
        self._submit(w, a, now)

    def finished(self, request_id: str, now: float) -> None:
        """The request produced its last token: the routers hear of it after the lag."""
        if self.model.finish_lag_s > 0:
            self.push(now + self.model.finish_lag_s, _Finish(request_id))
        else:
            for rep in self.replicas:
                rep.on_finished(request_id, now)
