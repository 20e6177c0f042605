"""Settings of the gateway (`ELDR_*` environment variables)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator

from eldr.settings import BlockHashSettings, CommonSettings
from eldr.vllm.pd import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_PROMPT_BYTES,
    DEFAULT_MAX_PROMPT_TOKENS,
    parse_instances,
)


class GatewaySettings(CommonSettings, BlockHashSettings):
    gateway_host: str = Field(default="0.0.0.0", description="Address the OpenAI API binds.")
    gateway_port: int = Field(
        default=8000,
        ge=0,
        le=65535,
        description="Port of the OpenAI API (and vLLM's /health; /healthz, /readyz and "
        "/metrics are on metrics_port, as for every service); 0 picks a free one.",
    )
    gateway_prefill: str = Field(
        default="prefill-0=http://127.0.0.1:8100",
        description="Prefill vLLM instances, `id=url` comma-separated; the id is the "
        "instance's ELDR_VLLM_WORKER_ID.",
    )
    gateway_decode: str = Field(
        default="decode-0=http://127.0.0.1:8200",
        description="Decode vLLM instances, `id=url` comma-separated; the id is the worker "
        "id its decode adapter reports load under (what decisions name).",
    )
    gateway_decision_timeout_s: float = Field(
        default=0.25,
        gt=0,
        description="How long to wait for the routing decision after the prefill answered; "
        "then read the DECISIONS stream, then fall back to the least-loaded decoder. "
        "Decisions take a few ms (docs/BENCHMARKS.md); every request whose decision is lost "
        "waits this long.",
    )
    gateway_capture_grace_s: float = Field(
        default=10.0,
        ge=0,
        description="After the gateway starts, how long a prefill instance may be silent "
        "(no capture status) before its requests are routed load-only at once.",
    )
    gateway_upstream_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="Bound on an upstream answer that is not streamed, as a whole: the "
        "prefill, a non-streamed decode (vLLM sends nothing until it is done), /v1/models, "
        "/tokenize. A streamed decode has no total bound (a long healthy stream is never "
        "cut), only gateway_upstream_idle_timeout_s.",
    )
    gateway_upstream_idle_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description="Longest silence while reading a streamed decode (its first byte "
        "included); longer: the stream ends with an error event and the decode is aborted.",
    )
    gateway_api_keys: SecretStr | None = Field(
        default=None,
        description="Comma-separated keys the gateway accepts as `Authorization: Bearer "
        "<key>` on /v1/* (as vLLM's --api-key; 401 otherwise). Unset: no check.",
    )
    gateway_upstream_api_key: SecretStr | None = Field(
        default=None,
        description="Key the gateway sends to the vLLM instances (`Authorization: Bearer`), "
        "for instances started with --api-key. Unset: the client's Authorization header "
        "is forwarded to both legs as it came.",
    )
    gateway_connect_timeout_s: float = Field(
        default=5.0, gt=0, description="Bound on connecting to an upstream instance."
    )
    gateway_max_decode_attempts: int = Field(
        default=3,
        ge=1,
        description="Decode instances tried for one request when they fail before streaming.",
    )
    gateway_health_interval_s: float = Field(
        default=2.0, gt=0, description="Period of the upstream /health probes."
    )
    gateway_max_body_bytes: int = Field(
        default=DEFAULT_MAX_BODY_BYTES,
        ge=1024,
        description="Largest client request body; larger ones get 413 before they are read "
        "further (8 MiB: about a million token ids as JSON).",
    )
    gateway_max_prompt_bytes: int = Field(
        default=DEFAULT_MAX_PROMPT_BYTES,
        ge=1,
        description="Largest prompt ('prompt', or all 'messages') as JSON bytes; larger: 400. "
        "The model's context length is vLLM's to enforce; this bounds the gateway's work.",
    )
    gateway_max_prompt_tokens: int = Field(
        default=DEFAULT_MAX_PROMPT_TOKENS,
        ge=1,
        description="Most token ids a prompt given as token ids may have; more: 400.",
    )
    gateway_body_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="A client must send its whole body within this; slower: 408 (a client "
        "dribbling its body would otherwise hold a request slot forever).",
    )
    gateway_parse_inline_bytes: int = Field(
        default=256 << 10,
        ge=0,
        description="Bodies larger than this are parsed in a worker thread, off the event loop.",
    )
    gateway_drain_grace_s: float = Field(
        default=30.0,
        ge=0,
        description="On shutdown, how long requests in flight may finish.",
    )
    gateway_signature_source: Literal["plugin", "routed_experts"] = Field(
        default="plugin",
        description="Who publishes block summaries and PrefillDone: `plugin` (the capture "
        "plugin in the prefill engine) or `routed_experts` (this gateway, from the "
        "prefill's response; needs vLLM's --enable-return-routed-experts, GPU builds only).",
    )
    gateway_block_size: int = Field(
        default=32,
        ge=1,
        description="Block size of the summaries the gateway publishes itself "
        "(routed_experts source only).",
    )

    gateway_model_key: str | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        description="Model name the published block summaries are keyed by (routed_experts "
        "source only; the capture plugin's ELDR_VLLM_MODEL).",
    )
    gateway_num_moe_layers: int | None = Field(
        default=None, ge=1, description="MoE layers of the model (routed_experts source only)."
    )
    gateway_num_experts: int | None = Field(
        default=None, ge=1, description="Experts per MoE layer (routed_experts source only)."
    )
    gateway_top_k: int | None = Field(
        default=None, ge=1, description="Experts per token (routed_experts source only)."
    )
    gateway_model_config: Path | None = Field(
        default=None,
        description="The model's config.json (routed_experts source only): which hidden "
        "layers are MoE layers (dense ones are skipped), and the geometry when "
        "ELDR_GATEWAY_NUM_* are unset.",
    )
    gateway_moe_layer_ids: str | None = Field(
        default=None,
        description="MoE layer ids when no config.json says (routed_experts source only), "
        "e.g. `1-47:2` for MoE on the odd layers of 48; needs ELDR_GATEWAY_NUM_HIDDEN_LAYERS.",
    )
    gateway_num_hidden_layers: int | None = Field(
        default=None,
        ge=1,
        description="All hidden layers, dense included (routed_experts source with "
        "ELDR_GATEWAY_MOE_LAYER_IDS).",
    )

    @field_validator("gateway_prefill", "gateway_decode")
    @classmethod
    def _instances(cls, value: str) -> str:
        parse_instances(value, "instances")
        return value

    def api_keys(self) -> list[str]:
        """The keys clients may present (empty: no check)."""
        if self.gateway_api_keys is None:
            return []
        return [k.strip() for k in self.gateway_api_keys.get_secret_value().split(",") if k.strip()]

    def prefill_instances(self) -> dict[str, str]:
        return parse_instances(self.gateway_prefill, "gateway_prefill")

    def decode_instances(self) -> dict[str, str]:
        return parse_instances(self.gateway_decode, "gateway_decode")
