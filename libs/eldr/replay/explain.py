"""One routing decision in plain words (`eldr explain`).

From a recorded `Decision` (and, when available, the partition version it used and the
request's decode profile): the candidates with their scores and loads, why the locality
band held the workers it held (best score, tau, the widening rule), why the winner won
(least load in the band, and how a tie was broken), what a load-only router (JSQ on the
same loads) would have chosen, any fallback and its reason, and whether replaying the
record gives the same decision. Pure: the caller fetches the records.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from eldr.core.partition.partition import Partition
from eldr.core.routing.decide import DecisionRng
from eldr.core.routing.policies import FleetView, JoinShortestQueue
from eldr.replay.engine import (
    PolicyConfig,
    least_loaded_candidates,
    recorded_fleet,
    recorded_policy,
    reproduce_decision,
)
from eldr.replay.eventlog import format_ts
from eldr.wire import Decision, DecodeProfile

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
        header = f"  {'worker':<16} {'score':>7}"
        header += f" {'in-flight':>10} {'KV tokens':>10}" if has_fleet else f" {'load':>10}"
        lines.append(header)
        for c in self.candidates:
            score = "-" if c.score is None else f"{c.score:.3f}"
            row = f"  {c.worker:<16} {score:>7}"
            if has_fleet:
                row += f" {c.in_flight or 0:>10,} {c.kv_tokens or 0:>10,}"
            else:
                row += f" {c.load:>10,.0f}"
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
    profile: DecodeProfile | None = None,
) -> Explanation:
    """Explain `d`. `partition`: the version `d` used (lets every candidate's score be
    recomputed and the decision be replayed); `profile`: the request's decode profile."""
    config = recorded_policy(d)
    workers, in_flight, kv = recorded_fleet(d)
    measure = config.load_measure
    unit = LOAD_UNITS[measure]
    load = in_flight if measure == "requests" else kv
    usable = (
        partition if partition is not None and partition.version == d.partition_version else None
    )
    scores, scores_from = _scores(d, usable, workers)
    band = set(d.band)
    candidates = [
        Candidate(
            worker=w,
            score=scores.get(w),
            load=float(load[i]),
            in_flight=int(in_flight[i]) if d.fleet else None,
            kv_tokens=int(kv[i]) if d.fleet else None,
            in_band=w in band,
            chosen=w == d.worker_id,
        )
        for i, w in enumerate(workers)
    ]
    candidates.sort(
        key=lambda c: (c.score is None, -(c.score or 0.0), not c.in_band, c.load, c.worker)
    )
    load_of = {w: float(load[i]) for i, w in enumerate(workers)}
    _, activity = config.flags
    locality = config.uses_band and d.fallback is None and bool(d.band)
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
        params=dict(d.params),
        partition_version=d.partition_version,
        scores_from=scores_from,
        candidates=candidates,
        band=list(d.band),
        band_reason=(
            _band_reason(d, config, scores, load_of, usable)
            if locality
            else _no_band(d, config, activity)
        ),
        winner_reason=_winner_reason(d, config, load_of, unit, locality, activity),
        load_only_worker=jsq_worker,
        load_only_reason=load_only,
        fallback=d.fallback,
        fallback_reason=fallback_reason,
        replay=_replay(d, usable, activity),
        decode=_decode(d, profile),
        rng_seed=d.rng_seed,
    )


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


def _no_band(d: Decision, config: PolicyConfig, activity: bool) -> str:
    if activity and d.fallback is None:
        return f"none: {d.policy} weighs every live worker by predicted step cost (no band)."
    if config.uses_band or activity:
        return "none: the policy could not score the request (see Fallback)."
    return f"none: {d.policy} is a load-only policy (it ignores signatures)."


