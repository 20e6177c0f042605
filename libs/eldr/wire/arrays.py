"""Arrays on the wire: dense `NdArray` and sparse `SparseCounts`.

Arrays travel as raw little-endian bytes with a dtype name and a shape, never as
MessagePack lists (packing a 48 x 128 count matrix through Python lists is two orders of
magnitude slower and about twice the size). Both types check on construction and on
decode that the byte length matches dtype and shape, so `to_numpy` cannot fail later.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import msgspec
import numpy as np

from eldr.wire.base import (
    MAX_EXPERTS,
    MAX_MOE_LAYERS,
    MAX_NDARRAY_DIMS,
    MAX_NDARRAY_ELEMENTS,
    MAX_SPARSE_CELLS,
    WireError,
    require,
)

DTypeName = Literal["uint8", "uint16", "uint32", "int16", "int32", "int64", "float32", "float64"]
"""Dtypes allowed on the wire; always little-endian, whatever the host."""

_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name).newbyteorder("<")
    for name in ("uint8", "uint16", "uint32", "int16", "int32", "int64", "float32", "float64")
}

CountDTypeName = Literal["uint16", "uint32"]
_INDEX_DTYPE = np.dtype("<u4")

Dim = Annotated[int, msgspec.Meta(ge=0, le=MAX_NDARRAY_ELEMENTS)]


class NdArray(msgspec.Struct, frozen=True):
    """A dense array: `data` holds prod(shape) elements of `dtype`, little-endian, C order."""

    dtype: DTypeName
    shape: Annotated[list[Dim], msgspec.Meta(max_length=MAX_NDARRAY_DIMS)]
    data: bytes

    def __post_init__(self) -> None:
        require(self.dtype in _DTYPES, f"NdArray dtype {self.dtype!r} is not allowed")
        require(len(self.shape) <= MAX_NDARRAY_DIMS, f"NdArray has {len(self.shape)} dims")
        require(all(d >= 0 for d in self.shape), f"NdArray shape {self.shape} has a negative dim")
        n_elements = math.prod(self.shape)
        require(
            n_elements <= MAX_NDARRAY_ELEMENTS,
            f"NdArray has {n_elements} elements, more than {MAX_NDARRAY_ELEMENTS}",
        )
        expected = n_elements * _DTYPES[self.dtype].itemsize
        require(
            len(self.data) == expected,
            f"NdArray {self.dtype} {self.shape} needs {expected} bytes, got {len(self.data)}",
        )

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> NdArray:
        """Copy `array` into a wire array (converting to little-endian where needed)."""
        name = array.dtype.name
        if name not in _DTYPES:
            raise WireError(f"dtype {array.dtype} cannot go on the wire (allowed: {list(_DTYPES)})")
        wire = np.ascontiguousarray(array, dtype=_DTYPES[name])
        return cls(dtype=name, shape=[int(d) for d in wire.shape], data=wire.tobytes())  # type: ignore[arg-type]

    def to_numpy(self) -> np.ndarray:
        """A read-only view on `data` with the native dtype's name and `shape`."""
        return np.frombuffer(self.data, dtype=_DTYPES[self.dtype]).reshape(self.shape)


