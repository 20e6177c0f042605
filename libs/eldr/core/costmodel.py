"""Decode-step cost model for MoE serving.

A decode step is memory-bound: every MoE layer streams the weights of each distinct expert
that any token of the batch routed to. The model here is

    step_s = overhead_s
             + (dense_bytes + expert_union_total * expert_bytes + kv_tokens * kv_bytes_per_token)
               / (gpus_per_worker * hbm_bytes_per_s * achievable_fraction)

where `expert_union_total` is the number of distinct (MoE layer, expert) pairs the batch
activates in this step. A *measured* deployment (written by `eldr bench-moe-step fit` from a
GPU microbenchmark) replaces the expert term's bytes over bandwidth by a measured time per
activated expert, `expert_union_total * expert_s`, and may add `batch_tokens * token_s`;
the dense and KV terms stay bytes over bandwidth. Every parameter, its value and its source
are listed in docs/COST_MODEL.md; the numbers live in `libs/eldr/data/deployments.toml`
(and `measured_deployments.toml`) and are read by `eldr.data.deployments`. This module is pure:
it knows nothing about files.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class GpuSpec:
    """Memory system of one accelerator."""

    name: str
    hbm_bytes_per_s: float
    achievable_fraction: float
    source: str = ""

    def __post_init__(self) -> None:
        if self.hbm_bytes_per_s <= 0:
            raise ValueError(f"{self.name}: hbm_bytes_per_s must be positive")
        if not 0 < self.achievable_fraction <= 1:
            raise ValueError(f"{self.name}: achievable_fraction must be in (0, 1]")

    @property
    def effective_bytes_per_s(self) -> float:
        return self.hbm_bytes_per_s * self.achievable_fraction


@dataclass(frozen=True)
class ModelSpec:
    """Bytes a decode step of one model streams, split into its parts.

    expert_params: parameters of one routed expert (all its weight matrices).
    dense_params: parameters read every step regardless of routing (attention projections,
    dense FFN layers, shared experts, routers, LM head).
    """

    name: str
    num_layers: int
    num_moe_layers: int
    num_experts: int
    top_k: int
    expert_params: float
    expert_bits_per_param: float
    dense_params: float
    dense_bits_per_param: float
    kv_bytes_per_token: float
    source: str = ""

    def __post_init__(self) -> None:
        for attr in ("num_layers", "num_moe_layers", "num_experts", "top_k"):
            if getattr(self, attr) <= 0:
                raise ValueError(f"{self.name}: {attr} must be positive")
        for attr in (
            "expert_params",
            "expert_bits_per_param",
            "dense_params",
            "dense_bits_per_param",
            "kv_bytes_per_token",
        ):
            if getattr(self, attr) < 0:
                raise ValueError(f"{self.name}: {attr} must be non-negative")

    @property
    def expert_bytes(self) -> float:
        return self.expert_params * self.expert_bits_per_param / 8.0

    @property
    def dense_bytes(self) -> float:
        return self.dense_params * self.dense_bits_per_param / 8.0


@dataclass(frozen=True)
class Deployment:
    """A model deployed on `gpus_per_worker` GPUs per decode worker (tensor parallel).

    With tensor parallelism every GPU holds a 1/gpus slice of every weight, so a step's
    bytes are spread evenly and the worker's bandwidth is the sum of its GPUs'.
    `overhead_s` is the per-step time that is not weight or KV streaming (scheduling,
    kernel launches, collectives, sampling); docs/COST_MODEL.md says where it comes from.

    Measured deployments only (None / 0 in every spec-derived deployment):
    `expert_s`: measured seconds per distinct (MoE layer, expert) pair of a step on this
    worker, in place of expert_bytes / worker_bytes_per_s; `token_s`: measured seconds per
    batch token per step, summed over the MoE layers; `provenance`: where the measurement
    comes from, as (key, value) pairs (GPU, driver, torch version, date, command, table).
    """

    name: str
    model: ModelSpec
    gpu: GpuSpec
    gpus_per_worker: int
    overhead_s: float
    description: str = ""
    expert_s: float | None = None
    token_s: float = 0.0
    provenance: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.gpus_per_worker <= 0:
            raise ValueError(f"{self.name}: gpus_per_worker must be positive")
        if self.overhead_s < 0:
            raise ValueError(f"{self.name}: overhead_s must be non-negative")
        if self.expert_s is not None and self.expert_s < 0:
            raise ValueError(f"{self.name}: expert_s must be non-negative")
        if self.token_s < 0:
            raise ValueError(f"{self.name}: token_s must be non-negative")

    @property
    def measured(self) -> bool:
        """Whether the expert term comes from a measurement instead of bytes / bandwidth."""
        return self.expert_s is not None

    @property
    def expert_time_s(self) -> float:
        """Seconds one distinct (MoE layer, expert) pair adds to a step."""
        if self.expert_s is not None:
            return self.expert_s
        return self.model.expert_bytes / self.worker_bytes_per_s

    @property
    def worker_bytes_per_s(self) -> float:
        return self.gpus_per_worker * self.gpu.effective_bytes_per_s

    def step_bytes(self, expert_union_total: float, kv_tokens: float) -> float:
        """Bytes streamed by one decode step."""
        return (
            self.model.dense_bytes
            + expert_union_total * self.model.expert_bytes
            + kv_tokens * self.model.kv_bytes_per_token
        )

    def step_time_s(
        self, expert_union_total: float, kv_tokens: float, batch_tokens: float = 0.0
    ) -> float:
        """Wall time of one decode step.

        expert_union_total: distinct (MoE layer, expert) pairs activated by the batch in
        this step, summed over MoE layers. kv_tokens: tokens in the batch's KV caches.
        batch_tokens: tokens decoded in this step (one per running request); only a
        measured deployment with a `token_s` term uses it.
        """
        if expert_union_total < 0 or kv_tokens < 0 or batch_tokens < 0:
            raise ValueError("expert_union_total, kv_tokens and batch_tokens must be non-negative")
        if self.expert_s is None:
            # The spec-derived formula, evaluated exactly as it always was.
            step_s = self.overhead_s + self.step_bytes(expert_union_total, kv_tokens) / (
                self.worker_bytes_per_s
            )
        else:
            streamed = self.model.dense_bytes + kv_tokens * self.model.kv_bytes_per_token
            step_s = (
                self.overhead_s
                + streamed / self.worker_bytes_per_s
                + expert_union_total * self.expert_s
            )
        if self.token_s:
            step_s += batch_tokens * self.token_s
        return step_s

    def with_overhead(self, overhead_s: float, name: str | None = None) -> Deployment:
        """The same deployment with another fixed per-step overhead (for what-if reports)."""
        return replace(
            self,
            name=name or f"{self.name}@overhead={overhead_s * 1e3:g}ms",
            overhead_s=overhead_s,
        )


def expected_uniform_union(num_experts: int, top_k: int, batch: int) -> float:
    """E[distinct experts per layer] for `batch` tokens routed uniformly at random.

    n * (1 - (1 - k/n)^B): the independent-uniform reference of REFERENCE.md section 2;
    real routing is skewed, so real unions are smaller.
    """
    if batch <= 0:
        return 0.0
    return float(num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch))
