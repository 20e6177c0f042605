"""Settings of the trainer service (`ELDR_*` environment variables)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import NoDecode

from eldr.settings import CommonSettings
from eldr.store.settings import StoreSettings


class TrainerSettings(CommonSettings, StoreSettings):
    trainer_workers: Annotated[tuple[str, ...], NoDecode] = Field(
        default=(),
        description="Fixed decode-worker ids, comma-separated (ELDR_TRAINER_WORKERS=dw0,dw1). "
        "When set, refits use exactly these and load reports do not change the set; when "
        "empty, the live workers are those whose load report arrived within worker_ttl_s.",
    )
    worker_ttl_s: float = Field(
        default=10.0,
        gt=0,
        description="A decode worker counts as live if it reported its load within this.",
    )
    window_max_samples: int = Field(
        default=20_000,
        ge=1,
        description="Training window size: the newest this many requests (decisions with "
        "signatures). A refit holds them dense, prefill and decode: about 5 x N x layers x "
        "experts x 4 bytes at its peak (20,000 x 24 x 128: about 1.1 GB).",
    )
    window_max_age_s: float = Field(
        default=1800.0,
        gt=0,
        description="Training window age: older requests leave the window; at start the "
        "window is rebuilt by replaying this much of DECISIONS and PROFILES.",
    )
    min_samples: int = Field(
        default=256,
        ge=1,
        description="A refit needs at least this many requests in the window (and at least "
        "one per worker); otherwise it is skipped with the reason.",
    )
    refit_interval_s: float = Field(
        default=60.0,
        ge=0,
        description="Scheduled refit period; 0 = only on request (`eldr refit`). A scheduled "
        "refit is skipped when no request entered the window since the last fit.",
    )
    model: str | None = Field(
        default=None,
        min_length=1,
        max_length=200,
        description="Model to fit partitions for; default: the model with the most "
        "requests in the window (Decision.model).",
    )
    seed: int = Field(default=0, ge=0, description="Seed of every fit (stored with the version).")
    transform: Literal["idf", "raw"] = Field(
        default="idf", description="Signature transform: counts x IDF, or raw counts."
    )
    layer_selection: Literal["greedy", "all"] = Field(
        default="greedy",
        description="MoE layers kept in signatures: forward-greedy against decode profiles, "
        "or all layers.",
    )
    min_profiled: int = Field(
        default=64,
        ge=2,
        description="Greedy layer selection needs this many requests with decode profiles; "
        "with fewer every layer is kept.",
    )
    reduce_dim: int = Field(
        default=128,
        ge=0,
        description="K-means iterates in a projection to this many dimensions (0 = never).",
    )
    migrate_on_start: bool = Field(
        default=True,
        description="Run the Alembic migrations at start (and before a refit until they succeed).",
    )
    database_connect_timeout_s: float = Field(
        default=5.0, gt=0, description="Timeout of one database connection attempt."
    )
    write_lock_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="How long a refit waits for another trainer's write to finish.",
    )
    replay_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="Bound on rebuilding the window from the streams at start.",
    )

    @field_validator("trainer_workers", mode="before")
    @classmethod
    def _split_workers(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(w.strip() for w in value.split(",") if w.strip())
        return value

    @field_validator("trainer_workers")
    @classmethod
    def _unique_tokens(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(value)) != len(value):
            raise ValueError(f"duplicate worker ids in {value}")
        for w in value:
            if not w.replace("-", "").replace("_", "").isalnum() or len(w) > 256:
                raise ValueError(f"worker id {w!r} is not a subject-safe token")
        return value
