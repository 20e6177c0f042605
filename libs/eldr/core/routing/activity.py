"""Which experts each decode worker's batch is predicted to activate, per step.

The cost model says a decode step streams every distinct (MoE layer, expert) that any
token of the batch routes to. A router that knows, per worker, how likely each expert is
to be active in the next step can predict what one more request would add to that
worker's expert union, and so to its step time (`eldr.core.routing.pipeline.MarginalUnion`).

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
its decode summary (only where the capture plugin runs on the decode instance). Finishes
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
from functools import cached_property

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
        # Ascending by construction, so its ends bound it (min/max cost ~2 us a decision).
        if self.idx.size and (self.idx[0] < 0 or self.idx[-1] >= self.dim):
            raise ValueError(f"an index is outside {self.num_moe_layers} x {self.num_experts}")

    @property
    def dim(self) -> int:
        return self.num_moe_layers * self.num_experts

    # What the cost-aware policy weighs a worker's activity with (`ActivityView.marginal`),
    # computed once per demand: p is p_base[l] everywhere in layer l except at `idx`.

    @cached_property
    def layer_of(self) -> np.ndarray:
        """int64 [nnz]: the MoE layer of each of `idx`."""
        return self.idx // self.num_experts

    @cached_property
    def p_base(self) -> np.ndarray:
        """float64 [L]: p of an expert the prompt did not route to, per layer."""
        return np.asarray(-np.expm1(-self.base), dtype=np.float64)

    @cached_property
    def p_excess(self) -> np.ndarray:
        """float64 [nnz]: p at `idx` above its layer's `p_base` (the dense `probability`
        there, less the base)."""
        p_base = self.p_base.take(self.layer_of)
        return np.asarray(-np.expm1(-(self.base.take(self.layer_of) + self.excess)) - p_base)

    @cached_property
    def total(self) -> float:
        """Sum of p over every (MoE layer, expert): the experts one decode step of this
        request activates, in expectation (what it adds to an idle worker's union)."""
        return float(self.num_experts * self.p_base.sum() + self.p_excess.sum())

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
    c = _counts_2d(counts)
    if top_k < 1 or top_k > c.shape[1]:
        raise ValueError(f"top_k must be in [1, {c.shape[1]}], got {top_k}")
    if prior_tokens <= 0:
        raise ValueError(f"prior_tokens must be positive, got {prior_tokens}")
    idx, vals, totals = _nonzero_cells(c)
    return _demand(c.shape, idx, vals, totals, top_k, prior_tokens)


def request_expert_demand(
    counts: np.ndarray, prompt_tokens: int, *, top_k: int = 0, prior_tokens: float = 1.0
) -> ExpertDemand | None:
    """`expert_demand` of a request's counts with top_k estimated from them when 0
    (`estimate_top_k`, capped at E); None when every count is zero. One pass over the
    counts (the router's path: about 3,000 cells, a few percent of them non-zero)."""
    c = _counts_2d(counts)
    return demand_from_cells(
        c.shape, cells_of(c), prompt_tokens, top_k=top_k, prior_tokens=prior_tokens
    )


Cells = tuple[np.ndarray, np.ndarray, np.ndarray]
"""A request's non-zero counts: (flat indices layer * E + expert, ascending, int64; their
counts, float64; the per-layer totals, float64)."""


def cells_of(counts: np.ndarray) -> Cells:
    """The non-zero cells of counts [L, E] (`Cells`); ValueError for negative counts."""
    return _nonzero_cells(_counts_2d(counts))


def demand_from_cells(
    shape: tuple[int, ...],
    cells: Cells,
    prompt_tokens: int,
    *,
    top_k: int = 0,
    prior_tokens: float = 1.0,
) -> ExpertDemand | None:
    """`request_expert_demand` of a request given as its non-zero cells (`cells_of`), so
    that a decision extracts them once for its demand and its signature."""
    if prior_tokens <= 0:
        raise ValueError(f"prior_tokens must be positive, got {prior_tokens}")
    idx, vals, totals = cells
    if not idx.size:
        return None
    if top_k <= 0:
        top_k = 1 if prompt_tokens <= 0 else max(1, round(float(totals.max()) / prompt_tokens))
    return _demand(shape, idx, vals, totals, min(top_k, shape[1]), prior_tokens)


def _counts_2d(counts: np.ndarray) -> np.ndarray:
    c = np.asarray(counts)
    if c.ndim != 2 or c.shape[0] == 0 or c.shape[1] == 0:
        raise ValueError(f"counts must be [layers, experts], got {c.shape}")
    return c


def _nonzero_cells(c: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(flat indices of the non-zero cells, ascending; their counts as float64; the
    per-layer totals as float64). Integer counts sum exactly in any order, so the totals
    are those of the dense row sums."""
    flat = c.reshape(-1)
    idx = (flat != 0).nonzero()[0]
    vals = flat.take(idx).astype(np.float64)
    if c.dtype.kind != "u" and vals.size and vals.min() < 0:
        raise ValueError("counts must be non-negative")
    totals = np.bincount(idx // c.shape[1], weights=vals, minlength=c.shape[0])
    return idx.astype(np.int64, copy=False), vals, totals


def _demand(
    shape: tuple[int, ...],
    idx: np.ndarray,
    vals: np.ndarray,
    totals: np.ndarray,
    top_k: int,
    prior_tokens: float,
) -> ExpertDemand:
    layers, experts = shape
    denom = totals / top_k + prior_tokens
    uniform = prior_tokens * top_k / experts
    base_p = np.minimum(uniform / denom, MAX_PROBABILITY)
    base = -np.log1p(-base_p)
    layer_of = idx // experts
    p = np.minimum((vals + uniform) / denom.take(layer_of), MAX_PROBABILITY)
    excess = -np.log1p(-p) - base.take(layer_of)
    demand = ExpertDemand(layers, experts, base, idx, excess)
    # The probabilities are at hand here: fill the demand's cached properties with them
    # (what deriving them from `base` and `excess` gives, up to rounding) rather than
    # take exp(log(.)) again on the decision path.
    base_p_at = base_p.take(layer_of)
    demand.__dict__.update(layer_of=layer_of, p_base=base_p, p_excess=p - base_p_at)
    return demand


def expected_union(log_idle: np.ndarray) -> float:
    """Expected distinct (MoE layer, expert) pairs one decode step streams, from each
    pair's log-probability of being idle in that step: sum over pairs of 1 - exp(log_idle).

    The one model of a batch's expert union: tokens route independently, each by its
    request's per-token activation p, so a pair is idle with probability prod (1 - p)
    over the batch (log_idle = sum of log(1 - p)). The activity table holds the same
    product per worker (`ActivityTable.miss_view`, from which the cost-aware policy reads
    U), the trainer's shadow gate models a worker's batch with it
    (`eldr.core.training.online.modelled_union`) and replay its recorded batches
    (`eldr.replay.effect`).
    """
    return float(-np.sum(np.expm1(log_idle)))


def demand_nbytes(demand: ExpertDemand) -> int:
    """Bytes a demand's arrays hold (what an activity entry costs beyond its key)."""
    return int(demand.base.nbytes + demand.idx.nbytes + demand.excess.nbytes)


class _WorkerActivity:
    """One worker's summed miss log-mass, and its idle probabilities kept factored.

    P(cell idle) = exp(-(dense[cell] + base[layer])) = idle[cell] x factor[layer]:
    a request changes `dense` only where its prompt routed (a few percent of the cells),
    and `base` in every layer, so keeping exp(-dense) and exp(-base) apart updates `nnz`
    exponentials per request instead of L x E, and a decision reads only the request's
    cells (`ActivityView.marginal`)."""

    __slots__ = (
        "base",
        "dense",
        "factor",
        "idle",
        "layer_idle",
        "order",
        "requests",
        "revision",
        "union",
    )

    def __init__(self, layers: int, experts: int) -> None:
        self.dense = np.zeros(layers * experts, dtype=np.float64)
        self.base = np.zeros(layers, dtype=np.float64)
        self.requests = 0
        self.idle = np.ones(layers * experts, dtype=np.float64)
        """exp(-dense): P(idle) of each cell before its layer's factor."""
        self.factor = np.ones(layers, dtype=np.float64)
        """exp(-base) per layer."""
        self.layer_idle = np.full(layers, float(experts))
        """Expected idle experts per layer: factor x the layer's sum of `idle`."""
        self.union = 0.0
        """Expected distinct (layer, expert) cells per step: L x E - sum(layer_idle)."""
        self.revision = 0
        self.order: OrderedDict[str, None] = OrderedDict()
        """This worker's request ids, oldest first (what `evict_over` drops first)."""

    @property
    def nbytes(self) -> int:
        return int(
            self.dense.nbytes
            + self.base.nbytes
            + self.idle.nbytes
            + self.factor.nbytes
            + self.layer_idle.nbytes
        )

    def apply(self, demand: ExpertDemand, sign: float) -> None:
        idx = demand.idx
        dense = self.dense
        dense[idx] += sign * demand.excess
        self.base += sign * demand.base
        self.requests += 1 if sign > 0 else -1
        layers = self.base.shape[0]
        if self.requests <= 0:
            # Subtractions leave rounding residue; an empty worker is exactly idle.
            dense.fill(0.0)
            self.base.fill(0.0)
            self.idle.fill(1.0)
            self.factor.fill(1.0)
            self.layer_idle.fill(float(dense.shape[0] // layers))
            self.union = 0.0
            self.requests = 0
        else:
            # Log-masses are non-negative; only rounding residue can make them less.
            self.idle[idx] = np.exp(-np.maximum(dense.take(idx), 0.0))
            self.factor = np.exp(-np.maximum(self.base, 0.0))
            self.layer_idle = self.factor * self.idle.reshape(layers, -1).sum(axis=1)
            self.union = float(dense.shape[0] - self.layer_idle.sum())
        self.revision += 1

    def miss_probability(self) -> np.ndarray:
        """Dense P(idle) per cell, float64 [L * E] (a new array)."""
        experts = self.dense.shape[0] // self.base.shape[0]
        return np.asarray(self.idle * np.repeat(self.factor, experts))


class ActivityView:
    """What cost-aware routing reads of an `ActivityTable` for one decision over
    `workers` (in that order; a worker with nothing counted is idle).

    Held cell-major ([L x E, workers]): a decision gathers the request's cells, each a
    contiguous run of one value per worker (a few hundred cache lines, not one per
    worker and cell).

    Valid until the table's next `view` (which reuses its arrays): it shows the table as
    it was when it was taken, even after later `add`s or `finish`es, and raises if used
    after another view was taken.
    """

    __slots__ = ("_factor", "_generation", "_idle", "_layer_idle", "_table", "_union", "shape")

    def __init__(
        self,
        table: ActivityTable,
        shape: tuple[int, int],
        idle: np.ndarray,
        factor: np.ndarray,
        layer_idle: np.ndarray,
        union: np.ndarray,
    ) -> None:
        self._table = table
        self._generation = table._view_generation
        self.shape = shape
        """(MoE layers, experts) of the table."""
        self._idle, self._factor, self._layer_idle, self._union = idle, factor, layer_idle, union

    def __len__(self) -> int:
        return int(self._union.shape[0])

    def _check(self) -> None:
        if self._table._view_generation != self._generation:
            raise RuntimeError("an activity view was used after a later one was taken")

    def marginal(
        self, demand: ExpertDemand, columns: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(U, dU), float64 [workers] each (or [len(columns)], for those of the view's
        workers only): each worker's expected expert union per step (summed over MoE
        layers) and what `demand`'s request would add to it.

        dU_i = sum over cells of P_i(idle) x p = sum_l p_base[l] x (expected idle experts
        of layer l) + sum over the request's cells of P_i(idle) x p_excess: the dense
        product over L x E cells, read at the request's non-zero cells (and the given
        workers) only.
        """
        self._check()
        if (demand.num_moe_layers, demand.num_experts) != self.shape:
            raise ValueError(
                f"a {demand.num_moe_layers} x {demand.num_experts} demand against a "
                f"{self.shape[0]} x {self.shape[1]} activity table"
            )
        if columns is not None:
            at = self._idle[demand.idx[:, None], columns]
            at *= self._factor[demand.layer_of[:, None], columns]
            added = demand.p_excess @ at
            added += demand.p_base @ self._layer_idle[:, columns]
            return self._union[columns], added
        at = self._idle.take(demand.idx, axis=0)
        at *= self._factor.take(demand.layer_of, axis=0)
        added = demand.p_excess @ at
        added += demand.p_base @ self._layer_idle
        return self._union.copy(), added

    def miss(self) -> np.ndarray:
        """float64 [workers, L * E]: P(expert idle in each worker's next step) (a copy)."""
        self._check()
        miss = self._idle * np.repeat(self._factor, self.shape[1], axis=0)
        return np.ascontiguousarray(miss.T)


class ActivityReader:
    """What the marginal-union scorer reads of an `ActivityTable` for a few workers of
    `workers`, straight from their own sums: nothing is gathered for the rest of the fleet,
    so reading it costs the same at 16 workers as at 1,024 (a fleet-scale profile reads
    only its band). `ActivityView` reads every worker at once instead (the older rules,
    which weigh the whole fleet). Valid until the table changes."""

    __slots__ = ("_table", "_workers", "shape")

    def __init__(self, table: ActivityTable, workers: Sequence[str], shape: tuple[int, int]):
        self._table = table
        self._workers = workers
        self.shape = shape

    def __len__(self) -> int:
        return len(self._workers)

    def marginal(
        self, demand: ExpertDemand, columns: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(U, dU) of the workers at `columns` (every worker when None): as
        `ActivityView.marginal`, from each worker's own sums."""
        if (demand.num_moe_layers, demand.num_experts) != self.shape:
            raise ValueError(
                f"a {demand.num_moe_layers} x {demand.num_experts} demand against a "
                f"{self.shape[0]} x {self.shape[1]} activity table"
            )
        cols = range(len(self._workers)) if columns is None else columns.tolist()
        held = self._table._workers
        states = [held.get(self._workers[c]) for c in cols]
        union = np.zeros(len(states))
        added = np.full(len(states), demand.total)  # an idle worker: every expert is new
        idx, layer_of = demand.idx, demand.layer_of
        p_excess, p_base = demand.p_excess, demand.p_base
        busy = [i for i, state in enumerate(states) if state is not None]
        active = [state for state in states if state is not None]
        if len(active) <= STACK_FROM:
            # A few workers (the usual band): a loop costs less than stacking their rows.
            for i, state in zip(busy, active, strict=True):
                at = state.idle.take(idx)
                at *= state.factor.take(layer_of)
                added[i] = p_excess @ at + p_base @ state.layer_idle
                union[i] = state.union
        elif active:
            # Many (a large band): one gather per worker, then the products at once.
            m = len(active)
            at = np.empty((m, idx.size))
            factor = np.empty((m, demand.num_moe_layers))
            layer_idle = np.empty((m, demand.num_moe_layers))
            for j, state in enumerate(active):
                state.idle.take(idx, out=at[j])
                factor[j] = state.factor
                layer_idle[j] = state.layer_idle
                union[busy[j]] = state.union
            at *= factor.take(layer_of, axis=1)
            added[busy] = at @ p_excess + layer_idle @ p_base
        return union, added


STACK_FROM = 4
"""Busy workers from which `ActivityReader.marginal` gathers their rows into one matrix
(measured: below it, per-worker products cost less than the copies)."""


class RecordedActivity:
    """The activity terms a decision recorded, per worker of a replayed view: (U, dU) of the
    workers the decision scored (NaN for the others), read back by the marginal-union
    scorer in place of the activity table the router held (`ActivityView.marginal`)."""

    __slots__ = ("added", "shape", "union")

    def __init__(self, shape: tuple[int, int], union: np.ndarray, added: np.ndarray) -> None:
        if union.shape != added.shape or union.ndim != 1:
            raise ValueError(f"{union.shape} unions for {added.shape} additions")
        self.shape = shape
        self.union = np.asarray(union, dtype=np.float64)
        self.added = np.asarray(added, dtype=np.float64)

    def __len__(self) -> int:
        return int(self.union.shape[0])

    def marginal(
        self, demand: ExpertDemand, columns: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """The recorded (U, dU) of `columns` (all workers when None); ValueError if one of
        them was not recorded."""
        if columns is None:
            union, added = self.union.copy(), self.added.copy()
        else:
            union, added = self.union[columns], self.added[columns]
        if np.isnan(union).any() or np.isnan(added).any():
            raise ValueError("the record holds no activity terms for a worker it scores")
        return union, added


ActivityInput = ActivityView | ActivityReader | RecordedActivity
"""What a decision's marginal-union scorer may read its (U, dU) from."""

MAX_CELL_LISTS = 8
"""Changes to one worker between two views beyond which its whole column is copied."""

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
        # The last view's arrays (columns in `_view_workers` order) and, per worker whose
        # state changed since, the cells that changed (None: any): consecutive decisions
        # over the same workers copy only the cells of the requests added or finished
        # in between (one or two per decision), not L x E cells per worker.
        self._view_workers: tuple[str, ...] = ()
        self._view_index: dict[str, int] = {}
        self._view_arrays: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
        self._changed: dict[str, list[np.ndarray] | None] = {}
        self._view_generation = 0

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
        self._note_change(worker_id, demand.idx)
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
            self._note_change(worker_id, None)  # exactly idle again: every cell
        else:
            self._note_change(worker_id, demand.idx)
        return True

    def _note_change(self, worker_id: str, cells: np.ndarray | None) -> None:
        """`worker_id`'s idle probabilities changed at `cells` (None: anywhere)."""
        if worker_id not in self._changed:
            self._changed[worker_id] = None if cells is None else [cells]
            return
        pending = self._changed[worker_id]
        if pending is None:
            return
        if cells is None or len(pending) >= MAX_CELL_LISTS:
            self._changed[worker_id] = None
        else:
            pending.append(cells)

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
        self._note_change(worker_id, demand.idx)
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
        self._view_arrays = None
        self._view_workers = ()
        self._view_index = {}
        self._changed.clear()

    def view(self, workers: Sequence[str]) -> ActivityView | None:
        """What cost-aware routing reads of each of `workers` (a worker with nothing
        counted is idle); None before any demand was added (no geometry yet). The view
        is valid until the next call (see `ActivityView`)."""
        if self._shape is None:
            return None
        layers, experts = self._shape
        key = tuple(workers)
        arrays = self._view_arrays
        if (
            arrays is None
            or (key is not self._view_workers and key != self._view_workers)
            or arrays[0].shape[0] != layers * experts
        ):
            n = len(key)
            arrays = (
                np.ones((layers * experts, n), dtype=np.float64),
                np.ones((layers, n), dtype=np.float64),
                np.full((layers, n), float(experts)),
                np.zeros(n, dtype=np.float64),
            )
            self._view_arrays, self._view_workers = arrays, key
            self._view_index = {w: i for i, w in enumerate(key)}
            refresh: dict[str, list[np.ndarray] | None] = dict.fromkeys(key)
        else:
            refresh = self._changed
        idle, factor, layer_idle, union = arrays
        index = self._view_index
        for w, cells in refresh.items():
            i = index.get(w)
            if i is None:
                continue
            state = self._workers.get(w)
            if state is None:
                idle[:, i] = 1.0
                factor[:, i] = 1.0
                layer_idle[:, i] = float(experts)
                union[i] = 0.0
                continue
            if cells is None:
                idle[:, i] = state.idle
            else:
                for at in cells:
                    idle[at, i] = state.idle.take(at)
            factor[:, i] = state.factor
            layer_idle[:, i] = state.layer_idle
            union[i] = state.union
        self._changed = {}
        self._view_generation += 1
        return ActivityView(self, self._shape, idle, factor, layer_idle, union)

    def reader(self, workers: Sequence[str]) -> ActivityReader | None:
        """What a fleet-scale decision reads of `workers` (`ActivityReader`: only the
        workers it asks about are read); None before any demand was added."""
        if self._shape is None:
            return None
        return ActivityReader(self, workers, self._shape)

    def miss_view(self, workers: Sequence[str]) -> np.ndarray | None:
        """float64 [len(workers), L * E]: P(expert idle in each worker's next step), a
        copy (a worker with nothing counted is all ones); None before any demand was
        added. Takes a `view`."""
        view = self.view(workers)
        return None if view is None else view.miss()
