"""One routing decision in plain words (`eldr explain`).

From a recorded `Decision` (and, when available, the partition version it used and the
request's decode summary): the candidates with their scores and loads, why the locality
band held the workers it held (best score, tau, the widening rule), why the winner won
(least load in the band, and how a tie was broken), what a load-only router (JSQ on the
same loads) would have chosen, any fallback and its reason, and whether replaying the
record gives the same decision.

The numbers come from the decision itself, re-run on its recorded inputs through the
router's own decision (`eldr.replay.reproduction.reproduce_decision`, `route`): the band rule's
best score, threshold, widening and newcomers, the workers tied for the least load are
what the policy computed (`Choice`, `BandTrace`), not re-derived here; JSQ's pick goes
through the same decision function (`decide_view`). Without the partition version the
record alone is told. Pure: the caller fetches the records.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from eldr.core.partition.partition import Partition
from eldr.core.routing.decide import DecisionRng, decide_view
from eldr.core.routing.pipeline import BandTrace, Choice, make_policy
from eldr.core.routing.profile import (
    JsqProfile,
    LoadCeiling,
    P2cProfile,
    ProfileBase,
    RandomProfile,
    RoundRobinProfile,
)
from eldr.replay.eventlog import format_ts
from eldr.replay.inputs import least_loaded_candidates, recorded_fleet, recorded_profile
from eldr.replay.reproduction import Reproduction, reproduce_decision
from eldr.wire import Decision, DecodeSummary

LOAD_UNITS = {"requests": "in-flight requests", "kv_tokens": "KV tokens"}

FALLBACK_TEXT = {
    "no_partition": "the router had no partition loaded (none published yet, or not loaded)",
    "model_mismatch": "the router's partition was fitted for another model",
    "geometry_mismatch": "the signature's shape (MoE layers x experts) differs from the "
    "partition's",
    "no_signature": "the signature service had no expert counts for the request",
    "signature_timeout": "the signature service did not answer in time",
    "signature_unavailable": "no signature service replica was running",
    "signature_error": "the signature service answered with an error",
    "empty_signature": "the request's signature was empty (no expert counts)",
    "no_live_worker_in_partition": "none of the partition's workers was live",
    "no_centroid": "no live worker had a centroid in the partition",
}


@dataclass(frozen=True)
class Candidate:
    worker: str
    score: float | None
    """Locality score (None: not recorded and no partition to recompute it)."""
    load: float
    """The policy's load measure."""
    in_flight: int | None
    kv_tokens: int | None
    in_band: bool
    chosen: bool
    union: float | None = None
    """Its predicted expert union per step (U), where the decision recorded it."""
    added: float | None = None
    """What the request adds to that union (dU), where the decision recorded it."""
    cost: float | None = None
    """The cost the decision's scorers gave it (re-run on the recorded inputs)."""


