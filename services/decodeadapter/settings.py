"""Settings of the decode adapter (`ELDR_*` environment variables)."""

from __future__ import annotations

from pydantic import Field

from eldr.settings import CommonSettings


class DecodeAdapterSettings(CommonSettings):
    adapter_worker_id: str = Field(
        default="decode-0",
        pattern=r"^[A-Za-z0-9_-]{1,128}$",
        description="The decode worker id this instance is known by (decisions name it; the "
        "gateway maps it to the instance's URL).",
    )
    adapter_url: str = Field(
        default="http://127.0.0.1:8200",
        pattern=r"^https?://[^/\s]+$",
        description="Base URL of the vLLM decode instance (its /metrics is scraped).",
    )
    adapter_interval_s: float = Field(
        default=0.5,
        gt=0,
        description="Scrape and report period; keep it well under the routers' stale_after_s.",
    )
    adapter_scrape_timeout_s: float = Field(
        default=2.0, gt=0, description="Bound on one /metrics request."
    )
    adapter_pending_ttl_s: float = Field(
        default=60.0,
        gt=0,
        description="A decided request not seen arriving within this is forgotten.",
    )
