"""Which experts each decode worker's batch is predicted to activate, per step.

The cost model says a decode step streams every distinct (MoE layer, expert) that any
token of the batch routes to. A router that knows, per worker, how likely each expert is
to be active in the next step can predict what one more request would add to that
worker's expert union, and so to its step time (`eldr.core.routing.policies.MarginalUnion`).

Two pieces, both pure:

- `expert_demand` turns a request's prefill expert counts into its predicted per-step
  activation probability p[l, e] = P(a decode token of this request routes to expert e at
  MoE layer l): the prompt's per-layer routing frequencies, smoothed towards uniform by
  `prior_tokens` pseudo-tokens (a prompt of 15 tokens is a noisy sample of the decode
  distribution; on the real Llama-4 traces their correlation is about 0.63). Stored as a
  miss log-mass h = -log(1 - p), sparse: a per-layer base for the experts the prompt did
  not touch plus an excess at the ones it did.
- `ActivityTable` sums, per worker, the miss log-mass of the requests in flight there:
  treating requests as independent, P(expert d idle in the next step) = prod_j (1 - p_j[d])
  = exp(-sum_j h_j[d]). Requests enter when they are assigned and leave when they finish
  (or after `ttl_s`, when their finish was never observed).

What the live system provides: the router sees every decision of every replica (with the
request's prefill counts) on the decisions stream, and learns that a request left its
worker from the gateway's `RequestFinished` event (every request, capture or not) or from
its decode profile (only where the capture plugin runs on the decode instance). Finishes
arrive a little late (after the last token reached the gateway), so the table slightly
over-counts a worker's batch; the prediction from prefill counts is what is used here, in
the simulator and in the router alike.

Bounded by construction: a lost finish must not make an entry immortal. The router caps
each worker's entries at what its load reports and pending assignments say is in flight
plus a small slack (`evict_over`: the worker's oldest entries go first), the whole table
at `max_entries`, and every entry at `ttl_s` (a maximum decode duration). Without that, a
worker's predicted union saturates at L x E after a few thousand unfinished entries and
every worker costs the same.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MAX_PROBABILITY = 1.0 - 1e-6
"""Caps p so that -log(1 - p) stays finite (a prompt that sent every token to one expert)."""


@dataclass(frozen=True, eq=False)
class ExpertDemand:
    """A request's predicted per-step expert activation, as miss log-mass h = -log(1 - p).

    h[l * E + e] = base[l] + the matching `excess` where `idx` lists (l * E + e), else
    base[l]. Compared by identity (numpy arrays have no single truth value).
    """

    num_moe_layers: int
    num_experts: int
    base: np.ndarray
    """float64 [L]: miss log-mass of an expert the prompt did not route to."""
    idx: np.ndarray
    """int64 [nnz], ascending flat indices (layer * E + expert) the prompt routed to."""
    excess: np.ndarray
    """float64 [nnz]: their miss log-mass above the layer's base."""

    def __post_init__(self) -> None:
        if self.base.shape != (self.num_moe_layers,):
            raise ValueError(f"base has shape {self.base.shape}, expected ({self.num_moe_layers},)")
        if self.idx.shape != self.excess.shape or self.idx.ndim != 1:
            raise ValueError(f"{self.idx.shape} indices for {self.excess.shape} excess values")
        if self.idx.size and (self.idx.min() < 0 or self.idx.max() >= self.dim):
            raise ValueError(f"an index is outside {self.num_moe_layers} x {self.num_experts}")

    @property
    def dim(self) -> int:
        return self.num_moe_layers * self.num_experts

    def log_miss(self) -> np.ndarray:
        """Dense h, float64 [L * E]."""
        out = np.repeat(self.base, self.num_experts)
        out[self.idx] += self.excess
        return out

    def probability(self) -> np.ndarray:
        """Dense p = 1 - exp(-h), float64 [L * E]: P(a decode token activates each expert)."""
        return np.asarray(-np.expm1(-self.log_miss()), dtype=np.float64)


