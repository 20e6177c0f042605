"""Fold the experts routed for each prompt token into block summaries and prefill events.

The engine-side hook (`eldr.vllm.plugin`) sees, per engine step, the top-k expert ids of
every token the step computed, for all requests of the step flattened, plus which request
and position each row belongs to. `CaptureState` keeps, per request in prefill, the rows of
its prompt tokens and turns them into:

- `BlockSummaryMsg`s for full KV blocks as soon as every token of the block was computed
  (so a request that hits those blocks in the prefix cache a step later finds them), keyed
  by the project's own chained block hash (`eldr.core.signature.blocks.hash_chain`, from token ids:
  the same key the signature service and every other prefill worker use);
- one `PrefillDone` when the last prompt token was computed: the block-hash chain, the
  number of leading blocks that were prefix-cache hits (`cached_prefix_blocks`), timing,
  and the counts: when this instance holds its own summary of every cached block
  (`LocalSummaries`, kept for the blocks it computed, like the KV cache that holds them),
  the whole prompt's (`signature`: the router needs no lookup); otherwise the counts of
  everything that was computed (`computed`, the trailing partial block included), and
  the signature service supplies the cached blocks (KV loaded from another worker or an
  external cache, or a summary the bounded local store evicted).

Prefix-cache hits end on a block boundary of the engine's KV blocks. When that boundary is
not one of ours (an engine block size that is not a multiple of ours, or a connector that
loaded a ragged prefix), the block the boundary falls in is treated as cached too, and the
rows computed for its tail are left out of `computed`: the cached summary of that block
already counts them. So the router's sum `signature(cached blocks) + computed` counts every
prompt token exactly once, whatever was cached (and so does the local sum that becomes
`signature`).

A step goes through three stages: `plan` (host arithmetic on the engine's thread: which
rows form which (request, block) segment, which blocks and prompts the step completes),
the segment counts (on the device in the plugin, `eldr.vllm.prefill_counts`; from the rows
here, `segment_counts`), and `fold` (the counts into blocks and events, in step order).
`on_step` does all three from rows. Building the wire messages (sparse encoding, structs)
is deferred to whoever reads `StepResult.batches` / `StepResult.done` first: the
publisher's thread.

What is published once a step's blocks and prompts are known (the numbered batches, the
local summary store, the PrefillDone with or without the whole signature) is the prefill
producer's role, `eldr.roles.prefill.PrefillProducer` (`CaptureState.producer`), which the
simulated prefill worker plays too; this module works out from the engine's rows what each
step computed.

Pure: numpy, `eldr.core` and `eldr.wire` only; times come in as arguments.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from eldr.core.signature.blocks import COUNT_DTYPE, hash_chain
from eldr.core.workload.trace import ModelGeometry
from eldr.roles.prefill import (
    DEFAULT_LOCAL_SUMMARY_BYTES,
    LocalSummaries,
    PendingBlock,
    PendingDone,
    PrefillProducer,
    client_label,
    unavailable_prefill_done,
)
from eldr.wire import BlockSummaryBatch, PrefillDone
from eldr.wire.base import MAX_ATTRS, MAX_ID_LEN

EXPERT_ROW_DTYPE = np.int16
UNSET = -1
"""Expert id of a row not computed (yet)."""


@dataclass(frozen=True)
class CaptureConfig:
    worker_id: str
    """The prefill worker's subject token."""
    model: str
    """Model name the block cache is keyed by (identical on every prefill worker)."""
    block_size: int
    geometry: ModelGeometry
    hash_key: bytes = b""
    """The deployment's block-hash key (`eldr.settings.BlockHashSettings`; empty: unkeyed)."""
    local_summary_bytes: int = DEFAULT_LOCAL_SUMMARY_BYTES
    """Byte budget of the store of this instance's own block summaries (`LocalSummaries`);
    0: none, every prefix hit's cached blocks come from the signature service."""

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.local_summary_bytes < 0:
            raise ValueError(f"local_summary_bytes must be >= 0, got {self.local_summary_bytes}")


