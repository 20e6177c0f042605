"""The simulator with workers joining and leaving, partition swaps, and worker activity."""

from __future__ import annotations

import numpy as np
import pytest

from eldr.core.costmodel import Deployment, GpuSpec, ModelSpec
from eldr.core.routing.activity import expert_demand
from eldr.core.routing.pipeline import make_policy
from eldr.core.routing.profile import EldrCostProfile, EldrProfile, JsqProfile, RoundRobinProfile
from eldr.sim.cluster import (
    FleetEvent,
    ScoreUpdate,
    SimConfig,
    SimObservation,
    SimRequest,
    flatten_decode_ids,
    simulate,
)

E, L = 8, 2


def deployment() -> Deployment:
    gpu = GpuSpec("g", hbm_bytes_per_s=1e9, achievable_fraction=1.0)
    model = ModelSpec("m", L, L, E, 1, 1e6, 8, 0, 16, 0)
    return Deployment("p", model, gpu, gpus_per_worker=1, overhead_s=0.01)


def requests(n: int = 6, tokens: int = 20) -> list[SimRequest]:
    out = []
    for i in range(n):
        ids = np.full((tokens, L, 1), i % E, dtype=np.int16)
        out.append(SimRequest(f"r{i}", "x", 4, flatten_decode_ids(ids, E)))
    return out


def run(policy, n_arr=400, slots=4, rate=400.0, **kw):  # type: ignore[no-untyped-def]
    reqs = kw.pop("reqs", requests())
    arrivals = np.arange(n_arr) % len(reqs)
    initial = kw.pop("initial", None)
    cfg = SimConfig(slots, rate, n_arr, warmup_fraction=0.0, seed=1, initial_workers=initial)
    return simulate(
        reqs, arrivals, policy, deployment(), cfg, num_moe_layers=L, union_slots=L * E, **kw
    )


def test_no_request_goes_to_a_worker_after_it_left_and_its_requests_finish() -> None:
    res = run(make_policy(JsqProfile()), timeline=[FleetEvent(0.3, leave=(1,))])
    assert res.left_s == {1: pytest.approx(0.3)}
    late = res.assigned_s >= 0.3
    assert not np.any(res.worker_of[late] == 1)
    assert np.any(res.worker_of[~late] == 1)
    assert np.all(np.isfinite(res.tpot_s))  # everything it held was decoded


def test_a_worker_that_joins_gets_requests_from_then_on() -> None:
    res = run(make_policy(JsqProfile()), initial=(0, 1, 2), timeline=[FleetEvent(0.3, join=(3,))])
    assert res.joined_s == {3: pytest.approx(0.3)}
    to_new = res.assigned_s[res.worker_of == 3]
    assert to_new.size > 0
    assert to_new.min() >= 0.3


def test_round_robin_keeps_cycling_over_whoever_is_live() -> None:
    res = run(
        make_policy(RoundRobinProfile()),
        timeline=[FleetEvent(0.2, leave=(0,)), FleetEvent(0.5, join=(0,))],
    )
    during = (res.assigned_s >= 0.2) & (res.assigned_s < 0.5)
    assert set(res.worker_of[during].tolist()) == {1, 2, 3}


def test_a_fleet_event_naming_an_unknown_slot_is_refused() -> None:
    with pytest.raises(ValueError, match="outside"):
        run(make_policy(JsqProfile()), timeline=[FleetEvent(0.1, join=(9,))])


class Swapper:
    """Swaps to scores that send everything to worker 2, once, after 0.25 s."""

    period_s = 0.25

    def __init__(self, n_requests: int) -> None:
        self.n = n_requests
        self.seen: list[SimObservation] = []

    def on_tick(self, obs: SimObservation) -> ScoreUpdate | None:
        self.seen.append(obs)
        if len(self.seen) > 1:
            return None
        scores = np.full((self.n, 4), 0.0, dtype=np.float32)
        scores[:, 2] = 1.0
        return ScoreUpdate(scores=scores, version=2, delay_s=0.1)


def test_a_controller_swaps_the_partition_mid_run() -> None:
    reqs = requests()
    initial = np.zeros((len(reqs), 4), dtype=np.float32)
    initial[:, 0] = 1.0
    swapper = Swapper(len(reqs))
    res = run(
        make_policy(EldrProfile(tau=0.0)),
        reqs=reqs,
        scores=initial,
        scores_version=1,
        controller=swapper,
    )
    assert res.swaps == [(pytest.approx(0.35), 2)]
    before = res.assigned_s < 0.35
    assert set(res.version_of[before].tolist()) == {1}
    assert set(res.version_of[~before].tolist()) == {2}
    assert set(res.worker_of[before].tolist()) == {0}
    assert set(res.worker_of[~before].tolist()) == {2}
    first = swapper.seen[0]
    assert first.now_s == pytest.approx(0.25)
    assert len(first.arrivals) == int((res.assigned_s <= 0.25).sum())
    assert first.live == (0, 1, 2, 3)
    assert sum(len(o.finished) for o in swapper.seen) > 0


def test_a_cost_aware_policy_groups_requests_by_their_experts() -> None:
    reqs = requests(n=4)
    demands = []
    for i in range(4):
        counts = np.zeros((L, E))
        counts[:, i % E] = 5
        demands.append(expert_demand(counts))
    cost = run(make_policy(EldrCostProfile()), reqs=reqs, slots=2, demands=demands)
    jsq = run(make_policy(JsqProfile()), reqs=reqs, slots=2)
    assert cost.expert_union_mean < jsq.expert_union_mean
    with pytest.raises(ValueError, match="needs demands"):
        run(make_policy(EldrCostProfile()), reqs=reqs, slots=2)


def test_union_between_averages_the_steps_of_a_time_window() -> None:
    res = run(make_policy(JsqProfile()))
    whole = res.union_between(0.0, np.inf)
    assert whole == pytest.approx(res.expert_union_mean)
    assert np.isnan(res.union_between(-2.0, -1.0))