def estimate_top_k(counts: np.ndarray, prompt_tokens: int) -> int:
    """Experts per token per layer implied by a request's counts (at least 1).

    Every prompt token routes to top_k experts in every MoE layer, so a layer's count total
    is tokens x top_k; the largest layer total is used (a layer whose counts are partly
    missing cannot inflate it). Blocks missing from the signature make this an
    under-estimate.
    """
    if prompt_tokens <= 0:
        return 1
    arr = np.asarray(counts)
    largest = float(arr.reshape(arr.shape[0], -1).sum(axis=1).max()) if arr.size else 0.0
    return max(1, round(largest / prompt_tokens))


def expert_demand(
    counts: np.ndarray,
    *,
    top_k: int = 1,
    prior_tokens: float = 1.0,
) -> ExpertDemand:
    """Predicted per-step activation of a request from its prefill counts [L, E].

    p[l, e] = (counts[l, e] + prior_tokens * top_k / E) / (tokens_l + prior_tokens), with
    tokens_l = (counts summed over layer l) / top_k: the prompt's routing frequency at
    that layer, shrunk towards uniform by `prior_tokens` pseudo-tokens. A layer without
    counts predicts uniform top_k / E.
    """
    c = np.asarray(counts, dtype=np.float64)
    if c.ndim != 2 or c.shape[0] == 0 or c.shape[1] == 0:
        raise ValueError(f"counts must be [layers, experts], got {c.shape}")
    if top_k < 1 or top_k > c.shape[1]:
        raise ValueError(f"top_k must be in [1, {c.shape[1]}], got {top_k}")
    if prior_tokens <= 0:
        raise ValueError(f"prior_tokens must be positive, got {prior_tokens}")
    if (c < 0).any():
        raise ValueError("counts must be non-negative")
    layers, experts = c.shape
    tokens = c.sum(axis=1) / top_k
    denom = tokens + prior_tokens
    uniform = prior_tokens * top_k / experts
    base_p = np.minimum(uniform / denom, MAX_PROBABILITY)
    base = -np.log1p(-base_p)
    idx = np.flatnonzero(c.reshape(-1))
    layer_of = idx // experts
    p = np.minimum((c.reshape(-1)[idx] + uniform) / denom[layer_of], MAX_PROBABILITY)
    excess = -np.log1p(-p) - base[layer_of]
    return ExpertDemand(layers, experts, base, idx.astype(np.int64), excess)


def demand_nbytes(demand: ExpertDemand) -> int:
    """Bytes a demand's arrays hold (what an activity entry costs beyond its key)."""
    return int(demand.base.nbytes + demand.idx.nbytes + demand.excess.nbytes)


class _WorkerActivity:
    __slots__ = ("base", "dense", "dirty", "miss", "order", "requests", "revision")

    def __init__(self, layers: int, experts: int) -> None:
        self.dense = np.zeros(layers * experts, dtype=np.float64)
        self.base = np.zeros(layers, dtype=np.float64)
        self.requests = 0
        self.miss = np.ones(layers * experts, dtype=np.float64)
        self.dirty = False
        self.revision = 0
        self.order: OrderedDict[str, None] = OrderedDict()
        """This worker's request ids, oldest first (what `evict_over` drops first)."""

    @property
    def nbytes(self) -> int:
        return int(self.dense.nbytes + self.base.nbytes + self.miss.nbytes)

    def apply(self, demand: ExpertDemand, sign: float) -> None:
        self.dense[demand.idx] += sign * demand.excess
        self.base += sign * demand.base
        self.requests += 1 if sign > 0 else -1
        if self.requests <= 0:
            # Subtractions leave rounding residue; an empty worker is exactly idle.
            self.dense.fill(0.0)
            self.base.fill(0.0)
            self.requests = 0
        self.dirty = True
        self.revision += 1

    def miss_probability(self, experts: int) -> np.ndarray:
        if self.dirty:
            log_miss = self.dense + np.repeat(self.base, experts)
            np.maximum(log_miss, 0.0, out=log_miss)
            self.miss = np.exp(-log_miss)
            self.dirty = False
        return self.miss


