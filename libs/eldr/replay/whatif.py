"""What-if (counterfactual) replays: the recorded traffic re-decided under other settings.

The same decisions under another policy, other profile parameters
(tau, load measure, ...: on each decision whose policy takes them) or another partition.
Loads then change as decisions change; the load model is a correction of what the router
saw: a worker's load at a decision = the load recorded in that decision + the requests the
replay sent it that are still in flight - the requests the recording sent it that are
still in flight, counting only requests whose worker changed. A request is in flight from
its decision until its decode summary was recorded (the median profiled duration, or
`default_duration_s`, when it has none); its KV load is its prompt plus the tokens decoded
so far (linear over its lifetime). Everything that did not change keeps its recorded
effect, including requests decided before the window. Each decision keeps its recorded
seed, so ties are broken by the same draws. A cost-aware policy's activity table is
rebuilt from the replay's own assignments over the same lifetimes. Where decode summaries
were recorded, the effect on the decode batches is modelled (`eldr.replay.effect`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from eldr.core.costmodel import Deployment
from eldr.core.partition.partition import Partition
from eldr.core.routing.decide import DecisionRng, activity_for, route
from eldr.core.routing.pipeline import Policy, make_policy
from eldr.core.routing.profile import PROFILE_TYPES, ProfileBase, params_taken, profile_from_params
from eldr.progress import NO_PROGRESS, Progress
from eldr.replay.effect import ModelledEffect, model_decode_effect
from eldr.replay.eventlog import EventLog
from eldr.replay.inputs import (
    ACTIVITY_TTL_S,
    ActivityTrack,
    PartitionCache,
    recorded_fleet,
    recorded_profile,
    request_end,
    request_ends,
    request_of,
)
from eldr.wire import Decision

DEFAULT_DURATION_S = 10.0
"""In-flight time of a request without a decode summary when no request has one."""


@dataclass
class SideSummary:
    """The recorded (before) or replayed (after) decisions of a window."""

    per_worker: dict[str, int]
    fallbacks: dict[str, int]
    similarity_mean: float | None
    """Mean cosine similarity of each request's signature to its chosen worker's nearest
    centroid, under the reference partition (see `CounterfactualReport`)."""
    chosen_load_mean: float | None
    """Mean load (the replay's measure) of the chosen worker when it was chosen."""


@dataclass
class CounterfactualReport:
    changes: dict[str, str]
    """What the replay changed, e.g. {"tau": "0.1 -> 0"}."""
    policy: str
    """The replayed configuration of the most recent decision (one line)."""
    decisions: int
    changed: int
    kept: int
    """Decisions the replay could not re-decide (missing partition): kept as recorded."""
    similarity_decisions: int
    reference_partitions: list[int]
    before: SideSummary
    after: SideSummary
    moves: list[dict[str, str]]
    """The first changed decisions: request id, recorded worker, replayed worker."""
    modelled: ModelledEffect | None
    load_model: str
    activity_model: str | None = None
    """How the what-if got the activity a cost-aware policy reads (None: it read none)."""
    candidates_only: int = 0
    """Decisions recorded by a fleet-scale profile: the record lists only the candidates
    it read, so the what-if chooses among those."""
    changed_at_s: list[float] = field(default_factory=list, repr=False)
    decided_at_s: list[float] = field(default_factory=list, repr=False)

    @property
    def changed_share(self) -> float:
        return self.changed / self.decisions if self.decisions else 0.0


@dataclass(frozen=True)
class ReplayConfig:
    """What a replay changes (None / unset: as recorded) and how it models the effect."""

    policy: str | None = None
    """Replay every decision with this policy (the parameters it takes carry over from
    each recorded profile)."""
    params: tuple[tuple[str, float | str], ...] = ()
    """Profile parameters to set (e.g. ("tau", 0.0), ("slack", 0.2)), on every decision
    whose (replayed) policy takes them; the others keep their recorded value."""
    partition: Partition | None = None
    """Route every decision with this partition instead of the recorded version."""
    index_method: str = "auto"
    cost: Deployment | None = None
    sample_s: float | None = None
    """Batch sampling step of the decode model; None = automatic."""
    default_duration_s: float | None = None
    """In-flight time of requests without a decode summary; None = median of the profiled."""
    max_listed: int = 20

    def __post_init__(self) -> None:
        # Refuse now what no decision could be replayed with (ValueError says why).
        if self.policy is not None:
            profile_from_params(self.policy, dict(self.params))
            return
        for name, value in self.params:
            takers = [p for p, t in PROFILE_TYPES.items() if name in t.__struct_fields__]
            if not takers:
                raise ValueError(f"no policy takes a parameter {name!r}")
            profile_from_params(takers[0], {name: value})

    @property
    def counterfactual(self) -> bool:
        return bool(self.params) or self.policy is not None or self.partition is not None

    def applied_to(self, recorded: ProfileBase | None) -> ProfileBase | None:
        """The replayed profile of a decision recorded under `recorded` (None: a policy
        this code does not know); None when there is nothing to replay it with."""
        name = self.policy or (None if recorded is None else recorded.name)
        if name is None:
            return None
        return profile_from_params(name, params_taken(name, dict(self.params)), keep=recorded)


class WhatIf:
    """The decisions of a log re-decided under `config` (module doc); `run` once."""

    def __init__(
        self,
        event_log: EventLog,
        config: ReplayConfig,
        partitions: PartitionCache,
        rngs: DecisionRng,
        progress: Progress = NO_PROGRESS,
    ) -> None:
        """progress: one unit per decision replayed."""
        self.log = event_log
        self.config = config
        self.progress = progress
        self.partitions = partitions
        self._rngs = rngs
        self._policies: dict[ProfileBase, Policy | None] = {}

    def run(self) -> CounterfactualReport:
        cfg = self.config
        decisions = self.log.decisions
        summaries = self.log.summaries
        default_duration_s = self._durations()
        ends = [request_end(d, self.log) or d.ts_s + default_duration_s for d in decisions]
        active: list[int] = []  # decisions whose worker changed and that are in flight
        policies: dict[tuple[str, ProfileBase], Policy] = {}
        after: list[str] = []
        kept = 0
        chosen_before: list[float] = []
        chosen_after: list[float] = []
        sims_before: list[float] = []
        sims_after: list[float] = []
        ref_versions: set[int] = set()
        fallbacks_after: Counter[str] = Counter()
        moves: list[dict[str, str]] = []
        changed_at: list[float] = []
        last_config: ProfileBase | None = None
        track: ActivityTrack | None = None
        candidates_only = 0
        self.progress.describe("what-if")
        for i, d in enumerate(decisions):
            self.progress.advance()
            t = d.ts_s
            active = [j for j in active if ends[j] > t]
            workers, in_flight, kv = recorded_fleet(d)
            config = cfg.applied_to(recorded_profile(d))
            if config is not None:
                last_config = config
            if active:
                in_flight, kv = self._corrected(workers, in_flight, kv, active, after, t, ends)
            shared = self._policy(config)
            partition = self._partition_for(d, shared)
            missing = (
                shared is not None
                and shared.wants_scores
                and partition is None
                and self._needs_blob(d)
            )
            if config is None or shared is None or missing:  # unknown, or a blob the log lacks
                after.append(d.worker_id)
                kept += 1
                continue
            key = (d.router_id, config)
            policy = policies.get(key)
            if policy is None:
                policy = policies[key] = make_policy(config)
            expert_miss = None
            if policy.uses_activity:
                if track is None:
                    track = ActivityTrack(request_ends(decisions, self.log, default_s=None))
                track.advance(t)
                expert_miss = activity_for(policy, track.table, workers)
            mean_loads = None
            if not d.fleet and d.considered:
                candidates_only += 1
                live = max(d.live_workers or len(workers), 1)
                totals = d.fleet_totals or (int(in_flight.sum()), int(kv.sum()))
                mean_loads = (totals[0] / live, totals[1] / live)
            outcome = route(
                request_of(d),
                policy=policy,
                partition=partition,
                workers=workers,
                in_flight=in_flight,
                kv_tokens=kv,
                rng=self._rngs.seeded(d.rng_seed or 0),
                rng_seed=d.rng_seed,
                max_scores=max(len(d.scores), 1),
                expert_miss=expert_miss,
                mean_loads=mean_loads,
            )
            after.append(outcome.worker_id)
            if track is not None:
                track.add(i, outcome.worker_id, d, config)
            if outcome.fallback:
                fallbacks_after[outcome.fallback] += 1
            _, rec_in_flight, rec_kv = recorded_fleet(d)
            measure_before = rec_in_flight if config.measure == "requests" else rec_kv
            measure_after = in_flight if config.measure == "requests" else kv
            if d.worker_id in workers:  # always, unless the record is inconsistent
                chosen_before.append(float(measure_before[workers.index(d.worker_id)]))
            chosen_after.append(float(measure_after[workers.index(outcome.worker_id)]))
            reference = cfg.partition or self._reference_partition(d)
            if reference is not None:
                sims = _similarities(reference, d, (d.worker_id, outcome.worker_id))
                if sims is not None:
                    ref_versions.add(reference.version)
                    sims_before.append(sims[0])
                    sims_after.append(sims[1])
            if outcome.worker_id != d.worker_id:
                active.append(i)
                changed_at.append(t)
                if len(moves) < cfg.max_listed:
                    moves.append(
                        {"request_id": d.request_id, "from": d.worker_id, "to": outcome.worker_id}
                    )
        before_workers = [d.worker_id for d in decisions]
        modelled = None
        if any(d.request_id in summaries for d in decisions):
            modelled = model_decode_effect(
                decisions, summaries, before_workers, after, cfg.cost, cfg.sample_s
            )
        return CounterfactualReport(
            changes=self._changes(),
            policy=last_config.describe() if last_config else "-",
            decisions=len(decisions),
            changed=len(changed_at),
            kept=kept,
            similarity_decisions=len(sims_before),
            reference_partitions=sorted(ref_versions),
            before=SideSummary(
                per_worker=dict(sorted(Counter(before_workers).items())),
                fallbacks=dict(Counter(d.fallback for d in decisions if d.fallback)),
                similarity_mean=_mean(sims_before),
                chosen_load_mean=_mean(chosen_before),
            ),
            after=SideSummary(
                per_worker=dict(sorted(Counter(after).items())),
                fallbacks=dict(fallbacks_after),
                similarity_mean=_mean(sims_after),
                chosen_load_mean=_mean(chosen_after),
            ),
            moves=moves,
            modelled=modelled,
            activity_model=(
                None
                if track is None
                else "rebuilt from the replay's own assignments: a request counts on its "
                "replayed worker from its decision until its decode summary or finish event "
                f"(else {ACTIVITY_TTL_S:g} s); requests decided before the window are missing"
            ),
            candidates_only=candidates_only,
            load_model=(
                "recorded load of each decision, corrected by the in-flight requests whose "
                f"worker changed (in flight from decision to decode summary; "
                f"{default_duration_s:.3g} s without a profile)"
            ),
            changed_at_s=changed_at,
            decided_at_s=[d.ts_s for d in decisions],
        )

    def _policy(self, profile: ProfileBase | None) -> Policy | None:
        """A shared (stateless use only) instance per profile; None if unknown."""
        if profile is None:
            return None
        if profile not in self._policies:
            try:
                self._policies[profile] = make_policy(profile)
            except ValueError:
                self._policies[profile] = None
        return self._policies[profile]

    def _durations(self) -> float:
        if self.config.default_duration_s is not None:
            return self.config.default_duration_s
        spans = [
            end - d.ts_s
            for d in self.log.decisions
            if (end := request_end(d, self.log)) is not None
        ]
        return float(np.median(spans)) if spans else DEFAULT_DURATION_S

    def _corrected(
        self,
        workers: tuple[str, ...],
        in_flight: np.ndarray,
        kv: np.ndarray,
        active: Sequence[int],
        after: Sequence[str],
        t: float,
        ends: Sequence[float],
    ) -> tuple[np.ndarray, np.ndarray]:
        """Recorded loads minus the recording's, plus the replay's, changed requests."""
        slot = {w: i for i, w in enumerate(workers)}
        d_req = np.zeros(len(workers), dtype=np.int64)
        d_kv = np.zeros(len(workers), dtype=np.int64)
        decisions = self.log.decisions
        for j in active:
            rec = decisions[j]
            new = after[j]
            tokens = self._kv_tokens(rec, t, ends[j])
            for worker, sign in ((rec.worker_id, -1), (new, 1)):
                k = slot.get(worker)
                if k is not None:
                    d_req[k] += sign
                    d_kv[k] += sign * tokens
        return np.maximum(in_flight + d_req, 0), np.maximum(kv + d_kv, 0)

    def _kv_tokens(self, d: Decision, t: float, end: float) -> int:
        summary = self.log.summaries.get(d.request_id)
        decoded = 0.0
        if summary is not None and end > d.ts_s:
            decoded = summary.tokens * min(max((t - d.ts_s) / (end - d.ts_s), 0.0), 1.0)
        return int((d.prompt_tokens or 0) + decoded)

    def _needs_blob(self, d: Decision) -> bool:
        version = d.partition_version or self.log.version_in_force(d.ts_s)
        return version is not None

    def _partition_for(self, d: Decision, policy: Policy | None) -> Partition | None:
        if policy is None or not policy.wants_scores:
            return None
        if self.config.partition is not None:
            return self.config.partition
        return self._reference_partition(d)

    def _reference_partition(self, d: Decision) -> Partition | None:
        """The recorded partition version, else the one announced by then."""
        version = d.partition_version or self.log.version_in_force(d.ts_s)
        return self.partitions.get(version)

    def _changes(self) -> dict[str, str]:
        """What the replay changes, against the most common recorded profile."""
        cfg = self.config
        recorded = Counter(p for d in self.log.decisions if (p := recorded_profile(d)))
        usual = recorded.most_common(1)[0][0] if recorded else None
        taken = {} if usual is None else usual.params()
        out: dict[str, str] = {}
        if cfg.policy is not None:
            out["policy"] = f"{'?' if usual is None else usual.name} -> {cfg.policy}"
        for name, value in cfg.params:
            was = taken.get(name)
            out[name] = f"{'default' if was is None else _value(was)} -> {_value(value)}"
        if cfg.partition is not None:
            versions = sorted({d.partition_version or 0 for d in self.log.decisions} - {0})
            out["partition"] = f"{versions or 'none'} -> version {cfg.partition.version}"
        return out


def _value(value: float | int | str) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _mean(values: Sequence[float]) -> float | None:
    return float(np.mean(values)) if values else None


def _similarities(
    partition: Partition, d: Decision, workers: tuple[str, str]
) -> tuple[float, float] | None:
    """Cosine similarity of the request to each given worker's nearest centroid."""
    if d.signature is None or partition.model != d.model:
        return None
    cal = partition.calibration
    if d.signature.shape != [cal.num_moe_layers, cal.num_experts]:
        return None
    scores = partition.worker_scores(d.signature.to_dense(np.uint32))
    slot = {w: i for i, w in enumerate(partition.workers)}
    out = []
    for w in workers:
        i = slot.get(w)
        if i is None or not np.isfinite(scores[i]):
            return None
        out.append(float(scores[i]))
    return out[0], out[1]
