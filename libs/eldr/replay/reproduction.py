"""Reproduction: every recorded decision re-run on its own recorded inputs.

For every recorded `Decision`, rebuild the router's inputs at that moment
from the record itself: the live workers with both load measures as the router saw them
(`fleet`), the partition version it used (its blob from the log), the request's signature
and prompt length, the policy and its parameters, and the seed of the decision's draws
(`rng_seed`). Then run `eldr.core.routing.decide.route`, the function the router itself runs, and
compare the worker, the band, the fallback and the top scores. Each decision is checked on
its own recorded inputs, so one difference cannot cascade. Round-robin keeps a cursor per
router replica: each of its decisions is replayed from the same replica's previous one (the
first per replica in the window only sets the cursor: "anchored"). Records written before
`rng_seed` existed cannot reproduce tie-breaks: a different worker that was tied for the
least load is then counted as `tie_unrecorded`, not as a mismatch. Cost-aware policies
(`Policy.uses_activity`, "eldr_cost") also read the router's activity table (the experts
each worker's in-flight requests are predicted to activate), which a decision does not
record: the replay rebuilds it from the window's decisions (a request enters at its
decision) and decode summaries (it leaves when its profile was recorded). The router saw
other replicas' decisions and the profiles a little later than that, and requests decided
before the window are missing, so such decisions are reproduced on approximate inputs and
counted apart (`approximate`, `approximate_mismatched`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from eldr.core.partition.partition import Partition
from eldr.core.routing.activity import ActivityView
from eldr.core.routing.decide import DecisionRng, RouteOutcome, route
from eldr.core.routing.pipeline import Policy, make_policy
from eldr.progress import NO_PROGRESS, Progress
from eldr.replay.eventlog import EventLog
from eldr.replay.inputs import (
    ActivityTrack,
    PartitionCache,
    RecordedInputs,
    least_loaded_candidates,
    needed_draw,
    recorded_fleet,
    recorded_inputs,
    recorded_profile,
    request_ends,
    request_of,
)
from eldr.wire import Decision

SCORE_TOLERANCE = 1e-5


Status = Literal[
    "reproduced", "mismatch", "anchored", "unreplayable", "tie_unrecorded", "approximate"
]


def recorded_score_problem(
    d: Decision, inputs: RecordedInputs, partition: Partition | None
) -> str | None:
    """Why the candidates' recorded scores do not match the partition (None: they do, or
    there is nothing to check)."""
    if inputs.scores is None or partition is None or d.signature is None:
        return None
    exact = partition.exact_scores_for(d.signature.to_dense(np.uint32), inputs.workers)
    recorded = np.isfinite(inputs.scores)
    if not np.isfinite(exact[recorded]).all():
        return "a recorded candidate has no centroid in the partition"
    worst = float(np.max(np.abs(exact[recorded] - inputs.scores[recorded]), initial=0.0))
    if worst > SCORE_TOLERANCE:
        return f"recorded scores differ from the partition's by up to {worst:.2e}"
    return None


def difference(d: Decision, outcome: RouteOutcome) -> str | None:
    """What differs between a recorded decision and a replayed one (None: nothing)."""
    if outcome.worker_id != d.worker_id:
        return f"worker {d.worker_id} recorded, {outcome.worker_id} replayed"
    if tuple(d.band) != outcome.band:
        return f"band {list(d.band)} recorded, {list(outcome.band)} replayed"
    if d.fallback != outcome.fallback:
        return f"fallback {d.fallback} recorded, {outcome.fallback} replayed"
    if d.partition_version != outcome.partition_version:
        return (
            f"partition version {d.partition_version} recorded, "
            f"{outcome.partition_version} replayed"
        )
    recorded_scores = list(d.scores)
    replayed_scores = list(outcome.scores)[: len(recorded_scores)]
    if [w for w, _ in recorded_scores] != [w for w, _ in replayed_scores] or any(
        abs(a - b) > SCORE_TOLERANCE
        for (_, a), (_, b) in zip(recorded_scores, replayed_scores, strict=True)
    ):
        return f"scores {recorded_scores} recorded, {replayed_scores} replayed"
    return None


@dataclass(frozen=True)
class Reproduction:
    status: Status
    outcome: RouteOutcome | None = None
    detail: str = ""


def reproduce_decision(
    d: Decision,
    partition: Partition | None,
    rngs: DecisionRng,
    policy: Policy | None = None,
    max_scores: int | None = None,
    expert_miss: ActivityView | None = None,
) -> Reproduction:
    """Re-run one decision on its recorded inputs. `partition`: the blob of
    `d.partition_version` (None when the record names none or it is missing); `policy`:
    a policy instance carrying state (round-robin), else one is built from the record's
    profile; `expert_miss`: a rebuilt activity view, for cost-aware policies."""
    if d.partition_version is not None and partition is None:
        return Reproduction(
            "unreplayable", detail=f"partition version {d.partition_version} is not available"
        )
    try:
        chooser = policy or make_policy(d.routing_profile)
    except ValueError as exc:
        return Reproduction("unreplayable", detail=f"policy {d.policy!r}: {exc}")
    inputs = recorded_inputs(d)
    if inputs is not None:
        problem = recorded_score_problem(d, inputs, partition)
        if problem is not None:
            return Reproduction("mismatch", detail=problem)
        outcome = route(
            request_of(d),
            policy=chooser,
            partition=partition,
            workers=inputs.workers,
            in_flight=inputs.in_flight,
            kv_tokens=inputs.kv_tokens,
            rng=rngs.seeded(d.rng_seed or 0),
            rng_seed=d.rng_seed,
            max_scores=max_scores or max(len(d.scores), 1),
            expert_miss=inputs.activity,
            scores=inputs.scores,
            mean_loads=inputs.mean_loads,
        )
        diff = difference(d, outcome)
        if diff is None:
            return Reproduction("reproduced", outcome)
        return Reproduction("mismatch", outcome, detail=diff)
    workers, in_flight, kv = recorded_fleet(d)
    outcome = route(
        request_of(d),
        policy=chooser,
        partition=partition,
        workers=workers,
        in_flight=in_flight,
        kv_tokens=kv,
        rng=rngs.seeded(d.rng_seed or 0),
        rng_seed=d.rng_seed,
        max_scores=max_scores or max(len(d.scores), 1),
        expert_miss=expert_miss,
    )
    diff = difference(d, outcome)
    if diff is None:
        return Reproduction("reproduced", outcome)
    if chooser.uses_activity:
        return Reproduction("approximate", outcome, detail=f"{diff} (activity rebuilt)")
    if d.rng_seed is None and d.worker_id in least_loaded_candidates(d):
        return Reproduction(
            "tie_unrecorded", outcome, detail=f"{diff} (tie; the record has no rng_seed)"
        )
    return Reproduction("mismatch", outcome, detail=diff)


@dataclass
class ReproductionReport:
    decisions: int = 0
    reproduced: int = 0
    mismatched: int = 0
    anchored: int = 0
    """Round-robin decisions that set their replica's cursor (first in the window)."""
    unreplayable: int = 0
    tie_unrecorded: int = 0
    approximate: int = 0
    """Decisions of cost-aware policies, replayed on a rebuilt activity table."""
    approximate_mismatched: int = 0
    """Of those, the ones that came out differently (not counted as mismatches)."""
    needed_draw: int = 0
    """Decisions whose choice depended on their seeded draw (ties, random, P2C)."""
    reasons: dict[str, int] = field(default_factory=dict)
    mismatches: list[dict[str, str]] = field(default_factory=list)

    @property
    def checked(self) -> int:
        """Decisions replayed on exactly their recorded inputs."""
        return self.decisions - self.anchored - self.unreplayable - self.approximate

    @property
    def share(self) -> float:
        return self.reproduced / self.checked if self.checked else 1.0

    @property
    def complete(self) -> bool:
        """Every decision replayed on its recorded inputs reproduced."""
        return self.mismatched == 0


