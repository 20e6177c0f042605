"""Request traces: which experts each prefill and decode token routed to.

A trace is model-geometry agnostic: the number of MoE layers, experts per layer and
top-k are read from the data (`ModelGeometry`). Expert ids are stored as dense int16
arrays shaped [tokens, moe_layers, top_k] so that per-step set operations stay in numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

EXPERT_ID_DTYPE = np.int16


@dataclass(frozen=True)
class ModelGeometry:
    """Shape of a model's expert routing.

    `moe_layers` are the model's layer ids that have routed experts (ascending); a
    signature or count matrix has one row per MoE layer, in that order.
    """

    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int

    def __post_init__(self) -> None:
        if self.num_layers <= 0:
            raise ValueError(f"num_layers must be positive, got {self.num_layers}")
        if not self.moe_layers:
            raise ValueError("a model needs at least one MoE layer")
        if list(self.moe_layers) != sorted(set(self.moe_layers)):
            raise ValueError(f"moe_layers must be strictly ascending: {self.moe_layers}")
        if self.moe_layers[0] < 0 or self.moe_layers[-1] >= self.num_layers:
            raise ValueError(f"moe_layers {self.moe_layers} out of range [0, {self.num_layers})")
        if self.num_experts <= 0 or self.num_experts > np.iinfo(EXPERT_ID_DTYPE).max:
            raise ValueError(f"num_experts out of range: {self.num_experts}")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in [1, num_experts], got {self.top_k}")

    @classmethod
    def of_moe(cls, num_moe_layers: int, num_experts: int, top_k: int) -> ModelGeometry:
        """The geometry of a model known by its MoE layers only (a count matrix, a capture
        hook): every layer is a MoE layer."""
        return cls(num_moe_layers, tuple(range(num_moe_layers)), num_experts, top_k)

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def signature_dim(self) -> int:
        """Length of a flattened [moe_layers, experts] count vector."""
        return self.num_moe_layers * self.num_experts


@dataclass(frozen=True)
class RequestTrace:
    """Expert routing of one request.

    prefill: int16 [prompt_tokens, moe_layers, top_k]; decode: int16 [decode_tokens,
    moe_layers, top_k]. `token_ids` (uint32 [prompt_tokens]) are the prompt's token ids
    when known; traces without them get deterministic stand-ins (see
    `eldr.core.signature.blocks.stand_in_token_ids`) so that block hashing still works.
    """

    request_id: str
    label: str
    prefill: np.ndarray
    decode: np.ndarray
    token_ids: np.ndarray | None = field(default=None, compare=False)

    @property
    def prompt_tokens(self) -> int:
        return int(self.prefill.shape[0])

    @property
    def decode_tokens(self) -> int:
        return int(self.decode.shape[0])


@dataclass(frozen=True)
class TraceSet:
    """A set of request traces sharing one model geometry.

    `synthetic` is True when the traces came from the workload generator rather than a
    real model; every report derived from a TraceSet must say so.
    """

    geometry: ModelGeometry
    traces: tuple[RequestTrace, ...]
    source: str
    synthetic: bool

    def __len__(self) -> int:
        return len(self.traces)

    @property
    def labels(self) -> list[str]:
        return sorted({t.label for t in self.traces})

    def subset(self, indices: Sequence[int]) -> TraceSet:
        return TraceSet(
            geometry=self.geometry,
            traces=tuple(self.traces[i] for i in indices),
            source=self.source,
            synthetic=self.synthetic,
        )


def expert_counts(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """Count routed tokens per (MoE layer, expert).

    ids: integer array [tokens, moe_layers, top_k]; returns int32 [moe_layers, num_experts]
    where entry (l, e) is how many (token, slot) pairs at layer l routed to expert e.
    """
    if ids.ndim != 3:
        raise ValueError(f"expected ids shaped [tokens, layers, top_k], got {ids.shape}")
    n_layers = ids.shape[1]
    if ids.shape[0] == 0:
        return np.zeros((n_layers, num_experts), dtype=np.int32)
    flat = ids.astype(np.int64) + (np.arange(n_layers, dtype=np.int64) * num_experts)[None, :, None]
    counts = np.bincount(flat.ravel(), minlength=n_layers * num_experts)
    return counts.reshape(n_layers, num_experts).astype(np.int32)


def counts_matrix(
    traces: Sequence[RequestTrace], geometry: ModelGeometry, phase: str = "prefill"
) -> np.ndarray:
    """Stack per-request count matrices: float32 [requests, moe_layers * experts]."""
    if phase not in ("prefill", "decode"):
        raise ValueError(f"phase must be 'prefill' or 'decode', got {phase!r}")
    out = np.zeros((len(traces), geometry.signature_dim), dtype=np.float32)
    for i, t in enumerate(traces):
        ids = t.prefill if phase == "prefill" else t.decode
        out[i] = expert_counts(ids, geometry.num_experts).ravel()
    return out
