"""Settings of the capture plugin, read from `ELDR_*` variables of the vLLM process."""

from __future__ import annotations

import re
import socket
from pathlib import Path
from typing import Literal

from pydantic import Field

from eldr.roles.prefill import DEFAULT_LOCAL_SUMMARY_BYTES
from eldr.settings import BlockHashSettings, BusSettings


def _default_worker_id() -> str:
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:40] or "host"
    return f"prefill-{host}"


class CaptureSettings(BusSettings, BlockHashSettings):
    """The plugin loads in every vLLM process; it does nothing unless `vllm_capture` is on
    (on prefill instances for signatures, on decode instances for decode summaries)."""

    vllm_capture: bool = Field(
        default=False,
        description="Hook the MoE routers of this vLLM instance (ELDR_VLLM_CAPTURE=1) and "
        "do what ELDR_VLLM_ROLE says.",
    )
    vllm_role: Literal["prefill", "decode", "both"] = Field(
        default="prefill",
        description="prefill: publish block summaries and PrefillDone for the prompts this "
        "instance computes; decode: publish a DecodeSummary for every request it decodes; "
        "both: an instance serving whole requests.",
    )
    vllm_worker_id: str = Field(
        default_factory=_default_worker_id,
        pattern=r"^[A-Za-z0-9_-]{1,128}$",
        description="This instance's ELDR worker id (the last token of its subjects): the "
        "prefill worker id, or on a decode instance the worker id decisions name.",
    )
    vllm_allow_untested: bool = Field(
        default=False,
        description="Capture on a vLLM outside the supported versions (0.32.x to 0.34.x; the "
        "row layout it reads is internal to vLLM). Without it, such an instance says "
        "'off' in its CaptureStatus, with the reason, and the pipeline routes it load-only "
        "(the engine serves either way).",
    )
    vllm_status_interval_s: float = Field(
        default=2.0,
        gt=0,
        le=60,
        description="Period of the CaptureStatus heartbeat (also sent on every change).",
    )
    vllm_max_decode_requests: int | None = Field(
        default=None,
        ge=1,
        description="Requests whose decode summary is counted at once (device memory: this "
        "x MoE layers x (experts + 1) x 4 bytes, twice with pinned host staging on GPUs); "
        "default twice vLLM's --max-num-seqs.",
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
    vllm_local_summary_bytes: int = Field(
        default=DEFAULT_LOCAL_SUMMARY_BYTES,
        ge=0,
        description="Byte budget of this prefill instance's own summaries of the blocks it "
        "computed (least recently used evicted): a prefix hit on blocks it holds sends the "
        "request's whole signature in its PrefillDone, and the router asks the signature "
        "service nothing; other hits (KV loaded from elsewhere, an evicted summary) are "
        "completed by the service. Default 64 MiB, a few tenths of a percent of the KV "
        "memory it covers (eldr.roles.prefill.DEFAULT_LOCAL_SUMMARY_BYTES); 0: off.",
    )
    vllm_dump_dir: Path | None = Field(
        default=None,
        description="Also write each request's captured expert ids to DIR/<request id>.npz "
        "(token_ids, first_row, expert_ids [tokens - first_row, L, k]); for debugging and "
        "tests, not for production.",
    )
