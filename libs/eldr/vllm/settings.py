"""Settings of the capture plugin, read from `ELDR_*` variables of the vLLM process."""

from __future__ import annotations

import re
import socket
from pathlib import Path

from pydantic import Field

from eldr.settings import BusSettings


def _default_worker_id() -> str:
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:40] or "host"
    return f"prefill-{host}"


class CaptureSettings(BusSettings):
    """The plugin loads in every vLLM process; it does nothing unless `vllm_capture` is on
    (set it on prefill instances only)."""

    vllm_capture: bool = Field(
        default=False,
        description="Hook the MoE routers of this vLLM instance and publish block "
        "summaries and prefill-done events (ELDR_VLLM_CAPTURE=1 on prefill instances).",
    )
    vllm_worker_id: str = Field(
        default_factory=_default_worker_id,
        pattern=r"^[A-Za-z0-9_-]{1,128}$",
        description="This prefill worker's id (the last token of its subjects).",
    )
    vllm_model: str | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        description="Model name the signature cache is keyed by; default: vLLM's served "
        "model name. Must be the same on every prefill instance of a model.",
    )
    vllm_block_size: int | None = Field(
        default=None,
        ge=1,
        le=1 << 16,
        description="Tokens per summarised block; default: vLLM's KV block size. Keep it "
        "equal to (or a divisor of) the KV block size: prefix-cache hits then end on one "
        "of its boundaries.",
    )
    vllm_queue_steps: int = Field(
        default=1024,
        ge=1,
        description="Engine steps queued for publishing at most; beyond, steps are dropped "
        "(counted and logged), never waited for.",
    )
    vllm_dump_dir: Path | None = Field(
        default=None,
        description="Also write each request's captured expert ids to DIR/<request id>.npz "
        "(token_ids, first_row, expert_ids [tokens - first_row, L, k]); for debugging and "
        "tests, not for production.",
    )
