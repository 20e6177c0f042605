"""Settings of the routing service (`ELDR_*` environment variables)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from eldr.core.policies import POLICY_NAMES
from eldr.settings import CommonSettings


class RouterSettings(CommonSettings):
    policy: str = Field(
        default="eldr",
        description=f"Routing policy: one of {', '.join(POLICY_NAMES[:-1])} "
        "(oracle is for benchmarks only).",
    )
    tau: float = Field(default=0.1, ge=0.0, le=2.0, description="ELDR locality-band width.")
    load_measure: Literal["requests", "kv_tokens"] = Field(
        default="requests",
        description="Load the policies balance: in-flight requests or KV tokens.",
    )
    stale_after_s: float = Field(
        default=3.0, gt=0, description="A decode worker silent for this long leaves the load table."
    )
    pending_ttl_s: float = Field(
        default=10.0,
        gt=0,
        description="An assignment not confirmed by the worker's load reports within this "
        "stops counting against the worker.",
    )
    signature_timeout_s: float = Field(
        default=0.05,
        gt=0,
        description="How long to wait for the signature service; on timeout route load-only.",
    )
    assemble_wait_ms: int = Field(
        default=20,
        ge=0,
        le=60_000,
        description="How long the signature service may wait for block summaries in flight.",
    )
    fetch_signature: bool = Field(
        default=True,
        description="Fetch signatures even for load-only policies (the trainer learns from "
        "them; the decision record carries them for replay).",
    )
    max_scores: int = Field(
        default=8, ge=1, le=64, description="Top candidate scores recorded per decision."
    )
    consumer_batch: int = Field(default=64, ge=1, description="PrefillDone events per fetch.")
    max_concurrency: int = Field(
        default=64, ge=1, description="PrefillDone events handled concurrently per replica."
    )
    no_worker_wait_s: float = Field(
        default=2.0,
        ge=0,
        description="How long a request waits in the router for a live decode worker before "
        "it goes back to JetStream (keep below the router consumer's ack wait).",
    )
    no_worker_retry_s: float = Field(
        default=1.0, gt=0, description="Redelivery delay after that wait."
    )
    index_method: Literal["auto", "exact", "hnsw"] = Field(
        default="auto", description="Centroid search: hnswlib, exact, or auto by centroid count."
    )
    seed: int = Field(default=0, description="Seed of the policy's tie-break randomness.")
