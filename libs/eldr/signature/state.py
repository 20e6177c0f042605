"""What one signature replica knows: cached block summaries, model geometries, publisher
sequence numbers, and the assemblies waiting for blocks still in flight.

No I/O and no clock: the service feeds decoded `BlockSummaryBatch`es in stream order and
asks for `AssembleReply`s. Every replica replays the whole BLOCKS stream, so replicas that
have seen the same prefix of the stream hold the same geometries and (budget permitting)
the same blocks.
"""

from __future__ import annotations

import asyncio
import enum
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from eldr.core.limits import GeometryLimits
from eldr.core.signature.blockcache import BlockCache
from eldr.core.signature.blocks import block_top_k
from eldr.core.signature.sparse import SparseRow
from eldr.wire import AssembleReply, AssembleRequest, BlockSummaryBatch, NdArray, SparseCounts
from eldr.wire.base import MAX_MISSING_LISTED

Geometry = tuple[int, int]
"""(num_moe_layers, num_experts) of a model."""
BlockKey = tuple[str, int]
"""(model, block hash)."""

_U16_MAX = int(np.iinfo(np.uint16).max)
DEFAULT_MAX_PUBLISHERS = 4096
"""Publishers whose sequence numbers are remembered (least recently heard forgotten first)."""


class RejectReason(enum.StrEnum):
    """Why a well-formed batch was not cached (a metric label: keep the set fixed)."""

    GEOMETRY_MISMATCH = "geometry_mismatch"
    """Its (num_moe_layers, num_experts) differ from what earlier batches of the model said,
    or from the configuration (`GeometryLimits`: the model's configured geometry, the caps)."""
    COUNT_OVERFLOW = "count_overflow"
    """A block count does not fit uint16 (no real block holds more than 65,535 slots)."""
    INCONSISTENT = "inconsistent"
    """A block's counts no real block can have (`eldr.core.signature.blocks.block_top_k`: layer
    totals not n_tokens x top-k, a cell above n_tokens), or blocks of one batch implying
    different top-k."""
    TOO_MANY_MODELS = "too_many_models"
    """A new model beyond the configured number of models."""


class SeqEvent(enum.StrEnum):
    FIRST = "first"
    """First batch heard from this publisher (replay may start mid-history: no gap)."""
    NEXT = "next"
    GAP = "gap"
    """Batches were skipped (lost, expired or malformed)."""
    DUPLICATE = "duplicate"
    """A sequence number at or below the last one (a redelivery): harmless, put is idempotent."""
    RESTART = "restart"
    """Sequence 0 after a higher one: the publisher restarted."""


@dataclass(frozen=True)
class SeqCheck:
    event: SeqEvent
    missed: int = 0
    """Batches skipped, for GAP."""


class PublisherSeqs:
    """Last sequence number per publisher, bounded LRU."""

    def __init__(self, max_publishers: int = DEFAULT_MAX_PUBLISHERS) -> None:
        if max_publishers <= 0:
            raise ValueError(f"max_publishers must be positive, got {max_publishers}")
        self._max = max_publishers
        self._last: OrderedDict[str, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._last)

    def observe(self, publisher: str, seq: int) -> SeqCheck:
        last = self._last.get(publisher)
        if last is None:
            check = SeqCheck(SeqEvent.FIRST)
        elif seq == last + 1:
            check = SeqCheck(SeqEvent.NEXT)
        elif seq > last + 1:
            check = SeqCheck(SeqEvent.GAP, missed=seq - last - 1)
        elif seq == 0 and last > 0:
            check = SeqCheck(SeqEvent.RESTART)
        else:
            self._last.move_to_end(publisher)
            return SeqCheck(SeqEvent.DUPLICATE)  # keep the highest sequence seen
        self._last[publisher] = seq
        self._last.move_to_end(publisher)
        while len(self._last) > self._max:
            self._last.popitem(last=False)
        return check


class Waiter:
    """An assembly waiting for blocks: `done` is set when none of `remaining` is missing."""

    def __init__(self, keys: set[BlockKey]) -> None:
        self.remaining = keys
        self.done = asyncio.Event()
        if not keys:
            self.done.set()


