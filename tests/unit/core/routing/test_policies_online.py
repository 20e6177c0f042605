"""Tail-safe locality: the cost-aware policy, the load-bounded band, newcomers in the band."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from eldr.core.routing.activity import ActivityTable, ActivityView, ExpertDemand, expert_demand
from eldr.core.routing.pipeline import FleetView, make_policy
from eldr.core.routing.profile import (
    DEFAULT_PROFILE,
    PAPER_PROFILE,
    PROFILE_TYPES,
    EldrBoundedProfile,
    EldrCostProfile,
    EldrProfile,
    profile_from_params,
)

L, E = 2, 8
RNG = np.random.default_rng(0)


def demand(*experts: int, tokens: int = 10, layers: int = L) -> ExpertDemand:
    counts = np.zeros((layers, E))
    for e in experts:
        counts[:, e] = tokens
    return expert_demand(counts)


def activity_view(
    batches: dict[str, list[tuple[int, ...]]], workers: tuple[str, ...], layers: int = L
) -> ActivityView:
    table = ActivityTable()
    n = 0
    for w, requests in batches.items():
        for experts in requests:
            table.add(w, f"r{n}", demand(*experts, layers=layers), 0.0)
            n += 1
    view = table.view(workers)
    assert view is not None
    return view


def cost_view(
    loads: list[int], miss: ActivityView | None, req: ExpertDemand | None, **kw: np.ndarray
) -> FleetView:
    n = np.array(loads, dtype=np.int64)
    return FleetView(
        workers=tuple(f"w{i}" for i in range(len(loads))),
        in_flight=n,
        kv_tokens=n * 10,
        expert_miss=miss,
        demand=req,
        **kw,
    )


def test_the_default_reads_partition_and_activity_and_the_paper_rule_stays_selectable() -> None:
    default = make_policy(DEFAULT_PROFILE)
    assert (default.uses_signature, default.uses_activity, default.fleet_scale) == (
        True,
        True,
        True,
    )
    paper = make_policy(PAPER_PROFILE)
    assert paper.profile == EldrProfile(tau=0.1)  # the paper's band width
    assert (paper.uses_signature, paper.uses_activity) == (True, False)


def test_every_profile_type_runs_through_the_one_pipeline() -> None:
    for profile_type in PROFILE_TYPES.values():
        assert make_policy(profile_type()).profile == profile_type()


def costs(view: FleetView) -> np.ndarray:
    """The cost-aware rule's cost of every worker of `view` (what its picker compares)."""
    choice = make_policy(EldrCostProfile()).choose(view, RNG)
    assert choice.costs is not None
    assert choice.scored == tuple(range(len(view.workers)))
    return choice.costs


def test_cost_aware_sends_a_request_where_its_experts_are_already_active() -> None:
    workers = ("w0", "w1")
    miss = activity_view({"w0": [(1,), (2,)], "w1": [(5,), (6,)]}, workers)
    choice = make_policy(EldrCostProfile()).choose(cost_view([2, 2], miss, demand(5)), RNG)
    assert choice.index == 1


def test_cost_aware_prefers_an_idle_worker_to_a_busy_one_with_other_experts() -> None:
    workers = ("w0", "w1")
    miss = activity_view({"w0": [(1,), (2,), (3,)]}, workers)
    choice = make_policy(EldrCostProfile()).choose(cost_view([3, 0], miss, demand(5)), RNG)
    assert choice.index == 1


counts_st = arrays(np.int64, (L, E), elements=st.integers(0, 6)).filter(lambda c: c.any())


@given(
    st.lists(st.tuples(counts_st, st.integers(0, 2)), max_size=6),
    counts_st,
    arrays(np.int64, (3,), elements=st.integers(0, 50)),
)
def test_cost_is_the_union_now_plus_what_every_request_pays_for_the_new_one(
    held: list[tuple[np.ndarray, int]], request: np.ndarray, loads: np.ndarray
) -> None:
    table = ActivityTable()
    workers = ("w0", "w1", "w2")
    for n, (counts, w) in enumerate(held):
        table.add(workers[w], f"r{n}", expert_demand(counts), 0.0)
    view = table.view(workers)
    req = expert_demand(request)
    if view is None:  # nothing held: no activity tracked yet
        cost = costs(cost_view(loads.tolist(), None, req))
        np.testing.assert_allclose(cost, (loads + 1) * req.probability().sum(), rtol=1e-12)
        return
    cost = costs(cost_view(loads.tolist(), view, req))
    miss, p = view.miss(), req.probability()
    for i in range(3):
        union = float((1.0 - miss[i]).sum())
        added = float((miss[i] * p).sum())
        assert cost[i] == pytest.approx(union + (loads[i] + 1) * added, rel=1e-9, abs=1e-9)


