"""Settings of the trainer service (`ELDR_*` environment variables)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import NoDecode

from eldr.core.training.config import TrainerConfig
from eldr.settings import CommonSettings, GeometrySettings, RoutingSettings
from eldr.store.settings import StoreSettings

DEFAULTS = TrainerConfig()
"""The defaults of the fields that `TrainerConfig` carries are written there, once."""


class TrainerSettings(CommonSettings, StoreSettings, GeometrySettings, RoutingSettings):
    """The trainer's settings; `RoutingSettings` is the routers' routing profile, which the
    shadow gate routes with (give the trainer the routers' values)."""

    trainer_workers: Annotated[tuple[str, ...], NoDecode] = Field(
        default=DEFAULTS.trainer_workers,
        description="Fixed decode-worker ids, comma-separated (ELDR_TRAINER_WORKERS=dw0,dw1). "
        "When set, refits use exactly these and load reports do not change the set; when "
        "empty, the live workers are those whose load report arrived within worker_ttl_s.",
    )
    worker_ttl_s: float = Field(
        default=DEFAULTS.worker_ttl_s,
        gt=0,
        description="A decode worker counts as live if it reported its load within this.",
    )
    window_max_samples: int = Field(
        default=DEFAULTS.window_max_samples,
        ge=1,
        description="Training window size: the newest this many requests (decisions with "
        "signatures). A refit holds them dense, prefill and decode: about 5 x N x layers x "
        "experts x 4 bytes at its peak (20,000 x 24 x 128: about 1.1 GB).",
    )
    window_max_age_s: float = Field(
        default=DEFAULTS.window_max_age_s,
        gt=0,
        description="Training window age: older requests leave the window; at start the "
        "window is rebuilt by replaying this much of DECISIONS and PROFILES.",
    )
    min_samples: int = Field(
        default=DEFAULTS.min_samples,
        ge=1,
        description="A refit needs at least this many requests in the window (and at least "
        "one per worker); otherwise it is skipped with the reason.",
    )
    refit_interval_s: float = Field(
        default=DEFAULTS.refit_interval_s,
        ge=0,
        description="Scheduled refit period; 0 = only on request (`eldr refit`), drift and "
        "churn. A scheduled refit is skipped when no request entered the window since the "
        "last fit.",
    )
    model: str | None = Field(
        default=DEFAULTS.model,
        min_length=1,
        max_length=200,
        description="Model to fit partitions for; default: the model with the most "
        "requests in the window (Decision.model).",
    )
    seed: int = Field(
        default=DEFAULTS.seed,
        ge=0,
        description="Seed of every fit (stored with the version). Only the trainer's: the "
        "routers' tie-break seed is router_seed.",
    )
    transform: Literal["idf", "raw"] = Field(
        default=DEFAULTS.transform, description="Signature transform: counts x IDF, or raw counts."
    )
    layer_selection: Literal["greedy", "all"] = Field(
        default=DEFAULTS.layer_selection,
        description="MoE layers kept in signatures: forward-greedy against decode summaries, "
        "or all layers.",
    )
    min_profiled: int = Field(
        default=DEFAULTS.min_profiled,
        ge=2,
        description="Greedy layer selection needs this many requests with decode summaries; "
        "with fewer every layer is kept.",
    )
    reduce_dim: int = Field(
        default=DEFAULTS.reduce_dim,
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
        default=DEFAULTS.write_lock_timeout_s,
        gt=0,
        description="How long a refit waits for another trainer's write to finish.",
    )
    replay_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="Bound on rebuilding the window from the streams at start.",
    )
    shadow_gate: bool = Field(
        default=DEFAULTS.shadow_gate,
        description="Promote a scheduled or drift-triggered refit only if a shadow "
        "evaluation on held-out recent requests predicts a lower expert union than the "
        "active version's; otherwise store it as rejected and keep the active version.",
    )
    shadow_gate_requests: bool = Field(
        default=DEFAULTS.shadow_gate_requests,
        description="Also gate refits an operator asked for (`eldr refit`); by default "
        "those are promoted (the shadow result is not computed).",
    )
    shadow_min_gain: float = Field(
        default=DEFAULTS.shadow_min_gain,
        ge=0.0,
        lt=1.0,
        description="A candidate must lower the modelled union by more than this fraction.",
    )
    shadow_holdout_fraction: float = Field(
        default=DEFAULTS.shadow_holdout_fraction,
        gt=0.0,
        lt=1.0,
        description="Share of the window's requests (by a hash of the request id) held out "
        "of gated fits: the shadow evaluation and the drift baseline use them.",
    )
    shadow_min_requests: int = Field(
        default=DEFAULTS.shadow_min_requests,
        ge=1,
        description="Held-out requests a shadow evaluation needs (with decode summaries; "
        "else their prefill counts stand in); fewer: the candidate is rejected.",
    )
    shadow_batch: float = Field(
        default=DEFAULTS.shadow_batch,
        ge=0.0,
        description="Per-worker batch the shadow evaluation models; 0 = the mean in-flight "
        "requests per live worker from load reports, at least 8.",
    )
    shadow_tau: float | None = Field(
        default=None,
        description="Older spelling of tau for the trainer (the shadow gate routes with the "
        "routers' profile, routing_profile); if both are set they must agree.",
    )
    drift_detection: bool = Field(
        default=DEFAULTS.drift_detection,
        description="Watch how recent requests sit against the active version and refit "
        "early when they drift from its baseline.",
    )
    drift_window: int = Field(
        default=DEFAULTS.drift_window, ge=1, description="Recent requests the drift monitor keeps."
    )
    drift_min_samples: int = Field(
        default=DEFAULTS.drift_min_samples,
        ge=1,
        description="Requests the drift monitor needs before a verdict (and to set the "
        "baseline of a version fitted without held-out requests).",
    )
    drift_max_similarity_drop: float = Field(
        default=DEFAULTS.drift_max_similarity_drop,
        gt=0.0,
        description="Drift when the recent mean best-centroid cosine falls this far below "
        "the baseline.",
    )
    drift_max_skew_rise: float = Field(
        default=DEFAULTS.drift_max_skew_rise,
        gt=0.0,
        description="Drift when the recent nearest-centroid occupancy skew (total variation "
        "from uniform) rises this far above the baseline.",
    )
    drift_min_gap_s: float = Field(
        default=DEFAULTS.drift_min_gap_s,
        ge=0.0,
        description="At most one drift-triggered refit per this many seconds.",
    )
    drift_fit_max_age_s: float = Field(
        default=DEFAULTS.drift_fit_max_age_s,
        gt=0.0,
        description="A drift-triggered refit fits on the requests of the last this many "
        "seconds only (older ones are what drifted away), if there are enough.",
    )
    churn_refit: bool = Field(
        default=DEFAULTS.churn_refit,
        description="Refit when the live decode workers differ from the active version's.",
    )
    churn_settle_s: float = Field(
        default=DEFAULTS.churn_settle_s,
        ge=0.0,
        description="Wait until the live worker set has not changed for this long before a "
        "churn refit (workers joining together give one refit).",
    )

    max_workers: int = Field(
        default=DEFAULTS.max_workers,
        ge=1,
        le=4096,
        description="Decode workers the trainer keeps as live at most (reports of further "
        "new workers are refused and counted, eldr_trainer_inputs_total"
        '{kind="load",outcome="fleet_full"}), and so the most a refit fits for: a fit costs '
        "about window size x workers per K-means iteration (4,200 workers took a refit to "
        "minutes). Keep it the routers' max_workers.",
    )
    fit_timeout_s: float = Field(
        default=DEFAULTS.fit_timeout_s,
        gt=0,
        description="A refit's fit (calibration, balanced K-means, alignment, shadow "
        "evaluation) is abandoned after this long and counted as an error at stage fit; "
        "nothing is stored. The fit checks it (and the service stopping) between steps of "
        "its loops, so SIGTERM and this limit take effect within a fraction of a second.",
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

    def legacy_params(self) -> dict[str, object]:
        """`RoutingSettings.legacy_params`, with `shadow_tau` standing in for `tau`."""
        params = super().legacy_params()
        if self.shadow_tau is not None:
            if self.tau is not None and self.tau != self.shadow_tau:
                raise ValueError(
                    f"shadow_tau {self.shadow_tau:g} and tau {self.tau:g} differ: the shadow "
                    "gate routes with the routers' profile (set tau, or routing_profile)"
                )
            params["tau"] = self.shadow_tau
        return params