class BlockWaiters:
    """Waiters indexed by the block they wait for; the block consumer wakes them."""

    def __init__(self) -> None:
        self._by_key: dict[BlockKey, set[Waiter]] = {}
        self._count = 0
        self.on_register: Callable[[Waiter], None] | None = None
        """Called with every new waiter (observability and tests)."""

    def __len__(self) -> int:
        """Waiters registered and not yet removed."""
        return self._count

    @property
    def keys_waited(self) -> int:
        return len(self._by_key)

    def register(self, keys: set[BlockKey]) -> Waiter:
        waiter = Waiter(set(keys))
        for key in waiter.remaining:
            self._by_key.setdefault(key, set()).add(waiter)
        self._count += 1
        if self.on_register is not None:
            self.on_register(waiter)
        return waiter

    def remove(self, waiter: Waiter) -> None:
        """Forget a waiter (woken or timed out). Call exactly once per `register`."""
        for key in waiter.remaining:
            waiting = self._by_key.get(key)
            if waiting is not None:
                waiting.discard(waiter)
                if not waiting:
                    del self._by_key[key]
        waiter.remaining.clear()
        self._count -= 1

    def arrived(self, key: BlockKey) -> None:
        for waiter in self._by_key.pop(key, ()):
            waiter.remaining.discard(key)
            if not waiter.remaining:
                waiter.done.set()


@dataclass(frozen=True)
class IngestResult:
    seq: SeqCheck
    rejected: RejectReason | None
    blocks: int
    """Blocks in the batch."""
    blocks_new: int
    """Blocks that were not cached before (0 when rejected)."""
    detail: str = ""
    """Why it was rejected, for the log."""
    blocks_conflicting: int = 0
    """Blocks whose summary differs from the one cached for everyone: kept as the
    writer's own (`eldr.core.signature.blockcache`)."""
    blocks_trusted: int = 0
    """Of those, blocks where this trusted writer's summary replaced an untrusted one."""


class Outcome(enum.StrEnum):
    """How an assembly went (a metric label)."""

    COMPLETE = "complete"
    """Every block found (including requests with no full block)."""
    PARTIAL = "partial"
    """Some blocks found, some missing."""
    EMPTY = "empty"
    """None of the request's blocks found."""
    ERROR = "error"
    """No counts: unknown geometry, or a partial block shaped for another geometry."""


@dataclass(frozen=True)
class AssembleResult:
    reply: AssembleReply
    outcome: Outcome
    missing: int
    """Exact number of blocks not found."""


def _cacheable(counts: SparseCounts) -> SparseRow | None:
    """The cache entry of a block's counts; None if a count overflows uint16."""
    n_layers, n_experts = counts.shape
    values = counts.values()
    if counts.val_dtype != "uint16":
        if values.size and int(values.max()) > _U16_MAX:
            return None
        values = values.astype(np.uint16)
    return SparseRow((n_layers, n_experts), counts.indices(), values)


