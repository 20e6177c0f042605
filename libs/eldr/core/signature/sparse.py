"""Expert counts held sparse: the core's one in-memory form of a count matrix
[MoE layers, experts], whether a cached block's summary (`eldr.core.signature.blockcache`)
or a request's prefill or decode counts in the training window
(`eldr.core.training.trainwindow`). `eldr.wire.SparseCounts` is its encoded form.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class SparseRow:
    """A [layers, experts] count matrix as flat row-major indices `l * E + e` and counts.

    idx: unsigned integers, strictly ascending, < layers * experts; val: one non-negative
    integer count per index (uint16 for cached blocks; uint32 where counts may be larger).
    Checked on construction, so the counts can always be added exactly (the indices are
    unique), and counts of another geometry are refused by their shape, not summed into the
    wrong cells. Compared by identity (numpy arrays have no single truth value).
    """

    shape: tuple[int, int]
    idx: np.ndarray
    val: np.ndarray

    def __post_init__(self) -> None:
        if len(self.shape) != 2 or self.shape[0] <= 0 or self.shape[1] <= 0:
            raise ValueError(f"shape must be positive [layers, experts], got {self.shape}")
        if self.idx.ndim != 1 or self.val.ndim != 1 or self.idx.shape != self.val.shape:
            raise ValueError(
                f"idx and val must be 1-D and equally long, got {self.idx.shape} and "
                f"{self.val.shape}"
            )
        if self.idx.size == 0:
            return
        if self.idx.dtype.kind != "u" or self.val.dtype.kind != "u":
            raise ValueError(
                f"idx and val must be unsigned integers, got {self.idx.dtype} and {self.val.dtype}"
            )
        if self.idx.size > 1 and not bool(np.all(self.idx[1:] > self.idx[:-1])):
            raise ValueError("indices must be strictly ascending")
        if int(self.idx[-1]) >= self.dim:
            raise ValueError(f"index {int(self.idx[-1])} outside a {self.shape} matrix")

    @property
    def dim(self) -> int:
        """Cells of the matrix: layers * experts."""
        return self.shape[0] * self.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes of the indices and counts."""
        return int(self.idx.nbytes + self.val.nbytes)

    @property
    def total(self) -> float:
        return float(self.val.sum(dtype=np.float64))

    @classmethod
    def from_dense(cls, counts: np.ndarray) -> SparseRow:
        """The non-zero cells of a [layers, experts] matrix of non-negative whole counts
        (any numeric dtype; unsigned counts keep theirs, others become uint32)."""
        arr = np.asarray(counts)
        if arr.ndim != 2:
            raise ValueError(f"counts must be [layers, experts], got {arr.shape}")
        flat = arr.reshape(-1)
        idx = np.flatnonzero(flat).astype(np.uint32)
        val = flat[idx]
        if val.dtype.kind != "u":
            whole = val.astype(np.uint32)
            if val.size and (float(val.min()) < 0 or not np.array_equal(whole, val)):
                raise ValueError("counts must be non-negative whole numbers")
            val = whole
        return cls((int(arr.shape[0]), int(arr.shape[1])), idx, val)

    def add_to(self, out: np.ndarray) -> None:
        """Add the counts into a flat row `out` of length layers * experts, in place."""
        # Unique in-range indices, so fancy-index += is exact (and an order of magnitude
        # faster than np.add.at).
        if self.idx.size:
            out[self.idx] += self.val