DEFAULT_TTL_S = 130.0
"""Default entry lifetime: a maximum decode duration (4,096 output tokens at 30 ms per
token, about 123 s) plus a pending assignment's 10 s to be admitted, rounded down."""
DEFAULT_MAX_ENTRIES = 65_536
"""Default bound on the whole table (at ~16 KB per entry for 24 x 128 experts, ~1 GiB
at the very worst; the per-worker in-flight cap keeps it far below in practice)."""


class ActivityTable:
    """Per decode worker, the summed miss log-mass of its in-flight requests.

    One model geometry at a time. `set_shape` (the router, when a partition of another
    geometry becomes active) fixes it and clears what is held; without it the first demand
    fixes it, and a demand of another geometry is refused (`add` returns False and counts
    `refused_shape`) unless the table is empty: one event of a forged geometry cannot
    wipe out what every other request put there. Times are seconds passed in by the
    caller. At most `max_entries` requests are held (the oldest are evicted beyond);
    `evict_over` caps one worker's entries.
    """

    def __init__(
        self, ttl_s: float = DEFAULT_TTL_S, max_entries: int = DEFAULT_MAX_ENTRIES
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.evicted_capacity = 0
        """Entries evicted because the table was full (cumulative)."""
        self.refused_shape = 0
        """Demands refused because their geometry is not the table's (cumulative)."""
        self._entry_bytes = 0
        self._shape: tuple[int, int] | None = None
        self._shape_fixed = False
        self._workers: dict[str, _WorkerActivity] = {}
        # Insertion order is assignment order (nearly time order): expiry pops the front.
        self._entries: OrderedDict[str, tuple[str, float, ExpertDemand]] = OrderedDict()
        # The last view and, per row, the worker state and revision it was built from:
        # consecutive decisions over the same workers rebuild only the rows that changed.
        self._view_workers: tuple[str, ...] = ()
        self._view: np.ndarray | None = None
        self._view_rows: list[tuple[_WorkerActivity | None, int]] = []

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    @property
    def shape(self) -> tuple[int, int] | None:
        """(MoE layers, experts) of the demands held, or None while empty of any."""
        return self._shape

    def requests_on(self, worker_id: str) -> int:
        state = self._workers.get(worker_id)
        return 0 if state is None else state.requests

    def worker_of(self, request_id: str) -> str | None:
        entry = self._entries.get(request_id)
        return None if entry is None else entry[0]

    def per_worker(self) -> dict[str, int]:
        """Entries per worker (workers with none are absent)."""
        return {w: s.requests for w, s in self._workers.items()}

    @property
    def nbytes(self) -> int:
        """Bytes held by the entries' demands and the per-worker sums (what the table's
        memory grows with; Python object overhead not included)."""
        return self._entry_bytes + sum(s.nbytes for s in self._workers.values())

    def set_shape(self, shape: tuple[int, int] | None) -> None:
        """Fix the geometry demands must have (None: the first demand fixes it); a change
        clears the table."""
        if shape != self._shape:
            self.clear()
        self._shape = shape
        self._shape_fixed = shape is not None

    def add(self, worker_id: str, request_id: str, demand: ExpertDemand, now_s: float) -> bool:
        """Count a request against its worker; False if it is already counted or of
        another geometry than the table's (`refused_shape`). Beyond `max_entries` the
        oldest entry is evicted (`evicted_capacity`)."""
        if request_id in self._entries:
            return False
        shape = (demand.num_moe_layers, demand.num_experts)
        if self._shape != shape:
            if self._shape_fixed or self._entries:
                self.refused_shape += 1
                return False
            self.clear()
            self._shape = shape
        state = self._workers.get(worker_id)
        if state is None:
            state = self._workers[worker_id] = _WorkerActivity(*shape)
        state.apply(demand, 1.0)
        state.order[request_id] = None
        self._entries[request_id] = (worker_id, now_s, demand)
        self._entry_bytes += demand_nbytes(demand)
        while len(self._entries) > self.max_entries:
            self.finish(next(iter(self._entries)))
            self.evicted_capacity += 1
        return True

    def finish(self, request_id: str) -> bool:
        """The request finished (or was dropped); False if it was not counted."""
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return False
        worker_id, _, demand = entry
        self._entry_bytes -= demand_nbytes(demand)
        state = self._workers[worker_id]
        state.apply(demand, -1.0)
        del state.order[request_id]
        if state.requests == 0:
            del self._workers[worker_id]
        return True

    def move(self, request_id: str, worker_id: str) -> bool:
        """The request went to `worker_id` instead (a retry before it started): its
        demand moves there, keeping its age. False if it was not counted."""
        entry = self._entries.get(request_id)
        if entry is None:
            return False
        old, ts_s, demand = entry
        if old == worker_id:
            return True
        self.finish(request_id)
        state = self._workers.get(worker_id)
        if state is None:
            state = self._workers[worker_id] = _WorkerActivity(
                demand.num_moe_layers, demand.num_experts
            )
        state.apply(demand, 1.0)
        state.order[request_id] = None
        self._entries[request_id] = (worker_id, ts_s, demand)
        self._entry_bytes += demand_nbytes(demand)
        return True

    def evict_over(self, worker_id: str, limit: int) -> int:
        """Drop `worker_id`'s oldest entries until it holds at most `limit`; returns how
        many were dropped (finishes that were never seen)."""
        state = self._workers.get(worker_id)
        if state is None:
            return 0
        dropped = 0
        excess = state.requests - max(0, limit)
        while excess > 0:
            self.finish(next(iter(state.order)))
            excess -= 1
            dropped += 1
        return dropped

    def remove_worker(self, worker_id: str) -> int:
        """Forget a worker that left and its requests; returns how many."""
        state = self._workers.get(worker_id)
        if state is None:
            return 0
        gone = list(state.order)
        for rid in gone:
            self.finish(rid)
        return len(gone)

    def expire(self, now_s: float) -> int:
        """Drop requests counted for longer than `ttl_s` (their finish was never seen)."""
        horizon = now_s - self.ttl_s
        expired = 0
        while self._entries:
            rid, (_, ts_s, _) = next(iter(self._entries.items()))
            if ts_s >= horizon:
                break
            self.finish(rid)
            expired += 1
        return expired

    def clear(self) -> None:
        """Forget every entry (and the geometry, unless `set_shape` fixed it)."""
        self._entries.clear()
        self._workers.clear()
        self._entry_bytes = 0
        if not self._shape_fixed:
            self._shape = None
        self._view = None
        self._view_workers = ()
        self._view_rows = []

    def miss_view(self, workers: Sequence[str]) -> np.ndarray | None:
        """float64 [len(workers), L * E]: P(expert idle in each worker's next step).

        A worker with nothing counted is all ones. None before any demand was added (no
        geometry yet). Rows are cached per worker until its requests change.
        """
        if self._shape is None:
            return None
        layers, experts = self._shape
        key = tuple(workers)
        view = self._view
        if view is None or key != self._view_workers:
            view = np.ones((len(key), layers * experts), dtype=np.float64)
            rows: list[tuple[_WorkerActivity | None, int]] = [(None, 0)] * len(key)
        else:
            rows = self._view_rows
        for i, w in enumerate(key):
            state = self._workers.get(w)
            seen, revision = rows[i]
            if state is None:
                if seen is not None:
                    view[i] = 1.0
                    rows[i] = (None, 0)
            elif state is not seen or state.revision != revision:
                view[i] = state.miss_probability(experts)
                rows[i] = (state, state.revision)
        self._view, self._view_workers, self._view_rows = view, key, rows
        # Callers get a copy: the cached view changes under them at the next call.
        return view.copy()
