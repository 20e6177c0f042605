"""Settings of the signature service (environment variables `ELDR_*`, flat)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator
from pydantic_settings import NoDecode

from eldr.settings import CommonSettings, GeometrySettings
from eldr.wire.base import MAX_WAIT_MS


class SignatureSettings(CommonSettings, GeometrySettings):
    """Block-cache budget and assembly limits, on top of the settings every service has
    (and the model geometries it accepts, `GeometrySettings`)."""

    cache_max_bytes: int = Field(
        default=256 << 20,
        gt=0,
        description="Byte budget of the block-summary cache (LRU beyond it). A 16-token "
        "block's summary takes about 2 KB (24 MoE layers x 128 experts, top-1) to 6 KB "
        "(48 x 128, top-8), so 256 MiB holds some 40,000-120,000 blocks.",
    )
    max_wait_ms: int = Field(
        default=100,
        ge=0,
        le=MAX_WAIT_MS,
        description="Cap on AssembleRequest.wait_ms: an assembly waits at most this long for "
        "block summaries still in flight; requests asking more are capped. 0 never waits.",
    )
    max_models: int = Field(
        default=256,
        gt=0,
        description="Distinct models whose geometry is remembered; batches of further models "
        "are rejected (bounds memory against a misbehaving producer).",
    )
    trusted_block_writers: Annotated[tuple[str, ...], NoDecode] = Field(
        default=(),
        description="Prefill workers (or gateways publishing from routed experts) whose "
        "block summaries win over an untrusted writer's for everyone, comma-separated. "
        "Whatever this says, a writer's own summary is what its own requests assemble.",
    )
    assemble_max_concurrency: int = Field(
        default=256,
        gt=0,
        description="Assemble requests handled at once by one replica (each waiting request "
        "holds a slot); more queue in the NATS subscription.",
    )

    @field_validator("trusted_block_writers", mode="before")
    @classmethod
    def _split_writers(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(w.strip() for w in value.split(",") if w.strip())
        return value
