"""The discrete-event decode-cluster simulator."""

from __future__ import annotations

import numpy as np
import pytest

from eldr.core.costmodel import Deployment, GpuSpec, ModelSpec
from eldr.core.routing.pipeline import make_policy
from eldr.core.routing.profile import EldrProfile, JsqProfile, RoundRobinProfile
from eldr.sim.cluster import SimConfig, SimRequest, flatten_decode_ids, simulate

E = 8
L = 2


def deployment(overhead_s: float = 0.01) -> Deployment:
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
    return Deployment("p", model, gpu, gpus_per_worker=1, overhead_s=overhead_s)


def request(rid: str, ids: list[list[int]], prompt: int = 4) -> SimRequest:
    arr = np.array(ids, dtype=np.int16)[:, :, None]  # [tokens, layers, top_k=1]
    return SimRequest(rid, "x", prompt, flatten_decode_ids(arr, E))


def run(reqs, arrivals, policy, n_workers=1, rate=1.0, max_batch=64, scores=None, seed=0, warm=0.0):
    cfg = SimConfig(
        n_workers, rate, len(arrivals), max_batch=max_batch, warmup_fraction=warm, seed=seed
    )
    return simulate(
        reqs,
        np.asarray(arrivals),
        policy,
        deployment(),
        cfg,
        num_moe_layers=L,
        union_slots=L * E,
        scores=scores,
    )


def test_flatten_offsets_expert_ids_by_layer() -> None:
    ids = np.array([[[1], [1]], [[2], [7]]], dtype=np.int16)
    assert flatten_decode_ids(ids, E).tolist() == [[1, 9], [2, 15]]


def test_a_lone_request_costs_one_step_per_token() -> None:
    # 3 tokens, each step activates 1 expert per layer = 2 experts of 1 MB at 1 GB/s = 2 ms.
    req = request("a", [[0, 0], [1, 1], [2, 2]])
    res = run([req], [0], make_policy(RoundRobinProfile()))
    assert res.tpot_s.tolist() == pytest.approx([0.012])
    assert res.union_per_layer_steps.size == 0 or res.expert_union_mean == pytest.approx(1.0)


def test_identical_requests_share_their_experts() -> None:
    req = request("a", [[0, 3]] * 200)
    # Union statistics count steps while arrivals are still coming, so send a stream.
    shared = run([req], [0] * 40, make_policy(RoundRobinProfile()), rate=1000.0)
    assert shared.expert_union_mean == pytest.approx(1.0)
    other = request("b", [[5, 6]] * 200)
    mixed = run([req, other], [0, 1] * 20, make_policy(RoundRobinProfile()), rate=1000.0)
    assert mixed.expert_union_mean > 1.5


def test_same_seed_same_result_and_arrivals_shared_across_policies() -> None:
    rng = np.random.default_rng(3)
    reqs = [request(str(i), rng.integers(0, E, size=(20, L)).tolist()) for i in range(10)]
    arrivals = rng.integers(0, 10, size=300)
    a = run(reqs, arrivals, make_policy(JsqProfile()), n_workers=3, rate=200.0, seed=5)
    b = run(reqs, arrivals, make_policy(JsqProfile()), n_workers=3, rate=200.0, seed=5)
    assert np.array_equal(a.tpot_s, b.tpot_s)
    assert np.array_equal(a.worker_of, b.worker_of)
    # Round-robin sees the same arrival times: its assignment is the fixed cycle.
    rr = run(reqs, arrivals, make_policy(RoundRobinProfile()), n_workers=3, rate=200.0, seed=5)
    assert rr.worker_of.tolist() == [i % 3 for i in range(300)]


def test_every_measured_request_finishes() -> None:
    rng = np.random.default_rng(4)
    reqs = [
        request(str(i), rng.integers(0, E, size=(rng.integers(1, 30), L)).tolist())
        for i in range(8)
    ]
    arrivals = rng.integers(0, 8, size=500)
    res = run(reqs, arrivals, make_policy(JsqProfile()), n_workers=4, rate=300.0, warm=0.1)
    assert res.tpot_s.size == 450
    assert np.all(np.isfinite(res.tpot_s))
    assert np.all(res.tpot_s >= 0.01)  # never faster than the per-step overhead
    assert res.assigned_per_worker.sum() == 450


def test_a_full_batch_makes_requests_wait() -> None:
    req = request("a", [[0, 0]] * 50)
    res = run([req], [0] * 20, make_policy(RoundRobinProfile()), rate=1e6, max_batch=2)
    assert res.queued_share > 0.5
    assert res.batch_steps.max() <= 2


def test_locality_policy_needs_scores() -> None:
    with pytest.raises(ValueError, match="needs scores"):
        run([request("a", [[0, 0]])], [0], make_policy(EldrProfile()))


def test_locality_policy_routes_by_score() -> None:
    reqs = [request("a", [[0, 0]] * 5), request("b", [[7, 7]] * 5)]
    scores = np.array([[1.0, 0.0], [0.0, 1.0]], dtype=np.float32)
    res = run(
        reqs, [0, 1, 0, 1], make_policy(EldrProfile(tau=0.0)), n_workers=2, rate=1.0, scores=scores
    )
    assert res.worker_of.tolist() == [0, 1, 0, 1]
