"""The signature cache: per-KV-block expert-count summaries keyed by block hash.

Prefill workers publish a summary for every full KV block they compute. A request's
signature counts are the sum of the summaries of its blocks (looked up by the chained block
hash) plus its trailing partial block (carried in the request itself), so blocks served from
a prefix cache, whose tokens were never routed in this request, still count exactly.

Blocks arrive sparse (flat uint32 indices into [moe_layers * experts], uint16 counts). Each
is stored in whichever form is smaller: sparse (6 bytes per non-zero cell), or dense uint8
(1 byte per cell, when every count fits). A top-8 model's block touches about half its
cells (48 x 128 cells, about 3,100 non-zero for a 16-token block), where dense is a third
of the size and ten times faster to sum; a top-1 model's block is sparse. The cache is
bounded by bytes with least-recently-used eviction. Keys include the model name: the same
tokens through two models are two different blocks.

Who wrote what (cache poisoning): a block's summary is a function of its tokens, so every
honest writer (prefill worker) sends the same one. Each entry remembers its writer. A
later writer whose summary differs does not overwrite the first (nor does the first
pre-empt it): its own summary is kept beside, under (model, hash, writer), and an assembly
for a request of that writer uses it (`assemble(..., writer=)`). A prefix-cache hit is,
in the common case, a block the same prefill worker computed and published itself, so
one worker's claim shapes only its own requests' signatures, which it reports directly
anyway (`PrefillDone.computed`). Other readers (a block hit on an instance that never
computed it, through a shared KV connector) get the first summary, unless a writer marked
trusted disagreed: a trusted writer's summary replaces an untrusted first one (which
stays its writer's own).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from eldr.core.signature.sparse import SparseRow

ENTRY_OVERHEAD_BYTES = 160
"""Per-entry bookkeeping (key tuple, dict slot, small array headers), roughly, so that the
byte budget bounds real memory rather than payload alone."""

_U8_MAX = int(np.iinfo(np.uint8).max)


@dataclass(frozen=True)
class _Entry:
    """A cached block: exactly one of `sparse` and `dense` (uint8 [dim]) is set."""

    shape: tuple[int, int]
    nbytes: int
    sparse: SparseRow | None = None
    dense: np.ndarray | None = None
    writer: str = ""
    """Who published it (the batch's worker id; "" when unknown)."""
    trusted: bool = False
    """Whether its writer is one of the trusted writers."""

    @classmethod
    def of(cls, block: SparseRow, writer: str = "", trusted: bool = False) -> _Entry:
        dense_nbytes = block.dim + ENTRY_OVERHEAD_BYTES
        sparse_nbytes = block.nbytes + ENTRY_OVERHEAD_BYTES
        fits_u8 = block.val.size == 0 or int(block.val.max()) <= _U8_MAX
        if fits_u8 and dense_nbytes < sparse_nbytes:
            dense = np.zeros(block.dim, dtype=np.uint8)
            dense[block.idx] = block.val
            return cls(
                shape=block.shape,
                nbytes=dense_nbytes,
                dense=dense,
                writer=writer,
                trusted=trusted,
            )
        return cls(
            shape=block.shape, nbytes=sparse_nbytes, sparse=block, writer=writer, trusted=trusted
        )

    @property
    def dim(self) -> int:
        return self.shape[0] * self.shape[1]

    def same_counts(self, block: SparseRow) -> bool:
        """Whether `block` holds the same counts as this entry."""
        if block.dim != self.dim:
            return False
        mine = self.to_sparse()
        return bool(
            np.array_equal(mine.idx, block.idx)
            and np.array_equal(mine.val.astype(np.uint32), block.val.astype(np.uint32))
        )

    def to_sparse(self) -> SparseRow:
        if self.sparse is not None:
            return self.sparse
        assert self.dense is not None
        idx = np.flatnonzero(self.dense).astype(np.uint32)
        return SparseRow(self.shape, idx, self.dense[idx].astype(np.uint16))

    def add_to(self, counts: np.ndarray) -> None:
        if self.dense is not None:
            counts += self.dense
        elif self.sparse is not None:
            self.sparse.add_to(counts)


def stored_nbytes(block: SparseRow) -> int:
    """Bytes `block` takes in the cache (the smaller of its sparse and dense forms)."""
    return _Entry.of(block).nbytes


@dataclass(frozen=True)
class Assembly:
    """A request's counts assembled from the cache.

    counts: uint32 [moe_layers * experts]; found: how many of the requested block hashes
    were in the cache; missing: the hashes that were not, in request order (never guessed
    at: their tokens simply do not count, and callers decide whether that is good enough).
    """

    counts: np.ndarray
    found: int
    missing: tuple[int, ...]

    @property
    def complete(self) -> bool:
        return not self.missing


PutOutcome = Literal["new", "known", "conflict", "trusted", "too_large"]
"""What `BlockCache.put_from` did: cached a new block; found the same summary there;
kept a different summary as its writer's own (a conflict); let a trusted writer's summary
replace an untrusted one; refused a block larger than the whole budget."""

CacheKey = tuple[str, int] | tuple[str, int, str]
"""(model, hash): the block's summary for everyone; (model, hash, writer): a writer's own
summary that differs from it."""


class BlockCache:
    """LRU cache of block summaries bounded by `max_bytes` (`stored_nbytes` summed)."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[CacheKey, _Entry] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.conflicts = 0
        """Summaries that differed from the one cached for their block (cumulative)."""
        self.own_entries = 0
        """Writers' own summaries held beside the shared one (now)."""

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: tuple[str, int]) -> bool:
        """Membership without touching recency or the hit/miss counters."""
        return key in self._entries

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def put(self, model: str, block_hash: int, block: SparseRow) -> bool:
        """Insert (or refresh) a block of an unnamed writer; True when it was not cached
        before (`put_from` says more)."""
        return self.put_from(model, block_hash, block) == "new"

    def put_from(
        self,
        model: str,
        block_hash: int,
        block: SparseRow,
        *,
        writer: str = "",
        trusted: bool = False,
    ) -> PutOutcome:
        """Cache `writer`'s summary of a block (see the module docstring for who wins).

        The same summary again only refreshes recency. A block larger than the whole
        budget is not cached.
        """
        key: CacheKey = (model, block_hash)
        primary = self._entries.get(key)
        if primary is None:
            return "new" if self._insert(key, _Entry.of(block, writer, trusted)) else "too_large"
        if primary.same_counts(block):
            self._entries.move_to_end(key)
            return "known"
        own: CacheKey = (model, block_hash, writer)
        mine = self._entries.get(own)
        if mine is not None and mine.same_counts(block):
            self._entries.move_to_end(own)
            return "known"
        self.conflicts += 1
        if trusted and not primary.trusted:
            # The trusted writer's summary is everyone's; the earlier claim stays its own.
            if not self._insert(key, _Entry.of(block, writer, trusted)):
                return "too_large"
            if primary.writer:
                self._insert((model, block_hash, primary.writer), primary)
            return "trusted"
        return "conflict" if self._insert(own, _Entry.of(block, writer, trusted)) else "too_large"

    def _insert(self, key: CacheKey, entry: _Entry) -> bool:
        if entry.nbytes > self.max_bytes:
            return False
        old = self._entries.pop(key, None)
        if old is not None:
            self._forget(key, old)
        # Evict before inserting so that the budget holds at every instant.
        while self._bytes + entry.nbytes > self.max_bytes:
            evicted_key, evicted = self._entries.popitem(last=False)
            self._forget(evicted_key, evicted)
            self.evictions += 1
        self._entries[key] = entry
        self._bytes += entry.nbytes
        if len(key) == 3:
            self.own_entries += 1
        return True

    def _forget(self, key: CacheKey, entry: _Entry) -> None:
        self._bytes -= entry.nbytes
        if len(key) == 3:
            self.own_entries -= 1

    def get(self, model: str, block_hash: int, writer: str | None = None) -> SparseRow | None:
        """The block (`writer`'s own summary when it has one), refreshed as most recently
        used; None (a miss) if absent."""
        key = self._key_for(model, block_hash, writer)
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry.to_sparse()

    def _key_for(self, model: str, block_hash: int, writer: str | None) -> CacheKey:
        """The key of the summary `writer` reads: its own when it has one."""
        if writer and self.own_entries:
            own: CacheKey = (model, block_hash, writer)
            if own in self._entries:
                return own
        return (model, block_hash)

    def assemble(
        self,
        model: str,
        block_hashes: Sequence[int],
        dim: int,
        partial: SparseRow | None = None,
        *,
        writer: str | None = None,
    ) -> Assembly:
        """Sum the cached blocks of a request and its trailing partial block; `writer`
        (the request's prefill worker) reads its own summaries where they differ.

        dim: moe_layers * experts of the model. Raises ValueError, before counting any hit
        or miss, when the partial block or a cached block was encoded for another
        dimension (a geometry mismatch).
        """
        if partial is not None and partial.dim != dim:
            raise ValueError(f"partial block has dimension {partial.dim}, expected {dim}")
        found: list[_Entry] = []
        missing: list[int] = []
        keys: list[CacheKey] = []
        for h in block_hashes:
            key = self._key_for(model, h, writer)
            entry = self._entries.get(key)
            if entry is None:
                missing.append(h)
            elif entry.dim != dim:
                raise ValueError(
                    f"cached block {h:#x} of {model!r} has dimension {entry.dim}, expected {dim}"
                )
            else:
                found.append(entry)
                keys.append(key)
        for key in keys:
            self._entries.move_to_end(key)
        self.hits += len(found)
        self.misses += len(missing)
        counts = np.zeros(dim, dtype=np.uint32)
        for entry in found:
            entry.add_to(counts)
        if partial is not None:
            partial.add_to(counts)
        return Assembly(counts=counts, found=len(found), missing=tuple(missing))