def test_cost_aware_without_a_signature_falls_back_to_jsq() -> None:
    choice = make_policy(EldrCostProfile()).choose(cost_view([4, 1, 3], None, None), RNG)
    assert (choice.index, choice.fallback) == (1, "no_signature")


def test_cost_aware_without_activity_is_least_loaded() -> None:
    choice = make_policy(EldrCostProfile()).choose(cost_view([4, 2, 3], None, demand(1)), RNG)
    assert choice.index == 1


def test_a_locality_weight_adds_the_partition_score_as_a_bonus() -> None:
    view = cost_view([0, 0], None, demand(1), scores=np.array([0.1, 0.9]))
    assert make_policy(EldrCostProfile(locality_weight=0.0)).wants_scores is False
    weighted = make_policy(EldrCostProfile(locality_weight=5.0))
    assert weighted.wants_scores is True
    assert weighted.choose(view, RNG).index == 1


def test_make_policy_reads_and_checks_extra_parameters() -> None:
    p = make_policy(profile_from_params("eldr_cost", {"locality_weight": 3.0, "top_k": 2}))
    assert p.profile == EldrCostProfile(locality_weight=3.0, top_k=2)
    b = make_policy(profile_from_params("eldr_bounded", {"slack": 0.5}))
    assert b.profile == EldrBoundedProfile(slack=0.5)
    with pytest.raises(ValueError, match="takes no parameter slack"):
        profile_from_params("eldr", {"slack": 0.5})
    with pytest.raises(ValueError, match="prior_tokens"):
        make_policy(EldrCostProfile(prior_tokens=0.0))


def band_view(loads: list[int], scores: list[float], has: list[bool] | None = None) -> FleetView:
    n = np.array(loads, dtype=np.int64)
    return FleetView(
        workers=tuple(f"w{i}" for i in range(len(loads))),
        in_flight=n,
        kv_tokens=n * 10,
        scores=np.array(scores),
        has_centroid=None if has is None else np.array(has),
    )


def test_a_worker_without_a_centroid_joins_the_band_while_it_is_least_loaded() -> None:
    # w2 joined after the partition was fitted: no centroid, so no score.
    view = band_view([5, 6, 0], [0.9, 0.85, -np.inf], [True, True, False])
    choice = make_policy(EldrProfile(tau=0.1)).choose(view, RNG)
    assert choice.index == 2
    assert 2 in choice.band


def test_a_worker_without_a_centroid_stays_out_once_it_is_as_loaded_as_the_band() -> None:
    view = band_view([5, 6, 5], [0.9, 0.85, -np.inf], [True, True, False])
    choice = make_policy(EldrProfile(tau=0.1)).choose(view, RNG)
    assert choice.index == 0
    assert 2 not in choice.band


def test_the_bounded_band_skips_members_loaded_beyond_the_bound() -> None:
    # w0 is the best match but holds far more than the mean: its neighbour w1 takes it.
    view = band_view([30, 10, 10, 10], [0.95, 0.9, 0.2, 0.1])
    assert make_policy(EldrProfile(tau=0.0, widen_to=1)).choose(view, RNG).index == 0
    assert (
        make_policy(EldrBoundedProfile(tau=0.0, widen_to=1, slack=0.1)).choose(view, RNG).index == 1
    )


def test_fleet_view_checks_the_activity_shapes() -> None:
    with pytest.raises(ValueError, match="expert_miss has 3 rows"):
        cost_view([1, 1], activity_view({"w0": [(1,)]}, ("w0", "w1", "w2")), demand(1))
    with pytest.raises(ValueError, match="the demand"):
        cost_view([1, 1], activity_view({"w0": [(1,)]}, ("w0", "w1"), layers=L + 1), demand(1))
    with pytest.raises(ValueError, match="has_centroid"):
        band_view([1, 1], [0.1, 0.2], [True])