def _band_reason(
    d: Decision,
    config: PolicyConfig,
    scores: dict[str, float],
    load_of: dict[str, float],
    partition: Partition | None,
) -> str:
    extra = dict(config.extra)
    widen_to = int(extra.get("widen_to", 2))
    eligible_note = ""
    if "slack" in extra and load_of:
        # eldr_bounded: the band is taken over the workers within the load bound only
        bound = (1.0 + extra["slack"]) * (sum(load_of.values()) / len(load_of)) + 1.0
        over = sorted(w for w, x in load_of.items() if x > bound)
        scores = {w: s for w, s in scores.items() if load_of.get(w, 0.0) <= bound}
        excluded = f" (not: {', '.join(over)})" if over else ""
        eligible_note = (
            f"Only workers with load <= (1 + slack {extra['slack']:g}) x mean + 1 = {bound:.1f} "
            f"were eligible{excluded}. "
        )
    newcomers = [
        w for w in d.band if partition is not None and not partition.owns(w) and w not in scores
    ]
    ranked = sorted(((w, x) for w, x in scores.items() if w not in newcomers), key=lambda x: -x[1])
    if not ranked:
        return f"{eligible_note}{', '.join(d.band)} (no scores recorded)."
    best_worker, best = ranked[0]
    tau = config.tau
    threshold = best - tau
    within = [w for w, x in ranked if x >= threshold]
    scored_band = [w for w in d.band if w not in newcomers]
    outside = [(w, x) for w, x in ranked if w not in d.band]
    if tau == 0:
        text = (
            f"tau is 0, so the band holds only the best-scoring worker(s): "
            f"{', '.join(scored_band)} (score {best:.3f})."
        )
    elif len(within) == 1 and len(scored_band) > 1:
        text = (
            f"only {best_worker} scored within tau {tau:g} of the best ({best:.3f}, "
            f"threshold {threshold:.3f}); when tau > 0 and a single worker qualifies, the band "
            f"widens to the {widen_to} best-scoring workers (equal scores in worker order): "
            f"{', '.join(scored_band)}."
        )
    else:
        text = (
            f"the best score was {best:.3f} ({best_worker}); tau {tau:g} keeps every worker "
            f"scoring at least {threshold:.3f}: {', '.join(scored_band)}."
        )
    if outside:
        w, x = outside[0]
        text += f" Closest outside: {w} at {x:.3f}, {threshold - x:.3f} below the threshold."
    if newcomers:
        version = "" if partition is None else f" {partition.version}"
        text += (
            f" {', '.join(newcomers)} had no centroid in partition{version} (joined after the "
            "fit) and was less loaded than every scored band member, so it joined the band."
        )
    return eligible_note + text


def _winner_reason(
    d: Decision,
    config: PolicyConfig,
    load_of: dict[str, float],
    unit: str,
    locality: bool,
    activity: bool,
) -> str:
    w = d.worker_id
    seed = "no recorded seed" if d.rng_seed is None else f"rng seed {d.rng_seed}"
    if activity and d.fallback is None:
        return (
            f"{d.policy} sent it where it adds the least predicted decode-step cost (the "
            "worker's expert union per step plus, for the worker's in-flight requests and "
            "itself, what it adds to that union); the record holds the loads but not the "
            "router's activity table, so the per-worker costs are not shown."
        )
    if d.policy == "round_robin":
        return f"round-robin: {w} was next in router {d.router_id}'s cycle."
    if d.policy == "random":
        return f"random: {w} was drawn uniformly among {len(load_of)} live workers ({seed})."
    if d.policy == "p2c":
        return (
            f"power of two choices: two workers drawn at random ({seed}), the less loaded taken: "
            f"{w} ({_fmt(load_of.get(w, 0.0), unit)})."
        )
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
    """What JSQ on the same loads picks (with the decision's seed) and the tied workers."""
    policy = JoinShortestQueue(load_measure="requests" if measure == "requests" else "kv_tokens")
    view = FleetView(workers=workers, in_flight=in_flight, kv_tokens=kv)
    choice = policy.choose(view, DecisionRng().seeded(d.rng_seed or 0))
    load = view.load(policy.load_measure)
    ties = tuple(w for w, x in zip(workers, load, strict=True) if x == load.min())
    return workers[choice.index], ties


def _replay(d: Decision, partition: Partition | None, activity: bool) -> str:
    if activity:
        return (
            f"not checked alone: {d.policy} also reads the router's activity table, which "
            "the record does not hold (`eldr replay` rebuilds it from the window)."
        )
    if d.policy == "round_robin":
        return "round-robin depends on the router's previous decision: replay the window."
    if d.partition_version is not None and partition is None:
        return f"not checked: partition version {d.partition_version} is not available."
    result = reproduce_decision(d, partition, DecisionRng())
    if result.status == "reproduced":
        return f"re-running the decision on its recorded inputs gives {d.worker_id}: reproduced."
    return f"{result.status}: {result.detail}."


def _decode(d: Decision, profile: DecodeProfile | None) -> str:
    if profile is None:
        return "no decode profile recorded for this request."
    tpot = "" if profile.tpot_s is None else f", TPOT {profile.tpot_s * 1e3:.2f} ms"
    duration = profile.ts_s - d.ts_s
    return (
        f"decoded {profile.tokens:,} tokens on {profile.worker_id}{tpot}; finished "
        f"{duration:.2f} s after the decision."
    )