class SparseCounts(msgspec.Struct, frozen=True):
    """A sparse non-negative integer matrix shaped [L, E] (MoE layers x experts).

    `idx` holds the flat row-major indices `l * E + e` of the stored cells as uint32 LE,
    strictly ascending; `val` holds their counts as `val_dtype` LE, one per index.
    Cells not listed are zero.
    """

    shape: Annotated[list[int], msgspec.Meta(min_length=2, max_length=2)]
    idx: bytes
    val: bytes
    val_dtype: CountDTypeName = "uint16"

    def __post_init__(self) -> None:
        require(len(self.shape) == 2, f"SparseCounts shape must be [L, E], got {self.shape}")
        n_layers, n_experts = self.shape
        require(
            1 <= n_layers <= MAX_MOE_LAYERS and 1 <= n_experts <= MAX_EXPERTS,
            f"SparseCounts shape {self.shape} out of range",
        )
        n_cells = n_layers * n_experts
        require(n_cells <= MAX_SPARSE_CELLS, f"SparseCounts shape {self.shape} is too large")
        require(self.val_dtype in ("uint16", "uint32"), f"bad val_dtype {self.val_dtype!r}")
        require(len(self.idx) % 4 == 0, f"SparseCounts idx has {len(self.idx)} bytes, not 4*n")
        nnz = len(self.idx) // 4
        require(nnz <= n_cells, f"SparseCounts lists {nnz} cells of a {self.shape} matrix")
        val_size = _DTYPES[self.val_dtype].itemsize
        require(
            len(self.val) == nnz * val_size,
            f"SparseCounts has {nnz} indices but {len(self.val)} value bytes ({self.val_dtype})",
        )
        if nnz:
            idx = np.frombuffer(self.idx, dtype=_INDEX_DTYPE)
            require(int(idx[-1]) < n_cells, f"SparseCounts index {int(idx[-1])} >= {n_cells}")
            require(
                nnz == 1 or bool(np.all(idx[1:] > idx[:-1])),
                "SparseCounts indices must be strictly ascending",
            )

    @property
    def nnz(self) -> int:
        return len(self.idx) // 4

    @classmethod
    def from_dense(cls, counts: np.ndarray) -> SparseCounts:
        """Encode the non-zero cells of a non-negative integer matrix [L, E]."""
        if counts.ndim != 2:
            raise WireError(f"SparseCounts.from_dense needs a 2-D array, got shape {counts.shape}")
        if counts.dtype.kind not in "iu":
            raise WireError(f"SparseCounts.from_dense needs integers, got {counts.dtype}")
        flat = counts.reshape(-1)
        idx = np.flatnonzero(flat)
        vals = flat[idx]
        if vals.size and int(vals.min()) < 0:
            raise WireError("SparseCounts cannot hold negative counts")
        top = int(vals.max()) if vals.size else 0
        if top > np.iinfo(np.uint32).max:
            raise WireError(f"count {top} does not fit in uint32")
        val_dtype: CountDTypeName = "uint16" if top <= np.iinfo(np.uint16).max else "uint32"
        return cls(
            shape=[int(counts.shape[0]), int(counts.shape[1])],
            idx=idx.astype(_INDEX_DTYPE).tobytes(),
            val=vals.astype(_DTYPES[val_dtype]).tobytes(),
            val_dtype=val_dtype,
        )

    def indices(self) -> np.ndarray:
        """The flat indices (uint32, read-only view)."""
        return np.frombuffer(self.idx, dtype=_INDEX_DTYPE)

    def values(self) -> np.ndarray:
        """The counts (uint16 or uint32, read-only view)."""
        return np.frombuffer(self.val, dtype=_DTYPES[self.val_dtype])

    def to_dense(self, dtype: np.dtype | type = np.uint32) -> np.ndarray:
        """The full [L, E] matrix as a new array of `dtype`."""
        n_layers, n_experts = self.shape
        out = np.zeros(n_layers * n_experts, dtype=dtype)
        out[self.indices()] = self.values()
        return out.reshape(n_layers, n_experts)

    def add_to(self, out: np.ndarray) -> None:
        """Add these counts into `out` ([L, E], any numeric dtype) in place."""
        if list(out.shape) != list(self.shape):
            raise WireError(f"cannot add SparseCounts {self.shape} into an array {out.shape}")
        if not out.flags.c_contiguous:
            # reshape(-1) would copy and the addition would be lost
            raise WireError("SparseCounts.add_to needs a C-contiguous array")
        # indices are unique (strictly ascending), so fancy-index += is exact
        out.reshape(-1)[self.indices()] += self.values()
