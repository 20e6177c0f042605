"""Discrete-event simulation of the decode side of a PD-disaggregated MoE cluster.

Requests arrive (after prefill) as a Poisson process, a routing policy assigns each to one of
W decode workers, and each worker runs continuous batching: while it has requests it runs
decode steps back to back; a step advances every running request by one token and costs
what the cost model says for the distinct experts that step's batch activates. A request
assigned to a busy worker joins the batch at the next step boundary, or waits while the
batch is full (`max_batch`). Each request replays its recorded decode trace, so the experts
of every step are the model's real choices, not a statistical stand-in.

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
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from eldr.core.costmodel import CostProfile
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
from eldr.sim.worker import UnionCounter, flatten_decode_ids

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


class _Worker:
    __slots__ = ("busy", "kv_tokens", "running", "running_pos", "waiting")

    def __init__(self) -> None:
        self.running: list[int] = []  # arrival indices
        self.running_pos: list[int] = []  # next decode token of each running request
        self.waiting: deque[int] = deque()
        self.busy = False
        self.kv_tokens = 0


def simulate(
    requests: list[SimRequest],
    arrival_requests: np.ndarray,
    policy: Policy,
    cost: CostProfile,
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
    n_arr = int(arrival_requests.shape[0])
    if n_arr != config.num_arrivals:
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
    if information is not None and timeline:
        raise ValueError("information delays are not modelled with a fleet timeline")
    if arrival_times_s is None:
        arrival_s = poisson_arrival_times_s(config.arrival_rate_per_s, n_arr, config.seed)
    else:
        arrival_s = np.asarray(arrival_times_s, dtype=np.float64)
        if arrival_s.shape != (n_arr,):
            raise ValueError(f"arrival_times_s has shape {arrival_s.shape}, expected ({n_arr},)")
        if n_arr and (arrival_s[0] < 0 or np.any(np.diff(arrival_s) < 0)):
            raise ValueError("arrival_times_s must be non-negative and non-decreasing")
    # The policy's own randomness (tie-breaks, P2C samples) gets a separate stream so that
    # arrival times are identical across policies for a seed.
    policy_rng = np.random.default_rng([config.seed, 1])

    workers = [_Worker() for _ in range(W)]
    worker_ids = tuple(worker_name(i) for i in range(W))
    in_flight = np.zeros(W, dtype=np.int64)
    kv_tokens = np.zeros(W, dtype=np.int64)
    live = np.zeros(W, dtype=bool)
    if config.initial_workers is None:
        live[:] = True
    else:
        live[list(config.initial_workers)] = True
    live_idx = np.flatnonzero(live)
    live_ids = tuple(worker_ids[i] for i in live_idx)
    everyone = bool(live.all())

    cur_scores = scores
    cur_version = scores_version
    centroid_mask = _centroid_mask(scores, has_centroid)
    track_activity = policy.uses_activity and demands is not None
    activity = ActivityTable(ttl_s=float("inf")) if track_activity and information is None else None

    warm_idx = int(config.warmup_fraction * n_arr)
    window_start = float(arrival_s[warm_idx]) if warm_idx < n_arr else float(arrival_s[-1])
    window_end = np.inf if config.count_drain else float(arrival_s[-1])

    assigned_s = np.zeros(n_arr)
    admitted_s = np.full(n_arr, np.nan)
    finished_s = np.full(n_arr, np.nan)
    worker_of = np.full(n_arr, -1, dtype=np.int64)
    version_of = np.full(n_arr, -1, dtype=np.int64)
    blocked = np.zeros(n_arr, dtype=bool)
    union_samples: list[float] = []
    union_times: list[float] = []
    batch_samples: list[int] = []
    imbalance: list[float] = []
    fallbacks: dict[str, int] = {}
    union = UnionCounter(union_slots)
    joined_s: dict[int, float] = {}
    left_s: dict[int, float] = {}
    swaps: list[tuple[float, int]] = []
    seen_arrivals: list[tuple[int, int, float, int]] = []
    seen_finished: list[tuple[int, int, float, int]] = []
    submitted_s = assigned_s if information is None else np.zeros(n_arr)
    info = (
        _Information(
            information, policy, worker_ids, workers, demands if track_activity else None, config
        )
        if information is not None
        else None
    )

    events: list[tuple[float, int, int]] = []  # (time, tie-breaker, worker) step ends
    tie = 0
    # Control events: (time, tie-breaker, kind, payload); kinds below.
    control: list[tuple[float, int, int, object]] = []
    for ev in timeline:
        tie += 1
        heapq.heappush(control, (ev.at_s, tie, _FLEET, ev))
    if controller is not None:
        if controller.period_s <= 0:
            raise ValueError("a controller's period_s must be positive")
        tie += 1
        heapq.heappush(control, (controller.period_s, tie, _TICK, None))

    def start_step(w: int, now: float) -> None:
        nonlocal tie
        wk = workers[w]
        while wk.waiting and len(wk.running) < config.max_batch:
            a = wk.waiting.popleft()
            wk.running.append(a)
            wk.running_pos.append(0)
            admitted_s[a] = now
        for a in wk.waiting:  # still waiting at a step boundary: the batch is full
            blocked[a] = True
        if not wk.running:
            wk.busy = False
            return
        rows = [
            requests[arrival_requests[a]].decode_flat[p]
            for a, p in zip(wk.running, wk.running_pos, strict=True)
        ]
        ids = np.concatenate(rows) if len(rows) > 1 else rows[0]
        union_total = union.count(ids)  # distinct (layer, expert) pairs of the step
        dt = cost.step_time_s(union_total, float(wk.kv_tokens), len(wk.running))
        if window_start <= now <= window_end:
            union_samples.append(union_total / num_moe_layers)
            union_times.append(now)
            batch_samples.append(len(wk.running))
        wk.busy = True
        tie += 1
        heapq.heappush(events, (now + dt, tie, w))

    def end_step(w: int, now: float) -> None:
        wk = workers[w]
        keep_a: list[int] = []
        keep_p: list[int] = []
        for a, p in zip(wk.running, wk.running_pos, strict=True):
            p += 1
            wk.kv_tokens += 1
            kv_tokens[w] += 1
            req = requests[arrival_requests[a]]
            if p >= req.decode_tokens:
                finished_s[a] = now
                in_flight[w] -= 1
                done_kv = req.prompt_tokens + req.decode_tokens
                wk.kv_tokens -= done_kv
                kv_tokens[w] -= done_kv
                if activity is not None:
                    activity.finish(str(a))
                if info is not None:
                    info.finished(a, now)
                if controller is not None:
                    seen_finished.append((a, int(arrival_requests[a]), now, w))
            else:
                keep_a.append(a)
                keep_p.append(p)
        wk.running = keep_a
        wk.running_pos = keep_p
        start_step(w, now)

    def set_live() -> None:
        nonlocal live_idx, live_ids, everyone
        live_idx = np.flatnonzero(live)
        live_ids = tuple(worker_ids[i] for i in live_idx)
        everyone = bool(live.all())

    def on_control(now: float, kind: int, payload: object) -> None:
        nonlocal tie, cur_scores, cur_version, centroid_mask
        if kind == _FLEET:
            assert isinstance(payload, FleetEvent)
            for slot in payload.leave:
                if live[slot]:
                    live[slot] = False
                    left_s[slot] = now
            for slot in payload.join:
                if not live[slot]:
                    live[slot] = True
                    joined_s[slot] = now
            set_live()
        elif kind == _TICK:
            assert controller is not None
            obs = SimObservation(
                now_s=now,
                live=tuple(int(i) for i in live_idx),
                arrivals=tuple(seen_arrivals),
                finished=tuple(seen_finished),
                version=cur_version,
            )
            seen_arrivals.clear()
            seen_finished.clear()
            update = controller.on_tick(obs)
            if update is not None:
                if update.scores.shape != (len(requests), W):
                    raise ValueError(
                        f"update scores shaped {update.scores.shape}, "
                        f"expected ({len(requests)}, {W})"
                    )
                tie += 1
                heapq.heappush(control, (now + max(0.0, update.delay_s), tie, _SWAP, update))
            tie += 1
            heapq.heappush(control, (now + controller.period_s, tie, _TICK, None))
        else:
            assert isinstance(payload, ScoreUpdate)
            cur_scores = payload.scores
            cur_version = payload.version
            centroid_mask = _centroid_mask(cur_scores, None)
            swaps.append((now, payload.version))

    def submit(w: int, a: int, now: float) -> None:
        submitted_s[a] = now
        workers[w].waiting.append(a)
        if not workers[w].busy:
            start_step(w, now)

    if info is not None:
        info.start(submit)

    next_arrival = 0
    now = 0.0
    while next_arrival < n_arr or events or (info is not None and info.busy):
        t_arr = arrival_s[next_arrival] if next_arrival < n_arr else np.inf
        t_step = events[0][0] if events else np.inf
        t_ctl = control[0][0] if control and next_arrival < n_arr else np.inf
        t_info = info.next_s() if info is not None else np.inf
        if t_step <= t_arr and t_step <= t_ctl and t_step <= t_info:
            now, _, w = heapq.heappop(events)
            end_step(w, now)
            continue
        if t_ctl <= t_arr and t_ctl <= t_info:
            now, _, kind, payload = heapq.heappop(control)
            on_control(now, kind, payload)
            continue
        if info is not None and t_info <= t_arr:
            now = t_info
            info.run_next(next_arrival < n_arr)
            continue
        now = float(t_arr)
        a = next_arrival
        next_arrival += 1
        req_idx = int(arrival_requests[a])
        if not live_idx.size:
            raise ValueError(f"no live worker at {now:.3f} s (arrival {a})")
        # What the deciding router sees: the truth, or its replica's tables.
        replica: RouterReplica | None = None
        seen_idx, seen_all = live_idx, everyone
        seen_ids = live_ids
        seen_in_flight = in_flight if everyone else in_flight[live_idx]
        seen_kv = kv_tokens if everyone else kv_tokens[live_idx]
        if info is not None:
            replica = info.replica_for(a)
            seen_idx, seen_in_flight, seen_kv = info.loads(replica, now)
            seen_all = seen_idx.size == W
            seen_ids = tuple(worker_ids[i] for i in seen_idx)
        row: np.ndarray | None = None
        mask: np.ndarray | None = None
        if cur_scores is not None and policy.wants_scores:
            row = cur_scores[req_idx] if seen_all else cur_scores[req_idx, seen_idx]
            if centroid_mask is not None:
                sub = centroid_mask if seen_all else centroid_mask[seen_idx]
                mask = None if sub.all() else sub
        demand: ExpertDemand | None = None
        miss: ActivityInput | None = None
        if track_activity and demands is not None:
            demand = demands[req_idx]
            table = activity if replica is None else replica.core.activity
            assert table is not None
            miss = activity_for(policy if replica is None else replica.policy, table, seen_ids)
        decided = decide_view(
            policy if replica is None else replica.policy,
            workers=seen_ids,
            in_flight=seen_in_flight,
            kv_tokens=seen_kv,
            rng=policy_rng,
            scores=row,
            has_centroid=mask,
            expert_miss=miss,
            demand=demand,
        )
        if decided.fallback:
            fallbacks[decided.fallback] = fallbacks.get(decided.fallback, 0) + 1
        w = int(seen_idx[decided.index])
        if info is not None and replica is not None and a >= warm_idx:
            info.record_errors(replica, seen_in_flight, in_flight[seen_idx])
        if a >= warm_idx:
            loads = in_flight if everyone else in_flight[live_idx]
            mean_load = loads.mean()
            if mean_load > 0:
                imbalance.append(float(loads.max() / mean_load))
        worker_of[a] = w
        version_of[a] = cur_version if row is not None else -1
        assigned_s[a] = now
        in_flight[w] += 1
        req = requests[req_idx]
        workers[w].kv_tokens += req.prompt_tokens
        kv_tokens[w] += req.prompt_tokens
        if activity is not None and demands is not None:
            activity.add(worker_ids[w], str(a), demands[req_idx], now)
        if controller is not None:
            seen_arrivals.append((a, req_idx, now, w))
        if info is not None and replica is not None:
            info.decided(replica, w, a, req_idx, req.prompt_tokens, now)
        else:
            workers[w].waiting.append(a)
            if not workers[w].busy:
                start_step(w, now)

    measured = np.arange(warm_idx, n_arr)
    tokens = np.array(
        [requests[arrival_requests[a]].decode_tokens for a in measured], dtype=np.float64
    )
    tpot = (finished_s[measured] - submitted_s[measured]) / tokens
    queue = admitted_s[measured] - submitted_s[measured]
    assigned_per_worker = np.bincount(worker_of[measured], minlength=W)
    return SimResult(
        policy=policy.name,
        arrival_rate_per_s=config.arrival_rate_per_s,
        tpot_s=tpot,
        queue_s=queue,
        worker_of=worker_of,
        union_per_layer_steps=np.asarray(union_samples, dtype=np.float64),
        batch_steps=np.asarray(batch_samples, dtype=np.int64),
        imbalance_samples=np.asarray(imbalance, dtype=np.float64),
        assigned_per_worker=assigned_per_worker,
        fallbacks=fallbacks,
        queued_share=float(blocked[measured].mean()) if measured.size else 0.0,
        sim_end_s=now,
        assigned_s=assigned_s,
        finished_s=finished_s,
        version_of=version_of,
        union_step_s=np.asarray(union_times, dtype=np.float64),
        joined_s=joined_s,
        left_s=left_s,
        swaps=swaps,
        submitted_s=submitted_s,
        replica_of=(info.replica_of if info is not None else np.zeros(n_arr, dtype=np.int64)),
        view_error=(
            np.asarray(info.view_error, dtype=np.float64) if info is not None else np.zeros(0)
        ),
        activity_excess=(
            np.asarray(info.activity_excess, dtype=np.int64)
            if info is not None and track_activity
            else np.zeros(0, dtype=np.int64)
        ),
    )


_FLEET, _TICK, _SWAP = 0, 1, 2
"""Control event kinds: a fleet change, a controller call, a partition swap."""


def _centroid_mask(scores: np.ndarray | None, given: np.ndarray | None) -> np.ndarray | None:
    """Which slots own a centroid: `given`, else those with a finite score somewhere."""
    if given is not None:
        return np.asarray(given, dtype=bool)
    if scores is None:
        return None
    return np.asarray(np.isfinite(scores).any(axis=0), dtype=bool)


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
        workers: list[_Worker],
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

    def finished(self, a: int, now: float) -> None:
        """Arrival `a` produced its last token: the routers hear of it after the lag."""
        rid = str(a)
        if self.model.finish_lag_s > 0:
            self.push(now + self.model.finish_lag_s, _Finish(rid))
        else:
            for rep in self.replicas:
                rep.on_finished(rid, now)