def reproduce(
    log: EventLog,
    partitions: PartitionCache,
    rngs: DecisionRng,
    *,
    max_listed: int = 20,
    progress: Progress = NO_PROGRESS,
) -> ReproductionReport:
    """Re-run every decision of `log` on its recorded inputs (module doc); `max_listed`
    mismatches are listed; one unit of `progress` per decision."""
    report = ReproductionReport()
    cursors: dict[str, Policy] = {}
    previous: dict[str, Decision] = {}
    reasons: Counter[str] = Counter()
    decisions = log.decisions
    profiles = [recorded_profile(d) for d in decisions]
    track = None
    if any(p is not None and p.uses_activity for p in profiles):
        track = ActivityTrack(request_ends(decisions, log, default_s=None))
    progress.describe("reproducing")
    for i, d in enumerate(decisions):
        progress.advance()
        report.decisions += 1
        profile = profiles[i]
        expert_miss = None
        if track is not None:
            track.advance(d.ts_s)
            if not d.considered:
                expert_miss = track.view(recorded_fleet(d)[0])
            track.add(i, d.worker_id, d, profile)
        policy: Policy | None = None
        if profile is not None and profile.stateful:
            prev = previous.get(d.router_id)
            previous[d.router_id] = d
            if prev is None or recorded_profile(prev) != profile:
                report.anchored += 1
                continue
            cursor = cursors.get(d.router_id)
            if cursor is None or cursor.profile != profile:
                cursor = cursors[d.router_id] = make_policy(profile)
            cursor.resume_after(prev.worker_id, recorded_fleet(prev)[0])
            policy = cursor
        else:
            previous[d.router_id] = d
        result = reproduce_decision(
            d,
            partitions.get(d.partition_version),
            rngs,
            policy,
            expert_miss=expert_miss,
        )
        choice = None if result.outcome is None else result.outcome.choice
        if result.status == "reproduced" and choice is not None and d.considered:
            # The stages were re-run on exactly what they read: their ties are known.
            drew = len(choice.tied) > 1 or (profile is not None and profile.draws)
        else:
            drew = needed_draw(d)
        report.needed_draw += drew
        # Activity rebuilt from the window (records before v4): counted apart.
        uses_activity = profile is not None and profile.uses_activity and recorded_inputs(d) is None
        if uses_activity and result.status in ("reproduced", "approximate"):
            report.approximate += 1
            if result.status == "approximate":
                report.approximate_mismatched += 1
        elif result.status == "reproduced":
            report.reproduced += 1
        elif result.status == "unreplayable":
            report.unreplayable += 1
            reasons[result.detail] += 1
        elif result.status == "tie_unrecorded":
            report.tie_unrecorded += 1
        else:
            report.mismatched += 1
            if len(report.mismatches) < max_listed:
                report.mismatches.append(
                    {
                        "request_id": d.request_id,
                        "router_id": d.router_id,
                        "detail": result.detail,
                    }
                )
    report.reasons = dict(reasons)
    return report
