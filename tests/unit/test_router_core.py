"""The routing decision: policy, partition scores, fallbacks, the record it produces."""

from __future__ import annotations

import numpy as np
import pytest

from eldr.core.loadtable import LoadTable, Report
from eldr.core.partition import Partition
from eldr.core.policies import PolicySpec
from eldr.core.router import NoLiveWorkersError, RouterCore, RouteRequest
from eldr.core.signature import Calibration

L, E = 2, 4


def table(*workers: tuple[str, int]) -> LoadTable:
    t = LoadTable()
    for w, running in workers:
        t.on_report(
            Report(
                worker_id=w,
                incarnation="x",
                seq=1,
                running=running,
                waiting=0,
                kv_tokens=running * 10,
            ),
            now_s=0.0,
        )
    return t


def partition(workers=("a", "b"), model="m") -> Partition:
    cal = Calibration(
        num_moe_layers=L,
        num_experts=E,
        transform="raw",
        idf=None,
        layer_mask=np.ones(L, dtype=bool),
    )
    # worker a owns experts 0-1 in both layers, worker b experts 2-3
    c = np.zeros((2, L * E), dtype=np.float32)
    c[0, [0, 1, 4, 5]] = 0.5
    c[1, [2, 3, 6, 7]] = 0.5
    return Partition(
        version=3,
        model=model,
        calibration=cal,
        centroids=c,
        owners=np.array([0, 1]),
        workers=tuple(workers),
    )


def counts_for(experts: list[int]) -> np.ndarray:
    x = np.zeros((L, E), dtype=np.uint32)
    for e in experts:
        x[:, e] = 2
    return x


def core(policy="eldr", tau=0.0, *workers) -> RouterCore:
    rc = RouterCore(PolicySpec(name=policy, tau=tau), table(*workers), np.random.default_rng(0))
    return rc


def test_eldr_sends_a_request_to_the_worker_whose_centroid_matches() -> None:
    rc = core("eldr", 0.0, ("a", 5), ("b", 0))
    rc.set_partition(partition())
    out = rc.decide(RouteRequest("r1", "m", 10, counts=counts_for([0, 1])), now_s=0.0)
    assert out.worker_id == "a"  # locality wins over load at tau = 0
    assert out.fallback is None
    assert out.partition_version == 3
    assert out.scores[0][0] == "a"
    assert out.scores[0][1] == pytest.approx(1.0)
    assert out.band == ("a",)
    assert dict(out.loads) == {"a": 5.0, "b": 0.0}


def test_a_wide_band_picks_the_least_loaded() -> None:
    rc = core("eldr", 1.5, ("a", 5), ("b", 0))
    rc.set_partition(partition())
    out = rc.decide(RouteRequest("r1", "m", 10, counts=counts_for([0, 1])), now_s=0.0)
    assert out.worker_id == "b"
    assert set(out.band) == {"a", "b"}


@pytest.mark.parametrize(
    ("setup", "request_kw", "reason"),
    [
        ("none", {}, "no_partition"),
        ("p", {"model": "other"}, "model_mismatch"),
        ("p", {"counts": None, "signature_error": "signature_timeout"}, "signature_timeout"),
        ("p", {"counts": np.ones((3, 3), np.uint32)}, "geometry_mismatch"),
        ("p", {"counts": np.zeros((L, E), np.uint32)}, "empty_signature"),
        ("p_other_workers", {}, "no_live_worker_in_partition"),
    ],
)
def test_fallbacks_route_load_only_and_say_why(setup, request_kw, reason) -> None:
    rc = core("eldr", 0.0, ("a", 5), ("b", 1))
    if setup == "p":
        rc.set_partition(partition())
    elif setup == "p_other_workers":
        rc.set_partition(partition(workers=("x", "y")))
    kw = {"model": "m", "counts": counts_for([0, 1])} | request_kw
    out = rc.decide(
        RouteRequest(
            "r1", kw["model"], 10, counts=kw["counts"], signature_error=kw.get("signature_error")
        ),
        now_s=0.0,
    )
    assert out.fallback == reason
    assert out.worker_id == "b"  # JSQ


def test_load_only_policies_ignore_the_partition() -> None:
    rc = core("round_robin", 0.0, ("a", 5), ("b", 0))
    rc.set_partition(partition())
    picks = [
        rc.decide(RouteRequest(f"r{i}", "m", 1, counts=counts_for([0])), 0.0).worker_id
        for i in range(4)
    ]
    assert picks == ["a", "b", "a", "b"]
    out = rc.decide(RouteRequest("r9", "m", 1), 0.0)
    assert out.fallback is None
    assert out.partition_version is None


def test_no_live_worker_raises() -> None:
    rc = core("jsq", 0.0)
    with pytest.raises(NoLiveWorkersError):
        rc.decide(RouteRequest("r1", "m", 1), now_s=0.0)


def test_switching_to_a_bad_policy_keeps_the_old_one() -> None:
    rc = core("eldr", 0.1, ("a", 0))
    with pytest.raises(ValueError, match="unknown policy"):
        rc.set_policy(PolicySpec(name="bogus"))
    assert rc.policy.name == "eldr"