@dataclass(frozen=True)
class Explanation:
    request_id: str
    worker_id: str
    router_id: str
    ts_s: float
    decide_s: float
    model: str
    prompt_tokens: int | None
    signature_activations: int | None
    missing_blocks: int
    policy: str
    params: dict[str, float | int | str]
    partition_version: int | None
    scores_from: str
    candidates: list[Candidate]
    band: list[str]
    band_reason: str
    winner_reason: str
    load_only_worker: str
    load_only_reason: str
    fallback: str | None
    fallback_reason: str
    replay: str
    decode: str
    rng_seed: int | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def render(self) -> str:
        unit = LOAD_UNITS.get(str(self.params.get("load_measure", "requests")), "load")
        lines = [f"Request {self.request_id} went to decode worker {self.worker_id}."]
        sig = (
            "no signature"
            if self.signature_activations is None
            else f"signature of {self.signature_activations:,} expert activations"
        )
        prompt = "" if self.prompt_tokens is None else f"{self.prompt_tokens:,} prompt tokens, "
        lines.append(
            f"  router {self.router_id}, {format_ts(self.ts_s)}, decided in "
            f"{self.decide_s * 1e3:.2f} ms; model {self.model}; {prompt}{sig}"
            f"{f' ({self.missing_blocks} blocks missing)' if self.missing_blocks else ''}"
        )
        params = ", ".join(f"{k} {v}" for k, v in sorted(self.params.items())) or "no parameters"
        version = (
            "no partition"
            if self.partition_version is None
            else f"partition version {self.partition_version}"
        )
        lines.append(f"  policy {self.policy} ({params}); {version}")
        lines.append("")
        lines.append(
            f"Candidates (score: cosine similarity of the request's signature to the worker's "
            f"nearest centroid, {self.scores_from}; load: {unit}):"
        )
        has_fleet = any(c.in_flight is not None for c in self.candidates)
        has_cost = any(c.cost is not None for c in self.candidates)
        header = f"  {'worker':<16} {'score':>7}"
        header += f" {'in-flight':>10} {'KV tokens':>10}" if has_fleet else f" {'load':>10}"
        if has_cost:
            header += f" {'U':>8} {'dU':>7} {'cost':>9}"
        lines.append(header)
        for c in self.candidates:
            score = "-" if c.score is None else f"{c.score:.3f}"
            row = f"  {c.worker:<16} {score:>7}"
            if has_fleet:
                row += f" {c.in_flight or 0:>10,} {c.kv_tokens or 0:>10,}"
            else:
                row += f" {c.load:>10,.0f}"
            if has_cost:
                row += (
                    f" {'-' if c.union is None else f'{c.union:.2f}':>8}"
                    f" {'-' if c.added is None else f'{c.added:.3f}':>7}"
                    f" {'-' if c.cost is None else f'{c.cost:.2f}':>9}"
                )
            marks = [m for m, on in (("in band", c.in_band), ("chosen", c.chosen)) if on]
            lines.append(row + ("   " + ", ".join(marks) if marks else ""))
        lines.append("")
        lines.append(f"Band: {self.band_reason}")
        lines.append(f"Winner: {self.winner_reason}")
        lines.append(f"Load-only: {self.load_only_reason}")
        lines.append(f"Fallback: {self.fallback_reason}")
        lines.append(f"Replay: {self.replay}")
        lines.append(f"Decode: {self.decode}")
        return "\n".join(lines)


def _fmt(load: float, unit: str) -> str:
    if unit.endswith("requests") and load == 1:
        unit = unit[: -len("s")]
    return f"{load:,.0f} {unit}"


