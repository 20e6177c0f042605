"""The routing pipeline: every profile runs through one runner, the old rules decide exactly
as their own classes did, the stages do what they say, and policies can be given as data."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from eldr.core.routing.activity import ActivityTable, RecordedActivity, request_expert_demand
from eldr.core.routing.decide import DecisionRng, decide_view
from eldr.core.routing.pipeline import FleetView, PipelinePolicy, make_policy
from eldr.core.routing.profile import (
    DEFAULT_PROFILE,
    AllLive,
    Band,
    Cheapest,
    EldrBandCostProfile,
    EldrBoundedProfile,
    EldrProfile,
    JsqProfile,
    LoadCeiling,
    LoadCost,
    MarginalUnionCost,
    NearestCentroids,
    PipelineProfile,
    decode_profile,
    encode_profile,
)
from eldr.core.routing.stages import band, cheapest, nearest, under_ceiling, with_newcomers

FIXTURE = Path(__file__).parent / "fixtures" / "pre_pipeline_choices.json.gz"
L, E = 2, 8


def _case_view(case: dict[str, Any], policy: PipelinePolicy) -> dict[str, Any]:
    table = ActivityTable(ttl_s=1e9)
    for k, (w, cnt) in enumerate(case["activity"]):
        counts = np.array(cnt, dtype=np.uint32)
        table.add(w, f"e{k}", request_expert_demand(counts, int(counts.sum() or 1)), 0.0)
    demand = None
    if case["with_demand"]:
        top_k, prior = policy.profile.demand_model
        rc = np.array(case["request_counts"], dtype=np.uint32)
        demand = request_expert_demand(rc, int(rc.sum()), top_k=top_k, prior_tokens=prior)
    workers = tuple(case["workers"])
    scores = None
    if case["scores"] is not None:
        scores = np.array([-np.inf if s is None else s for s in case["scores"]], dtype=np.float32)
    return {
        "workers": workers,
        "in_flight": np.array(case["in_flight"], dtype=np.int64),
        "kv_tokens": np.array(case["kv_tokens"], dtype=np.int64),
        "scores": scores,
        "has_centroid": None if case["has_centroid"] is None else np.array(case["has_centroid"]),
        "expert_miss": table.view(workers) if demand is not None else None,
        "demand": demand,
    }


def test_decisions_recorded_with_the_old_policy_classes_come_out_the_same() -> None:
    """840 decisions of the seven rules (baselines, band, bounded band, cost-aware with and
    without a partition bonus) made by the policy classes before the pipeline (commit
    24fafeb): the pipeline picks the same worker, builds the same band and ties, computes
    the same costs to the bit and draws the same numbers from the decision's generator."""
    cases = json.loads(gzip.decompress(FIXTURE.read_bytes()))["cases"]
    assert len(cases) == 840
    rngs = DecisionRng()
    policies: dict[str, PipelinePolicy] = {}
    for case in cases:
        key = json.dumps(case["profile"], sort_keys=True)
        if key not in policies:  # one per profile: round-robin keeps its cursor
            policies[key] = make_policy(decode_profile(json.dumps(case["profile"])))
        policy = policies[key]
        rng = rngs.seeded(case["seed"])
        decided = decide_view(policy, rng=rng, **_case_view(case, policy))
        choice, want = decided.choice, case["expect"]
        got = {
            "index": choice.index,
            "band": list(choice.band),
            "tied": list(choice.tied),
            "fallback": decided.fallback,
            "next_draw": int(rng.integers(1 << 62)),
        }
        assert got == {k: want[k] for k in got}, case["profile"]
        if want["costs"] is not None:
            assert choice.costs is not None
            assert [float(x).hex() for x in choice.costs] == want["costs"]
        if want["rule"] is not None:
            assert choice.rule is not None
            rule = choice.rule
            assert (rule.best, list(rule.within), rule.widened_to, list(rule.newcomers)) == (
                want["rule"]["best"],
                want["rule"]["within"],
                want["rule"]["widened_to"],
                want["rule"]["newcomers"],
            )
            assert (rule.bound, list(rule.over_bound)) == (
                want["rule"]["bound"],
                want["rule"]["over_bound"],
            )


# --- stages ---------------------------------------------------------------------------------


