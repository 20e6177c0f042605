"""The signature cache: per-KV-block expert-count summaries keyed by block hash.

Prefill workers publish a summary for every full KV block they compute. A request's
signature counts are the sum of the summaries of its blocks (looked up by the chained block
hash) plus its trailing partial block (carried in the request itself), so blocks served from
a prefix cache, whose tokens were never routed in this request, still count exactly.

Entries are sparse (flat uint32 indices into [moe_layers * experts], uint16 counts) and the
cache is bounded by bytes with least-recently-used eviction. Keys include the model name:
the same tokens through two models are two different blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

ENTRY_OVERHEAD_BYTES = 160
"""Per-entry bookkeeping (key tuple, dict slot, two small array headers), roughly, so that the
byte budget bounds real memory rather than payload alone."""


@dataclass(frozen=True)
class SparseBlock:
    """One block's counts: flat indices (uint32, sorted, unique) and values (uint16)."""

    idx: np.ndarray
    val: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.idx.nbytes + self.val.nbytes) + ENTRY_OVERHEAD_BYTES


@dataclass(frozen=True)
class Assembly:
    """A request's counts assembled from the cache.

    counts: uint32 [moe_layers * experts]; found: how many of the requested block hashes
    were in the cache; missing: the hashes that were not (never guessed at: their tokens
    simply do not count, and callers decide whether that is good enough).
    """

    counts: np.ndarray
    found: int
    missing: tuple[int, ...]

    @property
    def complete(self) -> bool:
        return not self.missing


class BlockCache:
    """LRU cache of block summaries bounded by `max_bytes`."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[str, int], SparseBlock] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: tuple[str, int]) -> bool:
        return key in self._entries

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def put(self, model: str, block_hash: int, block: SparseBlock) -> bool:
        """Insert (or refresh) a block; returns True when it was not cached before.

        A block's summary is a function of its tokens (causal routing), so a second
        summary under the same hash only refreshes recency.
        """
        key = (model, block_hash)
        if key in self._entries:
            self._entries.move_to_end(key)
            return False
        size = block.nbytes
        if size > self.max_bytes:
            return False
        self._entries[key] = block
        self._bytes += size
        while self._bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.nbytes
            self.evictions += 1
        return True

    def get(self, model: str, block_hash: int) -> SparseBlock | None:
        key = (model, block_hash)
        block = self._entries.get(key)
        if block is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return block

    def assemble(
        self,
        model: str,
        block_hashes: Sequence[int],
        dim: int,
        partial: SparseBlock | None = None,
    ) -> Assembly:
        """Sum the cached blocks of a request and its trailing partial block.

        dim: moe_layers * experts of the model. Raises ValueError when a cached block or
        the partial block has an index outside [0, dim) (a geometry mismatch).
        """
        counts = np.zeros(dim, dtype=np.uint32)
        missing: list[int] = []
        found = 0
        for h in block_hashes:
            block = self.get(model, h)
            if block is None:
                missing.append(h)
                continue
            _accumulate(counts, block, dim)
            found += 1
        if partial is not None:
            _accumulate(counts, partial, dim)
        return Assembly(counts=counts, found=found, missing=tuple(missing))


def _accumulate(counts: np.ndarray, block: SparseBlock, dim: int) -> None:
    if block.idx.size == 0:
        return
    if int(block.idx.max()) >= dim:
        raise ValueError(f"block index {int(block.idx.max())} outside signature dimension {dim}")
    np.add.at(counts, block.idx.astype(np.intp), block.val.astype(np.uint32))
