"""The trainer's Prometheus metrics: what `eldr.training.trainer.Trainer` reports through
its observer (`TrainerObserver`), on the registry the runtime owns."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from eldr.core.partition.partition import FitReport
from eldr.core.training.online import DriftBaseline, ShadowResult
from eldr.training.trainer import ERROR_STAGES, OUTCOMES, TRIGGERS

FIT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class TrainerMetrics:
    """The trainer's metrics; what `Trainer` reports (`eldr.training.trainer.TrainerObserver`)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.refits = Counter(
            "eldr_trainer_refits_total",
            "Refits by trigger (request, schedule, drift, churn) and outcome (ok: a version "
            "was promoted; rejected: the shadow evaluation kept the active version; "
            "skipped; error).",
            ["trigger", "outcome"],
            registry=r,
        )
        self.shadow_union = Gauge(
            "eldr_trainer_shadow_union_per_layer",
            "Last shadow evaluation: modelled distinct experts per MoE layer per step of the "
            "held-out requests under the active version and the candidate.",
            ["partition"],
            registry=r,
        )
        self.last_rejected_version = Gauge(
            "eldr_trainer_last_rejected_version",
            "The last version the shadow evaluation rejected (0: none).",
            registry=r,
        )
        self.drift_similarity = Gauge(
            "eldr_trainer_drift_best_similarity",
            "Mean cosine of recent requests to their nearest centroid of the active version "
            "(and, for baseline, the value the version was fitted with).",
            ["window"],
            registry=r,
        )
        self.drift_skew = Gauge(
            "eldr_trainer_drift_occupancy_skew",
            "Total-variation distance from uniform of recent requests' nearest-worker "
            "occupancy under the active version (and its baseline).",
            ["window"],
            registry=r,
        )
        self.drift_detected = Gauge(
            "eldr_trainer_drift_detected",
            "1 while the drift monitor says the active version no longer fits the traffic.",
            registry=r,
        )
        self.refit_errors = Counter(
            "eldr_trainer_refit_errors_total",
            "Failed refits by stage (database, lock, fit, publish, internal).",
            ["stage"],
            registry=r,
        )
        self.fit_seconds = Histogram(
            "eldr_trainer_fit_duration_seconds",
            "CPU time of one fit (calibration and balanced K-means), wall seconds.",
            buckets=FIT_BUCKETS,
            registry=r,
        )
        self.window_samples = Gauge(
            "eldr_trainer_window_samples",
            "Requests in the training window, with and without a decode summary; "
            "finished_without: finished (a gateway's finish event) with no profile, i.e. "
            "whose decode summary is not coming.",
            ["profile"],
            registry=r,
        )
        self.inputs = Counter(
            "eldr_trainer_inputs_total",
            "Messages taken or ignored, by kind (decision, profile) and outcome.",
            ["kind", "outcome"],
            registry=r,
        )
        self.active_version = Gauge(
            "eldr_trainer_active_version",
            "Partition version this trainer last stored or found active (0: none).",
            registry=r,
        )
        self.live_workers = Gauge(
            "eldr_trainer_live_workers", "Decode workers a refit would use now.", registry=r
        )
        self.last_fit_inertia = Gauge(
            "eldr_trainer_last_fit_mean_inertia",
            "Mean 1 - cos(signature, its centroid) over the last fit's training requests.",
            registry=r,
        )
        self.last_fit_moved_share = Gauge(
            "eldr_trainer_last_fit_moved_share",
            "Share of the last fit's training requests whose worker changed from the "
            "previous version's choice (0 without a previous version).",
            registry=r,
        )
        self.last_fit_samples = Gauge(
            "eldr_trainer_last_fit_samples", "Training requests of the last fit.", registry=r
        )
        for trigger in TRIGGERS:
            for outcome in OUTCOMES:
                self.refits.labels(trigger, outcome)
        for which in ("active", "candidate"):
            self.shadow_union.labels(which)
        for window in ("recent", "baseline"):
            self.drift_similarity.labels(window)
            self.drift_skew.labels(window)
        for stage in ERROR_STAGES:
            self.refit_errors.labels(stage)
        for profile in ("with", "without"):
            self.window_samples.labels(profile)

    # --- eldr.training.trainer.TrainerObserver ----------------------------------------------------

    def took_input(self, kind: str, outcome: str) -> None:
        self.inputs.labels(kind, outcome).inc()

    def window_changed(
        self, with_summary: int, without_summary: int, finished_without_summary: int = 0
    ) -> None:
        self.window_samples.labels("with").set(with_summary)
        self.window_samples.labels("without").set(without_summary)
        self.window_samples.labels("finished_without").set(finished_without_summary)

    def saw_live_workers(self, count: int) -> None:
        self.live_workers.set(count)

    def refit_ended(self, trigger: str, status: str) -> None:
        self.refits.labels(trigger, status).inc()

    def refit_failed(self, stage: str) -> None:
        self.refit_errors.labels(stage).inc()

    def fitted(self, seconds: float) -> None:
        self.fit_seconds.observe(seconds)

    def shadow_evaluated(self, result: ShadowResult) -> None:
        self.shadow_union.labels("active").set(result.active_union)
        self.shadow_union.labels("candidate").set(result.candidate_union)

    def version_rejected(self, version: int) -> None:
        self.last_rejected_version.set(version)

    def version_promoted(self, version: int, report: FitReport) -> None:
        self.active_version.set(version)
        self.last_fit_samples.set(report.n_train)
        self.last_fit_inertia.set(report.inertia / max(report.n_train, 1))
        self.last_fit_moved_share.set(report.moved_share or 0.0)

    def found_active(self, version: int) -> None:
        self.active_version.set(version)

    def drift_baseline_set(self, baseline: DriftBaseline) -> None:
        self.drift_similarity.labels("baseline").set(baseline.best_similarity)
        self.drift_skew.labels("baseline").set(baseline.occupancy_skew)

    def drift_measured(self, best_similarity: float, occupancy_skew: float) -> None:
        self.drift_similarity.labels("recent").set(best_similarity)
        self.drift_skew.labels("recent").set(occupancy_skew)

    def drift_verdict(self, drifted: bool) -> None:
        self.drift_detected.set(1.0 if drifted else 0.0)