def test_nearest_keeps_the_k_best_scores_and_every_worker_without_a_centroid() -> None:
    scores = np.array([0.2, -np.inf, 0.9, 0.5, 0.9, -np.inf], dtype=np.float32)
    has = np.array([True, False, True, True, True, True])
    cand, newcomers = nearest(scores, has, 2)
    assert cand.tolist() == [1, 2, 4]  # the two 0.9s (ties by index) and the newcomer
    assert newcomers.tolist() == [1]
    cand, _ = nearest(scores, None, 10)
    assert cand.tolist() == [0, 2, 3, 4]


def test_the_ceiling_drops_the_overloaded_unless_nothing_scored_would_stay() -> None:
    loads = np.array([1, 9, 2, 2])
    scores = np.array([0.9, 0.8, -np.inf, 0.1], dtype=np.float32)
    kept = under_ceiling(np.arange(4), loads, 3.0, scores)
    assert kept is not None
    assert kept[0].tolist() == [0, 2, 3]
    assert kept[1].tolist() == [1]
    # Only an unscored worker would stay: the ceiling is skipped.
    assert under_ceiling(np.array([1, 2]), loads, 3.0, scores) is None


def test_the_band_widens_a_single_member_and_lets_in_the_less_loaded_newcomers() -> None:
    scores = np.array([0.95, 0.7, 0.6, -np.inf], dtype=np.float32)
    members, within, best = band(scores, np.arange(4), 0.1, 2)
    assert (members.tolist(), within.tolist(), best) == ([0, 1], [0], 0)
    has = np.array([True, True, True, False])
    loads = np.array([3, 4, 0, 1])
    assert with_newcomers(members, np.arange(4), has, loads).tolist() == [0, 1, 3]
    assert with_newcomers(members, np.arange(4), has, np.array([3, 4, 0, 5])).tolist() == [0, 1]


def test_cheapest_draws_among_ties_within_the_tolerance() -> None:
    cost = np.array([2.0, 1.0, 1.0 + 1e-12, 3.0])
    scored = np.array([4, 5, 6, 7])
    picks = {cheapest(cost, scored, 1e-9, np.random.default_rng(s))[0] for s in range(40)}
    assert picks == {5, 6}
    assert cheapest(cost, scored, 0.0, np.random.default_rng(0))[0] == 5


# --- the default -----------------------------------------------------------------------------


def _view(
    loads: list[int],
    scores: list[float],
    table: ActivityTable | None = None,
    counts: np.ndarray | None = None,
) -> FleetView:
    workers = tuple(f"w{i}" for i in range(len(loads)))
    demand = None
    if counts is not None:
        demand = request_expert_demand(counts, int(counts.sum()))
    return FleetView(
        workers=workers,
        in_flight=np.array(loads, dtype=np.int64),
        kv_tokens=np.zeros(len(loads), dtype=np.int64),
        scores=np.array(scores, dtype=np.float32),
        expert_miss=None if table is None else table.view(workers),
        demand=demand,
    )


def counts_on(*experts: int) -> np.ndarray:
    c = np.zeros((L, E), dtype=np.uint32)
    for e in experts:
        c[:, e] = 4
    return c


def test_the_default_joins_the_band_member_whose_batch_already_runs_its_experts() -> None:
    table = ActivityTable()
    table.add("w0", "a", request_expert_demand(counts_on(6, 7), 8), 0.0)
    table.add("w1", "b", request_expert_demand(counts_on(1, 2), 8), 0.0)
    view = _view([1, 1, 0], [0.9, 0.88, 0.2], table, counts_on(1, 2))
    choice = make_policy(DEFAULT_PROFILE).choose(view, np.random.default_rng(0))
    assert choice.band == (0, 1)  # w2 scores outside the band
    assert choice.index == 1  # w1 runs the same experts: it costs least to join
    assert choice.scored == (0, 1)
    assert choice.activity is not None
    assert choice.activity[1][1] < choice.activity[1][0]  # dU on w1 < dU on w0


def test_the_default_keeps_an_overloaded_worker_out_of_its_band() -> None:
    table = ActivityTable()
    for k in range(6):
        table.add("w1", f"b{k}", request_expert_demand(counts_on(1, 2), 8), 0.0)
    view = _view([0, 6, 0, 0], [0.5, 0.95, 0.9, 0.1], table, counts_on(1, 2))
    choice = make_policy(DEFAULT_PROFILE).choose(view, np.random.default_rng(0))
    assert choice.rule is not None
    assert choice.rule.bound == pytest.approx(1.2 * 1.5 + 1)  # mean 1.5, slack 0.2
    assert choice.rule.over_bound == (1,)
    assert 1 not in choice.band
    assert choice.index == 2  # the best eligible centroid


