"""Discrete-event simulation of the decode side of a PD-disaggregated MoE cluster.

Requests arrive (after prefill) as a Poisson process, a routing policy assigns each to one of
W decode workers, and each worker runs continuous batching: while it has requests it runs
decode steps back to back; a step advances every running request by one token and costs
what the cost model says for the distinct experts that step's batch activates. A request
assigned to a busy worker joins the batch at the next step boundary, or waits while the
batch is full (`max_batch`). Each request replays its recorded decode trace, so the experts
of every step are the model's real choices, not a statistical stand-in.

Everything runs in simulated time; the same inputs and seed give the same results.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from eldr.core.costmodel import CostProfile
from eldr.core.policies import FleetView, Policy
from eldr.sim.worker import UnionCounter, flatten_decode_ids

__all__ = ["SimConfig", "SimRequest", "SimResult", "flatten_decode_ids", "simulate"]


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

    def __post_init__(self) -> None:
        if self.num_workers <= 0:
            raise ValueError("num_workers must be positive")
        if self.arrival_rate_per_s <= 0:
            raise ValueError("arrival_rate_per_s must be positive")
        if self.num_arrivals <= 0:
            raise ValueError("num_arrivals must be positive")
        if self.max_batch <= 0:
            raise ValueError("max_batch must be positive")
        if not 0 <= self.warmup_fraction < 1:
            raise ValueError("warmup_fraction must be in [0, 1)")


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
) -> SimResult:
    """Run one simulation.

    arrival_requests: index into `requests` for each arrival, in arrival order (the same
    sequence for every policy, so policies are compared on identical traffic).
    scores: float32 [len(requests), num_workers] similarity of each request's signature to
    each worker's centroid, used by policies that route by locality; None for load-only.
    union_slots: size of the (layer, expert) id space (moe_layers * num_experts).
    """
    n_arr = int(arrival_requests.shape[0])
    if n_arr != config.num_arrivals:
        raise ValueError("arrival_requests must have config.num_arrivals entries")
    if policy.uses_signature and scores is None:
        raise ValueError(f"policy {policy.name} needs scores")
    rng = np.random.default_rng(config.seed)
    gaps = rng.exponential(1.0 / config.arrival_rate_per_s, size=n_arr)
    arrival_s = np.cumsum(gaps)
    # The policy's own randomness (tie-breaks, P2C samples) gets a separate stream so that
    # arrival times are identical across policies for a seed.
    policy_rng = np.random.default_rng([config.seed, 1])

    W = config.num_workers
    workers = [_Worker() for _ in range(W)]
    worker_ids = tuple(f"w{i}" for i in range(W))
    in_flight = np.zeros(W, dtype=np.int64)
    kv_tokens = np.zeros(W, dtype=np.int64)

    warm_idx = int(config.warmup_fraction * n_arr)
    window_start = float(arrival_s[warm_idx]) if warm_idx < n_arr else float(arrival_s[-1])
    window_end = float(arrival_s[-1])

    assigned_s = np.zeros(n_arr)
    admitted_s = np.full(n_arr, np.nan)
    finished_s = np.full(n_arr, np.nan)
    worker_of = np.full(n_arr, -1, dtype=np.int64)
    blocked = np.zeros(n_arr, dtype=bool)
    union_samples: list[float] = []
    batch_samples: list[int] = []
    imbalance: list[float] = []
    fallbacks: dict[str, int] = {}
    union = UnionCounter(union_slots)

    events: list[tuple[float, int, int]] = []  # (time, tie-breaker, worker) step ends
    tie = 0

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
        dt = cost.step_time_s(union_total, float(wk.kv_tokens))
        if window_start <= now <= window_end:
            union_samples.append(union_total / num_moe_layers)
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
            else:
                keep_a.append(a)
                keep_p.append(p)
        wk.running = keep_a
        wk.running_pos = keep_p
        start_step(w, now)

    next_arrival = 0
    now = 0.0
    while next_arrival < n_arr or events:
        t_arr = arrival_s[next_arrival] if next_arrival < n_arr else np.inf
        if events and events[0][0] <= t_arr:
            now, _, w = heapq.heappop(events)
            end_step(w, now)
            continue
        now = float(t_arr)
        a = next_arrival
        next_arrival += 1
        req_idx = int(arrival_requests[a])
        row = scores[req_idx] if (scores is not None and policy.uses_signature) else None
        view = FleetView(workers=worker_ids, in_flight=in_flight, kv_tokens=kv_tokens, scores=row)
        choice = policy.choose(view, policy_rng)
        if choice.fallback:
            fallbacks[choice.fallback] = fallbacks.get(choice.fallback, 0) + 1
        w = choice.index
        if a >= warm_idx:
            mean_load = in_flight.mean()
            if mean_load > 0:
                imbalance.append(float(in_flight.max() / mean_load))
        worker_of[a] = w
        assigned_s[a] = now
        in_flight[w] += 1
        req = requests[req_idx]
        workers[w].kv_tokens += req.prompt_tokens
        kv_tokens[w] += req.prompt_tokens
        workers[w].waiting.append(a)
        if not workers[w].busy:
            start_step(w, now)

    measured = np.arange(warm_idx, n_arr)
    tokens = np.array(
        [requests[arrival_requests[a]].decode_tokens for a in measured], dtype=np.float64
    )
    tpot = (finished_s[measured] - assigned_s[measured]) / tokens
    queue = admitted_s[measured] - assigned_s[measured]
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
    )