class SignatureState:
    """Block cache plus what is needed to validate batches and answer assemblies."""

    def __init__(
        self,
        cache_max_bytes: int,
        *,
        max_models: int = 256,
        max_publishers: int = DEFAULT_MAX_PUBLISHERS,
        limits: GeometryLimits | None = None,
        trusted_writers: frozenset[str] = frozenset(),
    ) -> None:
        if max_models <= 0:
            raise ValueError(f"max_models must be positive, got {max_models}")
        self.cache = BlockCache(cache_max_bytes)
        self.limits = limits or GeometryLimits()
        self.trusted_writers = trusted_writers
        """Writers whose summary wins over an untrusted first one (a conflict)."""
        self.geometries: dict[str, Geometry] = {}
        self.max_models = max_models
        self.seqs = PublisherSeqs(max_publishers)
        self.waiters = BlockWaiters()

    def ingest(self, batch: BlockSummaryBatch) -> IngestResult:
        """Validate a batch against the model's geometry and cache its blocks.

        The first accepted batch of a model fixes its geometry; since every replica sees
        the stream in the same order, every replica fixes the same one.
        """
        seq = self.seqs.observe(batch.worker_id, batch.seq)
        n_blocks = len(batch.blocks)
        geometry = (batch.num_moe_layers, batch.num_experts)
        known = self.geometries.get(batch.model)
        problem = self.limits.problem(batch.model, *geometry)
        if problem is not None:
            return IngestResult(seq, RejectReason.GEOMETRY_MISMATCH, n_blocks, 0, problem)
        if known is not None and known != geometry:
            return IngestResult(
                seq,
                RejectReason.GEOMETRY_MISMATCH,
                n_blocks,
                0,
                f"model {batch.model!r} has geometry {list(known)}, batch says {list(geometry)}",
            )
        if known is None and len(self.geometries) >= self.max_models:
            return IngestResult(
                seq,
                RejectReason.TOO_MANY_MODELS,
                n_blocks,
                0,
                f"already {len(self.geometries)} models; {batch.model!r} would be one more",
            )
        entries: list[tuple[int, SparseRow]] = []
        top_k: int | None = None  # one model, one top-k: every block of the batch agrees
        for i, block in enumerate(batch.blocks):
            entry = _cacheable(block.counts)
            if entry is None:
                return IngestResult(
                    seq,
                    RejectReason.COUNT_OVERFLOW,
                    n_blocks,
                    0,
                    f"blocks[{i}] has a count above {_U16_MAX}",
                )
            implied, why = block_top_k(entry.idx, entry.val, *geometry, block.n_tokens)
            if implied is None or (top_k is not None and implied != top_k):
                detail = why or f"top-{implied}, the batch's first block is top-{top_k}"
                return IngestResult(
                    seq, RejectReason.INCONSISTENT, n_blocks, 0, f"blocks[{i}]: {detail}"
                )
            top_k = implied
            entries.append((block.block_hash, entry))
        if known is None:
            self.geometries[batch.model] = geometry
        outcomes: Counter[str] = Counter()
        trusted = batch.worker_id in self.trusted_writers
        for block_hash, entry in entries:
            outcome = self.cache.put_from(
                batch.model, block_hash, entry, writer=batch.worker_id, trusted=trusted
            )
            outcomes[outcome] += 1
            self.waiters.arrived((batch.model, block_hash))
        return IngestResult(
            seq,
            None,
            n_blocks,
            outcomes["new"],
            blocks_conflicting=outcomes["conflict"] + outcomes["trusted"],
            blocks_trusted=outcomes["trusted"],
        )

    def missing_keys(self, model: str, block_hashes: Sequence[int]) -> set[BlockKey]:
        """The request's blocks not cached now (no effect on recency or hit counters)."""
        return {(model, h) for h in block_hashes if (model, h) not in self.cache}

    def assemble(self, request: AssembleRequest) -> AssembleResult:
        """Sum the cached blocks and the partial block into uint32 [L, E] counts.

        L and E come from the model's known geometry, else from the partial block; with
        neither the reply has no counts and says why. Missing blocks are reported, never
        guessed.
        """
        hashes = request.block_hashes
        geometry = self.geometries.get(request.model)
        partial = request.partial
        error: str | None = None
        if partial is not None:
            partial_geometry = (partial.shape[0], partial.shape[1])
            if geometry is None:
                error = self.limits.problem(request.model, *partial_geometry)
                geometry = partial_geometry
            elif geometry != partial_geometry:
                error = (
                    f"partial block shaped {list(partial_geometry)} but model "
                    f"{request.model!r} has geometry {list(geometry)}"
                )
        elif geometry is None:
            error = (
                f"geometry of model {request.model!r} unknown: no block of it is cached and "
                "the request has no partial block"
            )
        if error is not None or geometry is None:
            reply = AssembleReply(
                request_id=request.request_id,
                counts=None,
                blocks_total=len(hashes),
                blocks_found=0,
                missing=list(hashes[:MAX_MISSING_LISTED]),
                error=error,
            )
            return AssembleResult(reply, Outcome.ERROR, len(hashes))
        n_layers, n_experts = geometry
        partial_block = None
        if partial is not None:
            partial_block = SparseRow((n_layers, n_experts), partial.indices(), partial.values())
        assembly = self.cache.assemble(
            request.model,
            hashes,
            n_layers * n_experts,
            partial_block,
            writer=request.prefill_worker,
        )
        n_missing = len(assembly.missing)
        if n_missing == 0:
            outcome = Outcome.COMPLETE
        elif assembly.found == 0:
            outcome = Outcome.EMPTY
        else:
            outcome = Outcome.PARTIAL
        reply = AssembleReply(
            request_id=request.request_id,
            counts=NdArray.from_numpy(assembly.counts.reshape(n_layers, n_experts)),
            blocks_total=len(hashes),
            blocks_found=assembly.found,
            missing=list(assembly.missing[:MAX_MISSING_LISTED]),
        )
        return AssembleResult(reply, outcome, n_missing)