def explain(
    d: Decision,
    partition: Partition | None = None,
    summary: DecodeSummary | None = None,
) -> Explanation:
    """Explain `d`. `partition`: the version `d` used (lets every candidate's score be
    recomputed and the decision be replayed); `summary`: the request's decode summary."""
    routing = recorded_profile(d)
    workers, in_flight, kv = recorded_fleet(d)
    measure = "requests" if routing is None else routing.measure
    unit = LOAD_UNITS[measure]
    load = in_flight if measure == "requests" else kv
    usable = (
        partition if partition is not None and partition.version == d.partition_version else None
    )
    rerun = _rerun(d, routing, usable)
    choice = None if rerun is None or rerun.outcome is None else rerun.outcome.choice
    scores, scores_from = _scores(d, usable, workers)
    band = set(d.band)
    terms = {row[0]: (row[4], row[5]) for row in d.considered}
    cost_of: dict[str, float] = {}
    # Costs re-run without the activity terms the router read (records before v4) would
    # not be the ones that chose the worker: shown only where the record holds them.
    recorded_terms = bool(d.considered) or not (routing is not None and routing.uses_activity)
    if choice is not None and choice.costs is not None and recorded_terms:
        cost_of = {workers[i]: float(c) for i, c in zip(choice.scored, choice.costs, strict=True)}
    exact_loads = bool(d.fleet or d.considered)
    candidates = [
        Candidate(
            worker=w,
            score=scores.get(w),
            load=float(load[i]),
            in_flight=int(in_flight[i]) if exact_loads else None,
            kv_tokens=int(kv[i]) if exact_loads else None,
            in_band=w in band,
            chosen=w == d.worker_id,
            union=terms.get(w, (None, None))[0],
            added=terms.get(w, (None, None))[1],
            cost=cost_of.get(w),
        )
        for i, w in enumerate(workers)
    ]
    candidates.sort(
        key=lambda c: (c.score is None, -(c.score or 0.0), not c.in_band, c.load, c.worker)
    )
    load_of = {w: float(load[i]) for i, w in enumerate(workers)}
    locality = routing is not None and routing.uses_signature and d.fallback is None
    locality = locality and bool(d.band)
    jsq_worker, jsq_ties = _jsq(d, workers, in_flight, kv, measure)
    if jsq_worker == d.worker_id:
        load_only = (
            f"a load-only router (JSQ on {unit}) would have chosen {jsq_worker} as well "
            f"({_fmt(load_of[jsq_worker], unit)})"
        )
    else:
        load_only = (
            f"a load-only router (JSQ on {unit}) would have chosen {jsq_worker} "
            f"({_fmt(load_of[jsq_worker], unit)}) instead of {d.worker_id} "
            f"({_fmt(load_of.get(d.worker_id, 0.0), unit)})"
        )
    if len(jsq_ties) > 1:
        load_only += f"; {', '.join(jsq_ties)} tie for the least load and the same seeded draw "
        load_only += f"picks {jsq_worker}"
    load_only += "."
    if d.fallback is None:
        fallback_reason = "none."
    else:
        why = FALLBACK_TEXT.get(d.fallback, "see the router's logs")
        fallback_reason = (
            f"{d.fallback}: {why}; so the request was routed load-only (JSQ on {unit})."
        )
    same_band = choice is not None and tuple(workers[i] for i in choice.band) == tuple(d.band)
    return Explanation(
        request_id=d.request_id,
        worker_id=d.worker_id,
        router_id=d.router_id,
        ts_s=d.ts_s,
        decide_s=d.decide_s,
        model=d.model,
        prompt_tokens=d.prompt_tokens,
        signature_activations=None
        if d.signature is None
        else int(d.signature.values().astype(np.int64).sum()),
        missing_blocks=d.missing_blocks,
        policy=d.policy,
        params=dict(d.params) if routing is None else routing.params(),
        partition_version=d.partition_version,
        scores_from=scores_from,
        candidates=candidates,
        band=list(d.band),
        band_reason=(
            _band_reason(d, routing, choice, workers, scores, load_of)
            if locality and choice is not None and choice.rule is not None and same_band
            else _band_as_recorded(d, usable)
            if locality
            else _no_band(d, routing)
        ),
        winner_reason=_winner_reason(d, routing, choice, workers, load_of, unit, locality, cost_of),
        load_only_worker=jsq_worker,
        load_only_reason=load_only,
        fallback=d.fallback,
        fallback_reason=fallback_reason,
        replay=_replay(d, routing, usable, rerun),
        decode=_decode(d, summary),
        rng_seed=d.rng_seed,
    )


def _rerun(
    d: Decision, routing: ProfileBase | None, partition: Partition | None
) -> Reproduction | None:
    """The decision re-run on its recorded inputs (None: it cannot be on its own: an
    unknown policy, or one that follows its previous decision)."""
    if routing is None or routing.stateful:
        return None
    if d.partition_version is not None and partition is None:
        return None
    return reproduce_decision(d, partition, DecisionRng())


def _scores(
    d: Decision, partition: Partition | None, workers: tuple[str, ...]
) -> tuple[dict[str, float], str]:
    recorded = {w: s for w, s in d.scores}
    if partition is None or d.signature is None or partition.model != d.model:
        if recorded:
            return recorded, f"as recorded (the best {len(recorded)})"
        return {}, "none recorded"
    cal = partition.calibration
    if d.signature.shape != [cal.num_moe_layers, cal.num_experts]:
        return recorded, f"as recorded (the best {len(recorded)})"
    per_worker = partition.scores_for(d.signature.to_dense(np.uint32), workers)
    out = {w: float(s) for w, s in zip(workers, per_worker, strict=True) if np.isfinite(s)}
    return out, f"recomputed from partition version {partition.version}"


def _no_band(d: Decision, routing: ProfileBase | None) -> str:
    if routing is not None and routing.uses_activity and d.fallback is None:
        return f"none: {d.policy} weighs every live worker by predicted step cost (no band)."
    if routing is not None and (routing.uses_signature or routing.uses_activity):
        return "none: the policy could not score the request (see Fallback)."
    return f"none: {d.policy} is a load-only policy (it ignores signatures)."


