"""Settings of the simulated prefill worker (`eldr serve simprefill`), from `ELDR_*` variables."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from eldr.core.signature.blocks import DEFAULT_BLOCK_SIZE
from eldr.settings import BlockHashSettings, CommonSettings


class SimPrefillSettings(CommonSettings, BlockHashSettings):
    """A traffic driver (`eldr.sim.traffic`) run continuously as a service."""

    simprefill_worker_id: str = Field(
        default="prefill-0",
        pattern=r"^[A-Za-z0-9_-]{1,128}$",
        description="Prefill worker id: the last token of its blocks / prefill.done subjects.",
    )
    simprefill_traces_dir: Path | None = Field(
        default=None,
        description="Directory of real traces (<label>/<n>.json); unset: a synthetic workload.",
    )
    simprefill_num_experts: int | None = Field(
        default=None,
        ge=1,
        le=32767,
        description="Experts per MoE layer of the traces (default: max id + 1 in the data).",
    )
    simprefill_synthetic_requests: int = Field(
        default=256, ge=1, description="Size of the synthetic request pool replayed."
    )
    simprefill_synthetic_topics: int = Field(default=4, ge=1, description="Synthetic topics.")
    # Defaults mirror Llama-4-Maverick's routing geometry (24 MoE layers, 128 experts,
    # top-1), the model of simdecode's default deployment, so the two agree out of the box.
    simprefill_synthetic_layers: int = Field(
        default=24, ge=1, description="MoE layers of the synthetic model."
    )
    simprefill_synthetic_experts: int = Field(
        default=128, ge=1, le=32767, description="Experts per layer of the synthetic model."
    )
    simprefill_synthetic_top_k: int = Field(
        default=1, ge=1, description="Experts per token of the synthetic model."
    )
    simprefill_seed: int = Field(
        default=0, ge=0, description="Seeds the workload, the trace choice and the arrivals."
    )
    simprefill_rate_per_s: float = Field(
        default=10.0,
        ge=0.0,
        description="Poisson request rate; 0 = as fast as the in-flight bound allows.",
    )
    simprefill_count: int = Field(
        default=0, ge=0, description="Requests to replay before idling; 0 = without end."
    )
    simprefill_round: int = Field(
        default=500, ge=1, description="Requests per replay round (a summary is logged each)."
    )
    simprefill_block_size: int = Field(
        default=DEFAULT_BLOCK_SIZE, ge=1, le=65536, description="Tokens per KV block."
    )
    simprefill_model: str = Field(
        default="sim", min_length=1, max_length=256, description="Model name on the wire."
    )
    simprefill_decision_timeout_s: float = Field(
        default=5.0,
        gt=0.0,
        description="Wait this long for a decision on the inbox before reading the stream.",
    )
    simprefill_job_timeout_s: float = Field(
        default=2.0, gt=0.0, description="Timeout of one DecodeJob request."
    )
    simprefill_send_jobs: bool = Field(
        default=True, description="Send decided requests to the simulated decode workers."
    )
    simprefill_max_in_flight: int = Field(
        default=1024, ge=1, description="Requests between PrefillDone and DecodeJob at most."
    )
    simprefill_local_signatures: bool = Field(
        default=True,
        description="Carry the whole signature in a PrefillDone whose cached blocks the "
        "simulated prefill worker summarised itself (as the capture plugin does); false: "
        "every prefix hit's blocks come from the signature service.",
    )
    simprefill_local_summary_blocks: int | None = Field(
        default=None,
        ge=0,
        description="Blocks the simulated prefill worker keeps its own summary of at most "
        "(least recently used evicted; a hit on an evicted one goes to the signature "
        "service); unset: every block it published.",
    )
