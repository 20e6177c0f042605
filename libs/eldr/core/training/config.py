"""The trainer's configuration: what the trainer service and its refit plan are tuned by.

Pure data, so that the refit plan (`eldr.core.training.refit`) and the online benchmark
read the same type the service builds from its settings.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from eldr.core.limits import DEFAULT_MAX_WORKERS
from eldr.core.routing.profile import DEFAULT_PROFILE, ProfileBase


@dataclass(frozen=True)
class TrainerConfig:
    """What the trainer (`eldr.training.trainer.Trainer`) and its refit plan are tuned by:
    the fields of the same names of the trainer service's settings (their descriptions are
    there). The defaults are written here only; the settings take theirs from here."""

    model: str | None = None
    trainer_workers: tuple[str, ...] = ()
    worker_ttl_s: float = 10.0
    window_max_samples: int = 20_000
    window_max_age_s: float = 1800.0
    min_samples: int = 256
    refit_interval_s: float = 60.0
    seed: int = 0
    transform: Literal["idf", "raw"] = "idf"
    layer_selection: Literal["greedy", "all"] = "greedy"
    min_profiled: int = 64
    reduce_dim: int = 128
    write_lock_timeout_s: float = 30.0
    shadow_gate: bool = True
    shadow_gate_requests: bool = False
    shadow_min_gain: float = 0.0
    shadow_holdout_fraction: float = 0.2
    shadow_min_requests: int = 32
    shadow_batch: float = 0.0
    routing_profile: ProfileBase = DEFAULT_PROFILE
    """The routers' routing profile: the shadow gate routes with it."""
    drift_detection: bool = True
    drift_window: int = 512
    drift_min_samples: int = 128
    drift_max_similarity_drop: float = 0.05
    drift_max_skew_rise: float = 0.2
    drift_min_gap_s: float = 30.0
    drift_fit_max_age_s: float = 300.0
    churn_refit: bool = True
    churn_settle_s: float = 5.0
    max_workers: int = DEFAULT_MAX_WORKERS
    fit_timeout_s: float = 300.0

    @classmethod
    def from_settings(cls, settings: object) -> TrainerConfig:
        """The config from any object with attributes of these names (the service's
        settings)."""
        values = {f.name: getattr(settings, f.name) for f in dataclasses.fields(cls)}
        return cls(**values)
