"""The simulator's model of what a live router knows (`eldr.sim.information`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pytest

from eldr.core.costmodel import Deployment, GpuSpec, ModelSpec
from eldr.core.routing.activity import expert_demand
from eldr.core.routing.pipeline import Policy, make_policy
from eldr.core.routing.profile import (
    EldrCostProfile,
    EldrProfile,
    JsqProfile,
    P2cProfile,
    RoundRobinProfile,
)
from eldr.sim.cluster import SimConfig, SimRequest, SimResult, flatten_decode_ids, simulate
from eldr.sim.information import LIVE_DEFAULTS, InformationModel, split_arrivals

E = 8
L = 2


def deployment() -> Deployment:
    gpu = GpuSpec("g", hbm_bytes_per_s=1e9, achievable_fraction=1.0)
    model = ModelSpec(
        "m",
        num_layers=L,
        num_moe_layers=L,
        num_experts=E,
        top_k=1,
        expert_params=1e6,
        expert_bits_per_param=8,
        dense_params=0,
        dense_bits_per_param=16,
        kv_bytes_per_token=0,
    )
    return Deployment("p", model, gpu, gpus_per_worker=1, overhead_s=0.01)


def workload(n: int = 12, seed: int = 0) -> tuple[list[SimRequest], np.ndarray, list]:
    """Requests with random decode traces, their prefill-derived demands."""
    rng = np.random.default_rng(seed)
    reqs, demands = [], []
    for i in range(n):
        tokens = int(rng.integers(5, 40))
        home = int(rng.integers(0, E))
        ids = np.where(rng.random((tokens, L)) < 0.7, home, rng.integers(0, E, (tokens, L)))
        reqs.append(SimRequest(str(i), "x", 4, flatten_decode_ids(ids[:, :, None], E)))
        counts = np.zeros((L, E))
        counts[:, home] = 3
        counts[:, (home + 1) % E] = 1
        demands.append(expert_demand(counts))
    arrivals = rng.integers(0, n, size=400)
    return reqs, arrivals, demands


def run(
    policy: Policy,
    information: InformationModel | None = None,
    *,
    workers: int = 4,
    rate: float = 60.0,
    arrival_times_s: np.ndarray | None = None,
    arrivals: np.ndarray | None = None,
    seed: int = 0,
) -> SimResult:
    reqs, default_arrivals, demands = workload()
    arr = default_arrivals if arrivals is None else arrivals
    rng = np.random.default_rng(7)
    scores = rng.random((len(reqs), workers)).astype(np.float32)
    return simulate(
        reqs,
        arr,
        policy,
        deployment(),
        SimConfig(workers, rate, int(arr.size), max_batch=64, warmup_fraction=0.0, seed=seed),
        num_moe_layers=L,
        union_slots=L * E,
        scores=scores if policy.wants_scores else None,
        demands=demands if policy.uses_activity else None,
        information=information,
        arrival_times_s=arrival_times_s,
    )


def same(a: SimResult, b: SimResult) -> None:
    assert a.worker_of.tolist() == b.worker_of.tolist()
    assert a.tpot_s.tolist() == b.tpot_s.tolist()
    assert a.union_per_layer_steps.tolist() == b.union_per_layer_steps.tolist()
    assert a.imbalance_samples.tolist() == b.imbalance_samples.tolist()


@pytest.mark.parametrize(
    "make",
    [
        (lambda: make_policy(RoundRobinProfile())),
        (lambda: make_policy(JsqProfile())),
        (lambda: make_policy(P2cProfile())),
        lambda: make_policy(JsqProfile(load_measure="kv_tokens")),
        (lambda: make_policy(EldrProfile())),
        (lambda: make_policy(EldrCostProfile())),
    ],
)
def test_with_every_delay_zero_it_is_the_perfect_information_simulation(
    make: Callable[[], Policy],
) -> None:
    # Through the live router's own tables, decision for decision.
    same(run(make()), run(make(), InformationModel.perfect()))


@pytest.mark.parametrize(
    "make",
    [
        (lambda: make_policy(JsqProfile())),
        (lambda: make_policy(EldrProfile())),
        (lambda: make_policy(EldrCostProfile())),
    ],
)
def test_two_replicas_with_instant_information_decide_as_one(make: Callable[[], Policy]) -> None:
    perfect = run(make(), InformationModel.perfect(routers=2))
    same(run(make()), perfect)
    assert set(perfect.replica_of.tolist()) == {0, 1}
    assert perfect.view_error.max() == 0.0


def test_perfect_information_sees_the_true_load_and_activity() -> None:
    res = run(make_policy(EldrCostProfile()), InformationModel.perfect())
    assert res.view_error.size == res.worker_of.size
    assert res.view_error.max() == 0.0
    assert res.activity_excess.tolist() == [0] * res.worker_of.size


def test_the_live_defaults_come_from_the_live_settings() -> None:
    assert LIVE_DEFAULTS.routers == 2  # the demo's router replicas
    assert LIVE_DEFAULTS.report_interval_s == 0.1  # simdecode's report interval
    assert LIVE_DEFAULTS.stale_after_s == 3.0
    assert LIVE_DEFAULTS.activity_slack == 4


def test_a_long_report_period_makes_the_load_stale_and_a_longer_one_staler() -> None:
    errors = []
    for period in (0.02, 0.2, 1.0):
        model = replace(InformationModel.perfect(), report_interval_s=period)
        errors.append(float(run(make_policy(JsqProfile()), model).view_error.mean()))
    # Finished requests keep counting until the next report: the view over-counts.
    assert 0 < errors[0] < errors[1] < errors[2]


def test_own_decisions_count_at_once_so_a_burst_between_reports_is_spread() -> None:
    # The load table counts a decision as pending on its worker until a report admits it:
    # a burst long after the last report is still balanced.
    model = replace(InformationModel.perfect(), report_interval_s=10.0)
    times = np.concatenate([[0.001], 0.2 + 1e-4 * np.arange(10)])
    res = run(
        make_policy(JsqProfile()),
        model,
        workers=2,
        arrival_times_s=times,
        arrivals=np.zeros(11, int),
    )
    burst = res.worker_of[1:]
    assert abs(int((burst == 0).sum()) - int((burst == 1).sum())) <= 1


def test_a_burst_inside_the_commit_window_piles_onto_one_worker() -> None:
    # Decisions taken before the earlier ones are committed all see the same table (the
    # live router awaits the JetStream acknowledgement before counting its decision): a
    # burst goes wholesale to the worker that looked least loaded at the last report.
    model = replace(InformationModel.perfect(), report_interval_s=0.1, commit_s=0.05)
    times = np.concatenate([[0.001], 0.2 + 1e-4 * np.arange(10)])
    arrivals = np.zeros(11, int)
    blind = run(
        make_policy(JsqProfile()), model, workers=2, arrival_times_s=times, arrivals=arrivals
    )
    first = int(blind.worker_of[0])
    assert blind.worker_of[1:].tolist() == [1 - first] * 10
    perfect = run(make_policy(JsqProfile()), workers=2, arrival_times_s=times, arrivals=arrivals)
    burst = perfect.worker_of[1:]
    assert abs(int((burst == 0).sum()) - int((burst == 1).sum())) <= 2


def test_replicas_do_not_see_each_others_decisions_before_they_propagate() -> None:
    # No report after the first (and none going stale): every request is known only from
    # its decision, pending until its finish event.
    blind = replace(
        InformationModel.perfect(routers=2), report_interval_s=100.0, stale_after_s=100.0
    )
    assert run(make_policy(JsqProfile()), blind).view_error.max() == 0.0
    slow = run(make_policy(JsqProfile()), replace(blind, propagation_s=0.5))
    assert slow.view_error.mean() > 0.5


def test_late_finishes_leave_activity_entries_behind() -> None:
    late = replace(InformationModel.perfect(), finish_lag_s=0.2)
    res = run(make_policy(EldrCostProfile()), late)
    assert res.activity_excess.mean() > 0
    # The router bounds each worker's entries by its in-flight count plus the slack.
    assert res.activity_excess.max() <= 4 * 4 + 4 * 4


def test_tpot_counts_from_when_the_job_reaches_the_worker() -> None:
    model = replace(InformationModel.perfect(), dispatch_s=0.005)
    res = run(make_policy(JsqProfile()), model)
    assert np.allclose(res.submitted_s - res.assigned_s, 0.005)
    assert np.all(res.tpot_s > 0)


def test_given_arrival_times_are_used() -> None:
    times = np.linspace(0.0, 2.0, 400)
    res = run(make_policy(RoundRobinProfile()), arrival_times_s=times)
    assert np.allclose(res.assigned_s, times)
    with pytest.raises(ValueError, match="non-decreasing"):
        run(make_policy(RoundRobinProfile()), arrival_times_s=times[::-1].copy())


def test_arrivals_split_between_replicas() -> None:
    model = InformationModel(routers=3, split="alternate")
    assert split_arrivals(model, 6, 0).tolist() == [0, 1, 2, 0, 1, 2]
    shares = np.bincount(split_arrivals(InformationModel(routers=2), 10_000, 0)) / 10_000
    assert shares == pytest.approx([0.5, 0.5], abs=0.02)


def test_the_live_defaults_run_and_every_request_finishes() -> None:
    for policy in (
        make_policy(RoundRobinProfile()),
        make_policy(EldrProfile()),
        make_policy(EldrCostProfile()),
    ):
        res = run(policy, LIVE_DEFAULTS)
        assert np.isfinite(res.tpot_s).all()
        assert res.tpot_s.size == res.worker_of.size


def test_a_bad_model_is_refused() -> None:
    with pytest.raises(ValueError, match="routers"):
        InformationModel(routers=0)
    with pytest.raises(ValueError, match="commit_s"):
        InformationModel(commit_s=-1.0)


def test_arrivals_split_by_measured_shares() -> None:
    model = InformationModel(routers=2, shares=(0.85, 0.15))
    shares = np.bincount(split_arrivals(model, 10_000, 0)) / 10_000
    assert shares == pytest.approx([0.85, 0.15], abs=0.02)
    with pytest.raises(ValueError, match="shares"):
        InformationModel(routers=2, shares=(0.5, 0.6))