def test_the_default_reads_only_its_nearest_candidates() -> None:
    n = 40
    scores = np.linspace(0.0, 0.99, n).astype(np.float32)
    view = _view([0] * n, scores.tolist(), None, counts_on(1))
    policy = make_policy(EldrBandCostProfile(nearest=4))
    choice = policy.choose(view, np.random.default_rng(0))
    assert choice.candidates == (36, 37, 38, 39)
    assert set(choice.scored) <= set(choice.candidates)


def test_recorded_activity_reproduces_the_marginal_union() -> None:
    table = ActivityTable()
    table.add("w0", "a", request_expert_demand(counts_on(6, 7), 8), 0.0)
    table.add("w1", "b", request_expert_demand(counts_on(1, 2), 8), 0.0)
    live = _view([1, 1, 0], [0.9, 0.88, 0.2], table, counts_on(1, 2))
    policy = make_policy(DEFAULT_PROFILE)
    first = policy.choose(live, np.random.default_rng(0))
    assert first.activity is not None
    union = np.full(3, np.nan)
    added = np.full(3, np.nan)
    union[list(first.scored)], added[list(first.scored)] = first.activity
    replayed = FleetView(
        workers=live.workers,
        in_flight=live.in_flight,
        kv_tokens=live.kv_tokens,
        scores=live.scores,
        expert_miss=RecordedActivity((L, E), union, added),
        demand=live.demand,
    )
    again = policy.choose(replayed, np.random.default_rng(0))
    assert again.index == first.index
    assert again.costs is not None
    assert first.costs is not None
    assert again.costs.tobytes() == first.costs.tobytes()


# --- policies as data -----------------------------------------------------------------------


def test_a_pipeline_profile_routes_as_the_named_profile_it_spells_out() -> None:
    spelled = PipelineProfile(
        filters=(LoadCeiling(slack=0.1), Band(tau=0.1, widen_to=2)),
        scorers=(LoadCost(),),
    )
    named = EldrBoundedProfile()
    assert spelled.pipeline == named.pipeline
    rng_a, rng_b = np.random.default_rng(3), np.random.default_rng(3)
    for seed in range(30):
        r = np.random.default_rng(seed)
        view = _view(r.integers(0, 5, 6).tolist(), r.random(6).tolist())
        assert make_policy(spelled).choose(view, rng_a) == make_policy(named).choose(view, rng_b)


def test_a_pipeline_profile_round_trips_as_json_and_refuses_unknown_stages() -> None:
    p = decode_profile(
        '{"policy": "pipeline", "candidates": {"stage": "nearest", "k": 8},'
        ' "filters": [{"stage": "band", "tau": 0.2}],'
        ' "scorers": [{"stage": "marginal_union"}, {"stage": "load", "weight": 5}]}'
    )
    assert isinstance(p, PipelineProfile)
    assert p.pipeline.candidates == NearestCentroids(k=8)
    assert p.pipeline.scorers == (MarginalUnionCost(), LoadCost(weight=5.0))
    assert p.pipeline.picker == Cheapest()
    assert decode_profile(encode_profile(p)) == p
    assert (p.uses_signature, p.uses_activity, p.fleet_scale) == (True, True, True)
    with pytest.raises(ValueError, match="stage"):
        decode_profile('{"policy": "pipeline", "filters": [{"stage": "domain"}]}')
    with pytest.raises(ValueError, match="tau"):
        decode_profile('{"policy": "pipeline", "filters": [{"stage": "band", "tau": -1}]}')


def test_the_named_profiles_are_pipelines() -> None:
    assert JsqProfile().pipeline.candidates == AllLive()
    assert EldrProfile().pipeline.filters == (Band(),)
    assert DEFAULT_PROFILE.pipeline.describe() == (
        "nearest(k 16) | load_ceiling(slack 0.2) | band(tau 0.1, widen_to 2) | "
        "marginal_union(weight 1) | cheapest(tolerance 1e-09)"
    )
    assert msgspec.json.decode(encode_profile(DEFAULT_PROFILE))["policy"] == "eldr_band_cost"