def _band_as_recorded(d: Decision, partition: Partition | None) -> str:
    """The band when the decision cannot be re-run (or came out otherwise)."""
    if d.partition_version is not None and partition is None:
        why = f"partition version {d.partition_version} is not available"
    else:
        why = "re-running the decision gives another band (see Replay)"
    return f"{', '.join(d.band)} as recorded ({why}, so how the rule built it is not shown)."


def _band_reason(
    d: Decision,
    routing: ProfileBase | None,
    choice: Choice,
    workers: tuple[str, ...],
    scores: dict[str, float],
    load_of: dict[str, float],
) -> str:
    """How the band rule built the band, as the re-run decision computed it."""
    rule: BandTrace | None = choice.rule
    assert rule is not None
    names = [workers[i] for i in choice.band]
    newcomers = [workers[i] for i in rule.newcomers]
    scored_band = [w for w in names if w not in newcomers]
    eligible_note = ""
    over = {workers[i] for i in rule.over_bound}
    ceiling = (
        None
        if routing is None
        else next((f for f in routing.pipeline.filters if isinstance(f, LoadCeiling)), None)
    )
    if rule.bound is not None and ceiling is not None:
        excluded = f" (not: {', '.join(sorted(over))})" if over else ""
        eligible_note = (
            f"Only workers with load <= (1 + slack {ceiling.slack:g}) x mean + 1 = "
            f"{rule.bound:.1f} were eligible{excluded}. "
        )
    best_worker, best, tau = workers[rule.best], rule.best_score, rule.tau
    threshold = best - tau
    if tau == 0:
        text = (
            f"tau is 0, so the band holds only the best-scoring worker(s): "
            f"{', '.join(scored_band)} (score {best:.3f})."
        )
    elif rule.widened_to:
        text = (
            f"only {best_worker} scored within tau {tau:g} of the best ({best:.3f}, "
            f"threshold {threshold:.3f}); when tau > 0 and a single worker qualifies, the band "
            f"widens to the {rule.widened_to} best-scoring workers (equal scores in worker "
            f"order): {', '.join(scored_band)}."
        )
    else:
        text = (
            f"the best score was {best:.3f} ({best_worker}); tau {tau:g} keeps every worker "
            f"scoring at least {threshold:.3f}: {', '.join(scored_band)}."
        )
    outside = sorted(
        ((w, x) for w, x in scores.items() if w not in names and w not in over),
        key=lambda item: -item[1],
    )
    if outside:
        w, x = outside[0]
        text += f" Closest outside: {w} at {x:.3f}, {threshold - x:.3f} below the threshold."
    if newcomers:
        text += (
            f" {', '.join(newcomers)} had no centroid in partition {d.partition_version} "
            "(joined after the fit) and was less loaded than every scored band member, so it "
            "joined the band."
        )
    return eligible_note + text