@dataclass
class RequestCapture:
    """One request in prefill: its prompt, what was cached, which positions were computed
    so far (the engine's side, `filled`) and the expert counts of its blocks in progress
    (`partial`, added when each step's counts arrive: `CaptureState.fold`)."""

    engine_id: str
    """The engine's request id (the key of the step layout)."""
    request_id: str
    """The gateway's id of the request (what the decision is recorded under)."""
    token_ids: np.ndarray
    block_hashes: list[int]
    cached_blocks: int
    """Leading full blocks not computed here (prefix-cache or connector hits)."""
    start_s: float
    """Monotonic time the request was first scheduled."""
    reply_to: str | None = None
    max_tokens: int | None = None
    decision_budget_s: float | None = None
    """How long the requester waits for the decision after the prefill (the gateway's
    budget, from `vllm_xargs`): the event's deadline is its publish time plus this."""
    client_request_id: str | None = None
    """The client's own id for the request (a label on the PrefillDone)."""
    attrs: dict[str, str] = field(default_factory=dict)
    filled: np.ndarray = field(init=False, repr=False)
    """bool [n_prompt - first_row]: positions from `first_row` on computed (or cached)."""
    planned_block: int = field(init=False)
    """Next full block not yet planned complete (`CaptureState.plan`)."""
    partial: dict[int, np.ndarray] = field(init=False, repr=False)
    """Block index -> uint32 [L, E] counts folded so far (blocks not yet emitted)."""
    tail_rows: int = field(init=False)
    """Rows of the trailing partial block whose counts were folded (cached ones excluded)."""
    computed_total: np.ndarray = field(init=False, repr=False)
    """uint32 [L, E]: counts of the full blocks emitted so far."""
    block_size: int = 0
    geometry: ModelGeometry | None = None
    rows: list[tuple[np.ndarray, np.ndarray]] | None = None
    """(positions, expert ids) of every computed row, kept only for the debug dump."""

    def __post_init__(self) -> None:
        assert self.geometry is not None
        assert self.block_size > 0
        g = self.geometry
        self.filled = np.zeros(self.n_prompt - self.first_row, dtype=bool)
        self.planned_block = self.cached_blocks
        self.partial = {}
        self.tail_rows = 0
        self.computed_total = np.zeros((g.num_moe_layers, g.num_experts), dtype=np.uint32)

    @property
    def n_prompt(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def n_full(self) -> int:
        return len(self.block_hashes)

    @property
    def first_row(self) -> int:
        """First prompt position whose routing this request contributes itself."""
        return self.cached_blocks * self.block_size

    @property
    def complete(self) -> bool:
        return bool(self.filled.all())

    def dump_rows(self) -> np.ndarray:
        """int16 [n_prompt - first_row, L, k] of the rows kept for the dump (-1: none)."""
        g = self.geometry
        assert g is not None
        out = np.full(
            (self.n_prompt - self.first_row, g.num_moe_layers, g.top_k), UNSET, EXPERT_ROW_DTYPE
        )
        for positions, rows in self.rows or []:
            out[positions - self.first_row] = rows
        return out

    def fold(self, block: int, counts: np.ndarray, n_rows: int) -> None:
        """Add one segment's counts (uint [L, E]: `n_rows` rows of block `block`)."""
        held = self.partial.get(block)
        if held is None:
            self.partial[block] = counts.astype(np.uint32)
        else:
            held += counts
        if block == self.n_full:
            self.tail_rows += n_rows

    def take_block(self, block: int) -> np.ndarray:
        """The counts of a full block, complete: uint32 [L, E] (its partial sums)."""
        assert self.geometry is not None
        g = self.geometry
        counts = self.partial.pop(block, None)
        if counts is None:
            counts = np.zeros((g.num_moe_layers, g.num_experts), dtype=np.uint32)
        self.computed_total += counts
        return counts

    def tail_counts(self) -> tuple[np.ndarray, bool]:
        """(uint32 [L, E] counts of the computed rows after the full blocks, whether those
        rows are the whole trailing partial block)."""
        assert self.geometry is not None
        g = self.geometry
        counts = self.partial.pop(self.n_full, None)
        if counts is None:
            counts = np.zeros((g.num_moe_layers, g.num_experts), dtype=np.uint32)
        return counts, self.tail_rows == self.n_prompt - self.n_full * self.block_size


@dataclass(frozen=True)
class StepPlan:
    """What one engine step computed of the requests in prefill, known on the host before
    any expert id is read: which rows go into which (request, block) segment, which full
    blocks and which prompts this step completes. `CaptureState.plan` makes it on the
    engine's thread; the segment counts come from the device (the plugin) or from rows
    (`segment_counts`), and `CaptureState.fold` turns plan and counts into messages."""

    row_idx: np.ndarray
    """int64 [m]: the step's rows that are prompt tokens of requests in prefill."""
    seg_idx: np.ndarray
    """int64 [m]: each such row's segment."""
    segments: list[tuple[RequestCapture, int, int]]
    """(request, block index, rows) per segment; block `n_full` is the trailing partial."""
    blocks: list[tuple[RequestCapture, int]]
    """Full blocks completed by this step (request, block index), in order."""
    done: list[RequestCapture]
    """Requests whose prompt this step completed."""
    positions: np.ndarray
    """int64 [m]: each row's prompt position (for the debug dump)."""

    @property
    def n_segments(self) -> int:
        return len(self.segments)

    def __bool__(self) -> bool:
        return bool(self.segments or self.blocks or self.done)


def segment_counts(plan: StepPlan, expert_ids: np.ndarray, geometry: ModelGeometry) -> np.ndarray:
    """int64 [segments, L, E + 1] from the step's rows (int [rows, L, k]): per segment,
    layer and expert the rows routed there; column E counts ids outside [0, E) (-1: a
    layer that did not write). What the device computes in the plugin, on the host: one
    `bincount` (the rows are a slice, not a copy, when they are contiguous, as they are
    unless other requests' rows sit between them)."""
    g = geometry
    width = g.num_experts + 1
    cells = plan.n_segments * g.num_moe_layers * width
    m = int(plan.row_idx.shape[0])
    if m == 0:
        return np.zeros((plan.n_segments, g.num_moe_layers, width), dtype=np.int64)
    first = int(plan.row_idx[0])
    if int(plan.row_idx[-1]) - first + 1 == m:
        ids = expert_ids[first : first + m]
    else:
        ids = expert_ids[plan.row_idx]
    if ((ids < 0) | (ids >= g.num_experts)).any():
        ids = np.where((ids < 0) | (ids >= g.num_experts), g.num_experts, ids)
    base = (plan.seg_idx[:, None] * g.num_moe_layers + np.arange(g.num_moe_layers)) * width
    flat = base[:, :, None] + ids  # int64 [m, L, k]
    counts = np.bincount(flat.ravel(), minlength=cells)
    return counts.reshape(plan.n_segments, g.num_moe_layers, width)


def invalid_counts_reason(counts: np.ndarray, geometry: ModelGeometry) -> str | None:
    """Why a step's segment counts (uint [S, L, E + 1]) cannot be trusted, or None: some
    row of some layer carried no valid expert id (column E), i.e. a layer did not write
    (rows start at -1) or wrote an id outside [0, E)."""
    if counts.size == 0:
        return None
    bad_layers = np.flatnonzero(counts[:, :, geometry.num_experts].sum(axis=0))
    if bad_layers.size == 0:
        return None
    return (
        f"MoE layer(s) {bad_layers.tolist()[:8]} (of {geometry.num_moe_layers}) wrote no "
        f"expert id, or one outside [0, {geometry.num_experts}), for a step's prompt tokens: "
        "a kernel path that bypasses the router callback"
    )


class StepResult:
    """What one engine step produced: block batches first, then prefill-done events.

    Holds dense counts; the wire messages are built on first access of `batches` or
    `done` (by the publisher's thread, off the engine's), and so is every use of the
    producer's local summary store: `batches` keeps this step's blocks in it, `done` (which
    builds `batches` first) looks up the cached blocks of this step's prefills. The
    publisher takes the steps in order, so a prefix hit finds every block an earlier step
    computed (and published), and the engine's thread does no more than before."""

    def __init__(
        self,
        producer: PrefillProducer,
        first_seq: int,
        wall_s: float,
        blocks: list[PendingBlock],
        done: list[PendingDone],
        completed: list[RequestCapture],
    ) -> None:
        self._producer = producer
        self._first_seq = first_seq
        self._wall_s = wall_s
        self._blocks = blocks
        self._done = done
        self.completed = completed
        """The requests whose prefill completed this step (their rows, for debugging)."""
        self._batches: list[BlockSummaryBatch] | None = None
        self._done_messages: list[PrefillDone] | None = None

    def __bool__(self) -> bool:
        return bool(self._blocks or self._done)

    @property
    def batches(self) -> list[BlockSummaryBatch]:
        if self._batches is None:
            self._batches = self._producer.batches(self._first_seq, self._wall_s, self._blocks)
        return self._batches

    @property
    def done(self) -> list[PrefillDone]:
        if self._done_messages is None:
            self.batches  # noqa: B018 -- this step's blocks go into the store first
            self._done_messages = [self._producer.done(pending) for pending in self._done]
        return self._done_messages


def invalid_rows_reason(
    expert_ids: np.ndarray, spans: Sequence[tuple[int, int]], geometry: ModelGeometry
) -> str | None:
    """Why the captured rows `expert_ids[lo:hi]` of each span (the prompt rows of the
    requests being captured) cannot be trusted, or None: every MoE layer wrote every row
    (the step's rows start at -1), with expert ids in [0, E)."""
    for lo, hi in spans:
        if hi <= lo:
            continue
        rows = expert_ids[lo:hi]
        unwritten = np.flatnonzero((rows < 0).any(axis=(0, 2)))
        if unwritten.size:
            return (
                f"MoE layer(s) {unwritten.tolist()[:8]} (of {geometry.num_moe_layers}) wrote "
                "no expert ids for a step's prompt tokens: a kernel path that bypasses the "
                "router callback"
            )
        top = int(rows.max())
        if top >= geometry.num_experts:
            return f"expert id {top} outside [0, {geometry.num_experts})"
    return None


def _cached_blocks(num_computed_tokens: int, n_prompt: int, block_size: int) -> int:
    n_full = n_prompt // block_size
    return min(math.ceil(max(num_computed_tokens, 0) / block_size), n_full)


class CaptureState:
    """Per-engine capture state: requests in prefill and the per-publisher batch sequence.

    Not thread-safe: the engine's worker thread calls it (one step at a time).
    """

    def __init__(self, config: CaptureConfig) -> None:
        self.config = config
        self.requests: dict[str, RequestCapture] = {}
        self.keep_rows = False
        """Keep every computed row on its request (`RequestCapture.rows`: the debug dump)."""
        self.inexact = 0
        """Requests whose computed counts could not be made exact (see `add_request`)."""
        self.admitted: set[str] = set()
        """Engine ids taken by `add_request` and not yet `drop`ped (finished or aborted):
        a request the engine schedules as new once more is one it preempted and resumed."""
        self.resumed = 0
        """Requests scheduled as new again while admitted (a resumed request is re-sent
        in full under Model Runner V2): ignored, their prefill already has its event."""
        g, budget = config.geometry, config.local_summary_bytes
        self.producer = PrefillProducer(
            config.worker_id,
            config.model,
            config.block_size,
            g.num_moe_layers,
            g.num_experts,
            LocalSummaries(budget) if budget else None,
        )
        """What this instance publishes: its batch numbers (on the engine's thread, `fold`)
        and its own block summaries (None: the budget is 0; used by the publisher's
        thread only, `StepResult`), with its local hits and misses."""

    def __len__(self) -> int:
        return len(self.requests)

    def add_request(
        self,
        engine_id: str,
        token_ids: Sequence[int] | np.ndarray,
        num_computed_tokens: int,
        now_s: float,
        *,
        request_id: str | None = None,
        reply_to: str | None = None,
        max_tokens: int | None = None,
        attrs: dict[str, str] | None = None,
        decision_budget_s: float | None = None,
        client_request_id: str | None = None,
    ) -> RequestCapture | None:
        """Start tracking a request the engine scheduled for the first time.

        num_computed_tokens: prompt tokens the engine did not compute (prefix-cache and
        connector hits). Returns None when the whole prompt was cached: there is nothing
        of this prefill to observe (a decode-side request); and when `engine_id` is
        admitted already: a preempted request the engine resumed, which Model Runner V2
        schedules as a new one (its prompt's recomputed rows would make a second event;
        one still in prefill keeps what was captured, as under V1, whose resumed requests
        arrive as cached ones).
        """
        if engine_id in self.admitted:
            self.resumed += 1
            return None
        self.admitted.add(engine_id)
        tokens = np.asarray(token_ids, dtype=np.uint32)
        n_prompt = int(tokens.shape[0])
        if n_prompt == 0 or num_computed_tokens >= n_prompt:
            return None
        bs = self.config.block_size
        hashes = hash_chain(tokens, bs, key=self.config.hash_key)
        cached = _cached_blocks(num_computed_tokens, n_prompt, bs)
        capture_attrs = dict(attrs or {})
        if num_computed_tokens > cached * bs:
            # Tokens of the trailing partial block came from a cache: their routing is
            # nowhere to be had, so `computed` misses them. Say so in the event.
            self.inexact += 1
            capture_attrs["eldr_capture"] = "inexact"
        capture = RequestCapture(
            engine_id=engine_id,
            request_id=(request_id or engine_id)[:MAX_ID_LEN],
            token_ids=tokens,
            block_hashes=hashes,
            cached_blocks=cached,
            start_s=now_s,
            reply_to=reply_to,
            max_tokens=max_tokens,
            decision_budget_s=decision_budget_s,
            client_request_id=client_label(client_request_id),
            attrs=dict(list(capture_attrs.items())[:MAX_ATTRS]),
            block_size=bs,
            geometry=self.config.geometry,
        )
        if num_computed_tokens > cached * bs:
            # Mark the cached tail as filled (with no rows) so the request completes.
            capture.filled[: num_computed_tokens - capture.first_row] = True
        self.requests[engine_id] = capture
        return capture

    def drop(self, engine_id: str) -> None:
        """Forget a request (the engine finished or aborted it)."""
        self.requests.pop(engine_id, None)
        self.admitted.discard(engine_id)

    def unavailable(self, capture: RequestCapture, problem: str, wall_s: float) -> PrefillDone:
        """The load-only PrefillDone of a tracked request whose rows cannot be trusted."""
        g = self.config.geometry
        return unavailable_prefill_done(
            request_id=capture.request_id,
            model=self.config.model,
            prefill_worker=self.config.worker_id,
            n_prompt_tokens=capture.n_prompt,
            reply_to=capture.reply_to,
            max_tokens=capture.max_tokens,
            block_size=self.config.block_size,
            geometry=(g.num_moe_layers, g.num_experts),
            problem=problem,
            wall_s=wall_s,
            decision_budget_s=capture.decision_budget_s,
            client_request_id=capture.client_request_id,
        )

    def fail_all(self, problem: str, wall_s: float) -> list[PrefillDone]:
        """Give up on every request in prefill: each gets a load-only PrefillDone now."""
        out = [self.unavailable(c, problem, wall_s) for c in self.requests.values()]
        self.requests.clear()
        return out

    def on_step(
        self,
        engine_ids: Sequence[str],
        num_tokens: Sequence[int],
        positions: np.ndarray,
        expert_ids: np.ndarray,
        now_s: float,
        wall_s: float,
    ) -> StepResult:
        """Fold one step's rows into the requests in prefill (`plan`, the counts of the
        rows, `fold`: what the plugin does with the counting on the device).

        engine_ids / num_tokens: the step's requests in row order and how many rows each
        has; positions: int [rows] position of each row in its request; expert_ids: int
        [rows, L, k] with ids in [0, E) (rows past sum(num_tokens), e.g. padding, are
        ignored). `now_s` is monotonic (durations), `wall_s` Unix time (timestamps).
        """
        g = self.config.geometry
        total = int(sum(num_tokens))
        if expert_ids.ndim != 3 or expert_ids.shape[1:] != (g.num_moe_layers, g.top_k):
            raise ValueError(
                f"expert ids shaped {expert_ids.shape}, expected [rows, "
                f"{g.num_moe_layers}, {g.top_k}]"
            )
        if expert_ids.shape[0] < total or positions.shape[0] < total:
            raise ValueError(
                f"{total} scheduled tokens but {expert_ids.shape[0]} expert rows and "
                f"{positions.shape[0]} positions"
            )
        offsets = np.zeros(len(num_tokens) + 1, dtype=np.int64)
        np.cumsum(np.asarray(num_tokens, dtype=np.int64), out=offsets[1:])
        computed = [
            int(positions[offsets[i]]) if num_tokens[i] else 0 for i in range(len(num_tokens))
        ]
        plan = self.plan(engine_ids, num_tokens, computed)
        if self.keep_rows:
            self.keep(plan, expert_ids)
        return self.fold(plan, segment_counts(plan, expert_ids, g), now_s, wall_s)

    def plan(
        self, engine_ids: Sequence[str], num_tokens: Sequence[int], computed: Sequence[int]
    ) -> StepPlan:
        """The step's `StepPlan` from its layout (requests in row order, rows each, tokens
        computed before): host arithmetic only. Marks the positions computed; requests
        whose prompt completes leave `requests` (the plan keeps them for `fold`)."""
        bs = self.config.block_size
        rows: list[np.ndarray] = []
        segs: list[np.ndarray] = []
        poss: list[np.ndarray] = []
        segments: list[tuple[RequestCapture, int, int]] = []
        blocks: list[tuple[RequestCapture, int]] = []
        done: list[RequestCapture] = []
        offset = 0
        for engine_id, n, c in zip(engine_ids, num_tokens, computed, strict=True):
            lo, offset = offset, offset + int(n)
            capture = self.requests.get(engine_id)
            if capture is None or n == 0:
                continue
            c = int(c)
            first = capture.first_row
            p0, p1 = max(c, first), min(c + int(n), capture.n_prompt)
            if p1 > p0:
                capture.filled[p0 - first : p1 - first] = True
                b = p0 // bs
                while b * bs < p1:
                    s0, s1 = max(p0, b * bs), min(p1, (b + 1) * bs)
                    rows.append(np.arange(lo + s0 - c, lo + s1 - c, dtype=np.int64))
                    segs.append(np.full(s1 - s0, len(segments), dtype=np.int64))
                    poss.append(np.arange(s0, s1, dtype=np.int64))
                    segments.append((capture, b, s1 - s0))
                    b += 1
            end = capture.planned_block
            while (
                end < capture.n_full
                and capture.filled[end * bs - first : (end + 1) * bs - first].all()
            ):
                blocks.append((capture, end))
                end += 1
            capture.planned_block = end
            if capture.complete:
                done.append(capture)
                del self.requests[engine_id]
        empty = np.zeros(0, dtype=np.int64)
        return StepPlan(
            row_idx=np.concatenate(rows) if rows else empty,
            seg_idx=np.concatenate(segs) if segs else empty,
            segments=segments,
            blocks=blocks,
            done=done,
            positions=np.concatenate(poss) if poss else empty,
        )

    def keep(self, plan: StepPlan, expert_ids: np.ndarray) -> None:
        """Keep the plan's rows on their requests (the debug dump's only use)."""
        for i, (capture, _, _) in enumerate(plan.segments):
            mine = plan.seg_idx == i
            if capture.rows is None:
                capture.rows = []
            capture.rows.append(
                (plan.positions[mine], expert_ids[plan.row_idx[mine]].astype(EXPERT_ROW_DTYPE))
            )

    def fold(self, plan: StepPlan, counts: np.ndarray, now_s: float, wall_s: float) -> StepResult:
        """Add a step's segment counts (uint [segments, L, >= E]; the plan's order) to its
        requests: the blocks the step completed, with their summaries, and the
        PrefillDone of every prompt it completed. Steps are folded in order."""
        g = self.config.geometry
        E = g.num_experts
        counts = counts.astype(np.uint32, copy=False)
        for i, (capture, block, n_rows) in enumerate(plan.segments):
            capture.fold(block, counts[i, :, :E], n_rows)
        pending: list[PendingBlock] = []
        seen: set[int] = set()
        for capture, b in plan.blocks:
            block_counts = capture.take_block(b)
            block_hash = capture.block_hashes[b]
            if block_hash in seen:  # two requests computed the same block
                continue
            seen.add(block_hash)
            pending.append(
                PendingBlock(
                    block_hash,
                    capture.block_hashes[b - 1] if b > 0 else None,
                    self.config.block_size,
                    block_counts.astype(COUNT_DTYPE),
                )
            )
        done = [self._prefill_done(capture, now_s, wall_s) for capture in plan.done]
        first_seq = self.producer.reserve(len(pending))
        return StepResult(self.producer, first_seq, wall_s, pending, done, list(plan.done))

    def _prefill_done(self, capture: RequestCapture, now_s: float, wall_s: float) -> PendingDone:
        tail, whole_tail = capture.tail_counts()
        partial = tail if capture.n_prompt % self.config.block_size and whole_tail else None
        return self.producer.pending_done(
            request_id=capture.request_id,
            wall_s=wall_s,
            block_hashes=capture.block_hashes,
            n_prompt_tokens=capture.n_prompt,
            cached_blocks=capture.cached_blocks,
            computed=capture.computed_total + tail,
            partial=partial,
            reply_to=capture.reply_to,
            max_tokens=capture.max_tokens,
            attrs=capture.attrs,
            prefill_s=max(0.0, now_s - capture.start_s),
            decision_budget_s=capture.decision_budget_s,
            client_request_id=capture.client_request_id,
        )
