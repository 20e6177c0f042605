"""Settings of the simulated decode workers (`eldr serve simdecode`), from `ELDR_*` variables."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import Field, field_validator

from eldr.data.deployments import DEFAULT_DEPLOYMENT_FOR_TRACES
from eldr.settings import CommonSettings

_WORKER_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


class SimDecodeSettings(CommonSettings):
    """One process hosting a small, configured set of simulated decode workers."""

    simdecode_workers: str = Field(
        default="4",
        min_length=1,
        description="How many workers to host (a count: ids are prefix + 0..n-1) or their "
        "ids, comma-separated.",
    )
    simdecode_id_prefix: str = Field(
        default="decode-",
        pattern=r"^[A-Za-z0-9_-]{0,64}$",
        description="Prefix of generated worker ids when simdecode_workers is a count.",
    )
    simdecode_profile: str = Field(
        default=DEFAULT_DEPLOYMENT_FOR_TRACES,
        min_length=1,
        description="Deployment (eldr.data.deployments) that prices each decode step.",
    )
    simdecode_profiles_file: Path | None = Field(
        default=None, description="Deployment TOML to read instead of the packaged one."
    )
    simdecode_num_experts: int | None = Field(
        default=None,
        ge=1,
        le=32767,
        description="Experts per MoE layer of the served model: expert ids must lie below it "
        "and decode summaries are shaped [layers, num_experts]. Default: the deployment's "
        "model. Set it to the workload's geometry (e.g. 32 for the default synthetic one).",
    )
    simdecode_time_scale: float = Field(
        default=1.0,
        gt=0.0,
        le=1000.0,
        description="Real seconds per simulated second: 0.1 runs ten times faster than the "
        "modelled hardware. Reported TPOTs are in simulated seconds.",
    )
    simdecode_max_batch: int = Field(
        default=64, ge=1, le=4096, description="Most requests decoding at once per worker."
    )
    simdecode_kv_capacity_tokens: int = Field(
        default=1_000_000,
        ge=1,
        description="KV-cache tokens per worker; admission reserves prompt + decode tokens.",
    )
    simdecode_report_interval_s: float = Field(
        default=0.1, gt=0.0, le=60.0, description="Interval of LoadReports (real seconds)."
    )
    simdecode_max_lag_s: float = Field(
        default=0.25,
        ge=0.0,
        le=60.0,
        description="A busy worker whose event loop wakes it late keeps its steps on the cost "
        "model's schedule (catching up with shorter sleeps) while it is late by at most this "
        "many real seconds; beyond, its schedule restarts from now (counted in "
        "eldr_simdecode_lost_seconds_total).",
    )
    simdecode_drain_grace_s: float = Field(
        default=5.0,
        ge=0.0,
        description="On shutdown, how long (real seconds) requests already accepted may keep "
        "decoding; those still unfinished then are abandoned (logged and counted).",
    )
    simdecode_profile_queue: int = Field(
        default=10_000,
        ge=1,
        description="DecodeSummaries waiting to be published; beyond it they are dropped "
        "and counted.",
    )
    simdecode_publish_profiles: bool = Field(
        default=True,
        description="Publish a DecodeSummary per finished request. Off: like a real decode "
        "instance without the capture plugin; the simulated gateway's finish events alone "
        "tell the routers a request ended.",
    )

    @field_validator("simdecode_workers")
    @classmethod
    def _check_workers(cls, value: str) -> str:
        text = value.strip()
        if text.isdigit():
            if not 1 <= int(text) <= 256:
                raise ValueError("the worker count must lie in [1, 256]")
            return text
        ids = [part.strip() for part in text.split(",")]
        bad = [i for i in ids if not _WORKER_ID.match(i)]
        if bad:
            raise ValueError(f"worker ids must match [A-Za-z0-9_-]{{1,128}}: {bad}")
        if len(set(ids)) != len(ids):
            raise ValueError("worker ids must be distinct")
        return ",".join(ids)

    def worker_ids(self) -> list[str]:
        text = self.simdecode_workers
        if text.isdigit():
            return [f"{self.simdecode_id_prefix}{i}" for i in range(int(text))]
        return text.split(",")