def _winner_reason(
    d: Decision,
    routing: ProfileBase | None,
    choice: Choice | None,
    workers: tuple[str, ...],
    load_of: dict[str, float],
    unit: str,
    locality: bool,
    cost_of: dict[str, float],
) -> str:
    w = d.worker_id
    seed = "no recorded seed" if d.rng_seed is None else f"rng seed {d.rng_seed}"
    if routing is not None and routing.uses_activity and d.fallback is None and cost_of:
        where = "in the band" if locality else f"among all {len(cost_of)} live workers"
        nearest = sorted((c, x) for x, c in cost_of.items() if x != w)[:3]
        shown = ", ".join(f"{x} {c:.2f}" for c, x in nearest)
        tie = ""
        if choice is not None and len(choice.tied) > 1:
            tied = ", ".join(workers[i] for i in choice.tied)
            tie = f"; {tied} tied and the decision's seeded draw ({seed}) picked {w}"
        return (
            f"{w} adds the least predicted decode-step cost {where}: "
            f"U + (n + 1) dU = {cost_of.get(w, float('nan')):.2f} expert loads per step "
            f"(its expert union per step now, plus what the request adds to it for itself "
            f"and each of its n in-flight requests){f'; next: {shown}' if shown else ''}"
            f"{tie}."
        )
    if routing is not None and routing.uses_activity and d.fallback is None:
        return (
            f"{d.policy} sent it where it adds the least predicted decode-step cost (the "
            "worker's expert union per step plus, for the worker's in-flight requests and "
            "itself, what it adds to that union); the record holds the loads but not the "
            "router's activity table, so the per-worker costs are not shown."
        )
    match routing:
        case RoundRobinProfile():
            return f"round-robin: {w} was next in router {d.router_id}'s cycle."
        case RandomProfile():
            return f"random: {w} was drawn uniformly among {len(load_of)} live workers ({seed})."
        case P2cProfile():
            return (
                f"power of two choices: two workers drawn at random ({seed}), the less loaded "
                f"taken: {w} ({_fmt(load_of.get(w, 0.0), unit)})."
            )
    # A least-load pick: the tie the re-run decision found, else the record's.
    if choice is not None and choice.tied and workers[choice.index] == w:
        ties = tuple(workers[i] for i in choice.tied)
    else:
        ties = least_loaded_candidates(d)
    where = "in the band" if locality else f"among all {len(load_of)} live workers"
    if locality and len(d.band) == 1:
        return f"{w} was the only worker in the band."
    if len(ties) == 1:
        others = sorted(
            ((x, load_of[x]) for x in (d.band if locality else load_of) if x != w),
            key=lambda x: x[1],
        )[:4]
        shown = ", ".join(f"{x} {v:,.0f}" for x, v in others)
        return (
            f"{w} had the least load {where}: {_fmt(load_of.get(w, 0.0), unit)}"
            f"{f' (next: {shown})' if shown else ''}."
        )
    draw = (
        f"the decision's seeded draw ({seed}) picked {w}; a replay re-creates that draw"
        if d.rng_seed is not None
        else f"the tie was broken at random ({seed}: this record predates it, so a replay "
        "cannot re-create the draw)"
    )
    return (
        f"{', '.join(ties)} tied for the least load {where} "
        f"({_fmt(load_of.get(w, 0.0), unit)}); {draw}."
    )


def _jsq(
    d: Decision,
    workers: tuple[str, ...],
    in_flight: np.ndarray,
    kv: np.ndarray,
    measure: str,
) -> tuple[str, tuple[str, ...]]:
    """What JSQ on the same loads picks (with the decision's seed) and the tied workers,
    through the router's decision function."""
    jsq = make_policy(
        JsqProfile(load_measure="kv_tokens" if measure == "kv_tokens" else "requests")
    )
    decided = decide_view(
        jsq,
        workers=workers,
        in_flight=in_flight,
        kv_tokens=kv,
        rng=DecisionRng().seeded(d.rng_seed or 0),
    )
    return workers[decided.index], tuple(workers[i] for i in decided.choice.tied)


def _replay(
    d: Decision,
    routing: ProfileBase | None,
    partition: Partition | None,
    rerun: Reproduction | None,
) -> str:
    if routing is not None and routing.uses_activity and not d.considered:
        return (
            f"not checked alone: {d.policy} also reads the router's activity table, which "
            "records before v4 do not hold (`eldr replay` rebuilds it from the window)."
        )
    if routing is not None and routing.stateful:
        return "round-robin depends on the router's previous decision: replay the window."
    if d.partition_version is not None and partition is None:
        return f"not checked: partition version {d.partition_version} is not available."
    result = rerun or reproduce_decision(d, partition, DecisionRng())
    if result.status == "reproduced":
        return f"re-running the decision on its recorded inputs gives {d.worker_id}: reproduced."
    return f"{result.status}: {result.detail}."


def _decode(d: Decision, summary: DecodeSummary | None) -> str:
    if summary is None:
        return "no decode summary recorded for this request."
    tpot = "" if summary.tpot_s is None else f", TPOT {summary.tpot_s * 1e3:.2f} ms"
    duration = summary.ts_s - d.ts_s
    return (
        f"decoded {summary.tokens:,} tokens on {summary.worker_id}{tpot}; finished "
        f"{duration:.2f} s after the decision."
    )
