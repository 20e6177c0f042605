"""The prefill producer: what a prefill worker publishes about the prompts it computed.

A producer publishes, per full KV block it computed, a `BlockSummaryMsg` (in
`BlockSummaryBatch`es numbered per producer), keeps its own summary of each such block
(`LocalSummaries`, like the KV cache that holds the block), and ends each prompt with one
`PrefillDone`: the whole prompt's `signature` when it holds a summary of every block it took
from its prefix cache, else the counts of what it `computed`, leaving the cached blocks to
the signature service. A prompt whose routing cannot be captured gets a load-only event
(`unavailable_prefill_done`).

`PrefillProducer` is that state; `PendingBlock` and `PendingDone` are a block and an event
whose wire form is built later (the capture plugin builds them on its publisher's thread,
off the engine's). Called by the vLLM capture plugin (`eldr.vllm.capture`, which works out
from the engine's steps what each step computed), the gateway (load-only events) and the
simulated prefill worker (`eldr.sim.traffic`, which takes a trace's blocks as computed).

Pure: numpy, `eldr.core` and `eldr.wire` only; times come in as arguments.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from eldr.core.signature.blockcache import ENTRY_OVERHEAD_BYTES
from eldr.wire import BlockSummaryBatch, BlockSummaryMsg, PrefillDone, SparseCounts
from eldr.wire.base import MAX_BLOCKS_PER_BATCH, MAX_ID_LEN

DEFAULT_LOCAL_SUMMARY_BYTES = 64 << 20
"""64 MiB: well under 1% of KV memory. A block's summary is one byte per (MoE layer,
expert) cell, or 6 bytes per non-zero cell when that is smaller, plus
`ENTRY_OVERHEAD_BYTES`. Qwen3-30B-A3B (48 MoE layers x 128 experts, top-8; 4 KV heads of
128, bf16: 96 KiB of KV per token): 6,144 + 160 bytes per 16-token block of 1.5 MiB KV,
0.4%; 64 MiB holds 10,600 blocks (170k tokens, 15.6 GiB of KV). Llama 4 Maverick (24 MoE
layers x 128 experts, top-1; 48 layers of 8 KV heads: 192 KiB per token): at most 384
non-zero cells, 2.5 KB per 3 MiB block, 0.08%; 64 MiB holds 27,000 blocks (80 GiB of KV).
A KV cache larger than that: raise the budget (0.4% of the KV cache covers it all); a
prefix hit on a block the store evicted falls back to the signature service."""

MAX_DECISION_BUDGET_S = 3600.0
"""Longest decision budget an event may carry (a budget from `vllm_xargs` is clamped)."""


@dataclass(frozen=True, slots=True)
class LocalSummary:
    """One block's counts over the flat [L * E] cells: `dense` (uint8, or uint16 when a
    count exceeds 255), or `idx` (uint32) and `val` (uint16) when that is smaller."""

    nbytes: int
    dense: np.ndarray | None = None
    idx: np.ndarray | None = None
    val: np.ndarray | None = None

    @classmethod
    def of(cls, counts: np.ndarray) -> LocalSummary:
        flat = counts.reshape(-1)
        nnz = int(np.count_nonzero(flat))
        wide = nnz > 0 and int(flat.max()) > 255
        dense_nbytes = flat.size * (2 if wide else 1)
        if 6 * nnz < dense_nbytes:
            idx = np.flatnonzero(flat).astype(np.uint32)
            val = flat[idx].astype(np.uint16)
            return cls(6 * nnz + ENTRY_OVERHEAD_BYTES, idx=idx, val=val)
        dense = flat.astype(np.uint16 if wide else np.uint8)
        return cls(dense_nbytes + ENTRY_OVERHEAD_BYTES, dense=dense)

    def add_to(self, total: np.ndarray) -> None:
        """Add the counts into `total` (uint32, flat [L * E])."""
        if self.dense is not None:
            total += self.dense
        elif self.idx is not None and self.idx.size:
            total[self.idx] += self.val  # unique indices: fancy-index += is exact


class LocalSummaries:
    """The summaries of the full blocks this producer computed, by block hash: an LRU
    bounded in bytes (`max_bytes`, the capture plugin's budget) and/or in blocks
    (`max_blocks`, the simulated prefill worker's), unbounded with neither; the prefill
    side's copy of the signature cache for the blocks its own KV cache holds
    (`DEFAULT_LOCAL_SUMMARY_BYTES` says what it costs).

    A block's summary depends only on its tokens (through the chained hash: on its whole
    prefix), so the one kept here is the one this producer published. Not thread-safe: one
    thread alone uses it (the capture plugin's publisher's, which keeps its cost, about 3-10
    us a block to compact, off the engine's thread).
    """

    def __init__(self, max_bytes: int | None = None, *, max_blocks: int | None = None) -> None:
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        if max_blocks is not None and max_blocks <= 0:
            raise ValueError(f"max_blocks must be positive, got {max_blocks}")
        self.max_bytes = max_bytes
        self.max_blocks = max_blocks
        self._entries: OrderedDict[int, LocalSummary] = OrderedDict()
        self.bytes_used = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._entries

    def put(self, block_hash: int, counts: np.ndarray) -> None:
        """Keep `counts` ([L, E]) of a block computed here; a block held already is only
        refreshed (its summary is the same)."""
        if block_hash in self._entries:
            self._entries.move_to_end(block_hash)
            return
        entry = LocalSummary.of(counts)
        max_bytes = self.max_bytes
        if max_bytes is not None and entry.nbytes > max_bytes:
            return
        while self._entries and (
            (max_bytes is not None and self.bytes_used + entry.nbytes > max_bytes)
            or (self.max_blocks is not None and len(self._entries) >= self.max_blocks)
        ):
            _, evicted = self._entries.popitem(last=False)
            self.bytes_used -= evicted.nbytes
            self.evictions += 1
        self._entries[block_hash] = entry
        self.bytes_used += entry.nbytes

    def lookup(self, block_hashes: Sequence[int]) -> list[LocalSummary] | None:
        """The summaries of all of `block_hashes` (each refreshed as most recently used),
        or None, touching nothing, when any one is not held."""
        entries = self._entries
        found: list[LocalSummary] = []
        for h in block_hashes:
            entry = entries.get(h)
            if entry is None:
                return None
            found.append(entry)
        for h in block_hashes:
            entries.move_to_end(h)
        return found


@dataclass(frozen=True)
class PendingBlock:
    """A full block's summary, not yet in wire form."""

    block_hash: int
    parent_hash: int | None
    n_tokens: int
    counts: np.ndarray
    """uint16 [L, E]."""

    def message(self) -> BlockSummaryMsg:
        return BlockSummaryMsg(
            block_hash=self.block_hash,
            parent_hash=self.parent_hash,
            n_tokens=self.n_tokens,
            counts=SparseCounts.from_dense(self.counts),
        )


@dataclass(frozen=True)
class PendingDone:
    """A PrefillDone, not yet in wire form (`PrefillProducer.pending_done`)."""

    fields: dict[str, object]
    computed: np.ndarray | None
    """uint [L, E]: the counts of everything the prefill computed; None: the producer
    sends no counts (the signature service supplies every block)."""
    partial: np.ndarray | None
    cached_hashes: list[int] = field(default_factory=list)
    """The block hashes of its prefix-cache hits (the leading `cached_prefix_blocks`)."""

    def message(self, local: LocalSummaries | None) -> tuple[PrefillDone, bool | None]:
        """The event, and whether `local` held a summary of every cached block (then it
        carries `signature`, their sum plus `computed`, instead of `computed`); None when
        nothing was cached or no counts are sent."""
        partial = None if self.partial is None else SparseCounts.from_dense(self.partial)
        if self.computed is None:
            event = PrefillDone(**self.fields, partial=partial)  # type: ignore[arg-type]
            return event, None
        cached = None
        if self.cached_hashes and local is not None:
            cached = local.lookup(self.cached_hashes)
        if cached is None:
            event = PrefillDone(
                **self.fields,  # type: ignore[arg-type]
                computed=SparseCounts.from_dense(self.computed),
                partial=partial,
            )
            return event, (False if self.cached_hashes else None)
        total = self.computed.astype(np.uint32).reshape(-1)  # a copy
        for summary in cached:
            summary.add_to(total)
        event = PrefillDone(
            **self.fields,  # type: ignore[arg-type]
            signature=SparseCounts.from_dense(total.reshape(self.computed.shape)),
            partial=partial,
        )
        return event, True


def batch_count(n_blocks: int) -> int:
    """Batches `n_blocks` block summaries take (at most `MAX_BLOCKS_PER_BATCH` each)."""
    return -(-n_blocks // MAX_BLOCKS_PER_BATCH)


class PrefillProducer:
    """One prefill producer: what its messages say it is (worker, model, block size, MoE
    geometry), its batch sequence and its store of its own block summaries (`local`; None:
    every prefix hit's cached blocks come from the signature service).

    `reserve` (the batch numbers of some blocks) may run on another thread than `batches`
    and `done` (which use the store): the capture plugin numbers a step's batches on the
    engine's thread and builds them on its publisher's.
    """

    def __init__(
        self,
        worker_id: str,
        model: str,
        block_size: int,
        num_moe_layers: int,
        num_experts: int,
        local: LocalSummaries | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.model = model
        self.block_size = block_size
        self.num_moe_layers = num_moe_layers
        self.num_experts = num_experts
        self.local = local
        self.batch_seq = 0
        """The next batch's sequence number."""
        self.local_hits = 0
        """Prefills with a prefix-cache hit whose every cached block this producer held a
        summary of: their event carried the whole `signature`."""
        self.local_misses = 0
        """Prefills with a prefix-cache hit on a block it held no summary of (computed
        elsewhere, or evicted): the signature service supplies the cached blocks."""

    def reserve(self, n_blocks: int) -> int:
        """The first of the sequence numbers of the batches `n_blocks` blocks take."""
        first = self.batch_seq
        self.batch_seq += batch_count(n_blocks)
        return first

    def batches(
        self, first_seq: int, wall_s: float, blocks: Sequence[PendingBlock]
    ) -> list[BlockSummaryBatch]:
        """The batches of `blocks` (numbered from `first_seq`, stamped `wall_s`), which
        go into the local store: a later prefix hit on them finds their summaries."""
        messages = [b.message() for b in blocks]
        batches = [
            BlockSummaryBatch(
                worker_id=self.worker_id,
                seq=first_seq + n,
                ts_s=wall_s,
                model=self.model,
                num_moe_layers=self.num_moe_layers,
                num_experts=self.num_experts,
                block_size=self.block_size,
                blocks=messages[lo : lo + MAX_BLOCKS_PER_BATCH],
            )
            for n, lo in enumerate(range(0, len(messages), MAX_BLOCKS_PER_BATCH))
        ]
        if self.local is not None:
            for block in blocks:
                self.local.put(block.block_hash, block.counts)
        return batches

    def pending_done(
        self,
        *,
        request_id: str,
        wall_s: float,
        block_hashes: list[int],
        n_prompt_tokens: int,
        cached_blocks: int,
        computed: np.ndarray | None,
        partial: np.ndarray | None,
        reply_to: str | None = None,
        max_tokens: int | None = None,
        attrs: dict[str, str] | None = None,
        prefill_s: float | None = None,
        decision_budget_s: float | None = None,
        client_request_id: str | None = None,
    ) -> PendingDone:
        """The PrefillDone of a prompt whose leading `cached_blocks` full blocks came from
        the prefix cache: `computed` (uint [L, E]) counts everything else, the trailing
        partial block included, whose own counts are `partial`. Its deadline is `wall_s`
        plus `decision_budget_s` (the requester's wait for the decision)."""
        fields: dict[str, object] = {
            "request_id": request_id,
            "model": self.model,
            "prefill_worker": self.worker_id,
            "ts_s": wall_s,
            "block_size": self.block_size,
            "block_hashes": block_hashes,
            "n_prompt_tokens": n_prompt_tokens,
            "num_moe_layers": self.num_moe_layers,
            "num_experts": self.num_experts,
            "reply_to": reply_to,
            "prefill_s": prefill_s,
            "max_tokens": max_tokens,
            "attrs": attrs or {},
            "cached_prefix_blocks": cached_blocks,
            "deadline_s": deadline_of(wall_s, decision_budget_s),
            "client_request_id": client_request_id,
        }
        return PendingDone(fields, computed, partial, block_hashes[:cached_blocks])

    def done(self, pending: PendingDone) -> PrefillDone:
        """The event of `pending`, with the whole signature when the local store holds
        every cached block (counted in `local_hits` / `local_misses`)."""
        event, held = pending.message(self.local)
        if held is not None:
            if held:
                self.local_hits += 1
            else:
                self.local_misses += 1
        return event


def unavailable_prefill_done(
    *,
    request_id: str,
    model: str,
    prefill_worker: str,
    n_prompt_tokens: int,
    reply_to: str | None,
    max_tokens: int | None,
    block_size: int,
    geometry: tuple[int, int] | None,
    problem: str,
    wall_s: float,
    decision_budget_s: float | None = None,
    client_request_id: str | None = None,
) -> PrefillDone:
    """A PrefillDone for a prompt whose routing could not be captured: no block hashes,
    no counts, `capture = "unavailable"`, so a router decides load-only at once (recorded
    and counted like any decision) instead of the requester waiting for one that cannot
    come. `geometry` (MoE layers, experts), if known, is informational: nothing reads it
    without counts. Published by the capture plugin for a request it cannot capture, and
    by the gateway for a prefill instance whose plugin says it cannot (or says nothing).
    With `decision_budget_s` the event's deadline is `wall_s` plus it."""
    layers, experts = geometry or (1, 1)
    return PrefillDone(
        request_id=request_id[:MAX_ID_LEN],
        model=model[:MAX_ID_LEN] or "unknown",
        prefill_worker=prefill_worker,
        ts_s=wall_s,
        block_size=block_size,
        block_hashes=[],
        n_prompt_tokens=n_prompt_tokens,
        partial=None,
        num_moe_layers=layers,
        num_experts=experts,
        reply_to=reply_to,
        max_tokens=max_tokens,
        attrs={"eldr_capture": problem[:64]},
        capture="unavailable",
        deadline_s=deadline_of(wall_s, decision_budget_s),
        client_request_id=client_label(client_request_id),
    )


def client_label(client_request_id: str | None) -> str | None:
    """A client's request id as a record's label (bounded; None for none or empty)."""
    return client_request_id[:MAX_ID_LEN] if client_request_id else None


def deadline_of(wall_s: float, decision_budget_s: float | None) -> float | None:
    """The deadline of an event published at `wall_s` whose requester waits
    `decision_budget_s` for the decision (clamped to [0, MAX_DECISION_BUDGET_S])."""
    if decision_budget_s is None:
        return None
    return wall_s + min(max(float(decision_budget_s), 0.0), MAX_DECISION_BUDGET_S)


__all__ = [
    "DEFAULT_LOCAL_SUMMARY_BYTES",
    "MAX_DECISION_BUDGET_S",
    "LocalSummaries",
    "LocalSummary",
    "PendingBlock",
    "PendingDone",
    "PrefillProducer",
    "batch_count",
    "client_label",
    "deadline_of",
    "unavailable_prefill_done",
]
