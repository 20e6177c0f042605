"""The routing decision: policy, partition scores, fallbacks, the record it produces."""

from __future__ import annotations

import numpy as np
import pytest

from eldr.core.partition.partition import Partition
from eldr.core.routing.decide import NoLiveWorkersError, RouterCore, RouteRequest
from eldr.core.routing.loadtable import LoadTable, Report
from eldr.core.routing.profile import EldrCostProfile, params_taken, profile_from_params
from eldr.core.signature.signature import Calibration

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
    profile = profile_from_params(policy, params_taken(policy, {"tau": tau}))
    rc = RouterCore(profile, table(*workers), np.random.default_rng(0))
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
        rc.set_profile(profile_from_params("bogus"))
    assert rc.policy.name == "eldr"


def demand_counts(expert: int) -> np.ndarray:
    x = np.zeros((L, E), dtype=np.uint32)
    x[:, expert] = 3
    return x


def test_activity_never_exceeds_in_flight_plus_slack_when_finishes_are_lost() -> None:
    # A worker reporting 2 requests in flight holds at most 2 + slack entries however many
    # assignments whose finish never arrives pile up (the oldest go first).
    t = table(("a", 2))
    rc = RouterCore(EldrCostProfile(), t, np.random.default_rng(0), activity_slack=1)
    for i in range(50):
        rc.note_assignment("a", f"r{i}", demand_counts(i % E), 4, now_s=float(i))
        t.on_report(
            Report(
                worker_id="a",
                incarnation="x",
                seq=2 + i,
                running=2,
                waiting=0,
                kv_tokens=0,
                admitted=(f"r{i}",),
            ),
            now_s=float(i),
        )
        rc.bound_activity("a")
        assert rc.activity.requests_on("a") <= 2 + 1
    assert "r49" in rc.activity
    assert "r0" not in rc.activity


def test_a_finished_request_leaves_both_tables_and_a_late_decision_is_ignored() -> None:
    t = table(("a", 0), ("b", 0))
    rc = RouterCore(EldrCostProfile(), t, np.random.default_rng(0))
    t.on_assignment("a", "r", 4, now_s=0.0)
    rc.note_assignment("a", "r", demand_counts(1), 4, now_s=0.0)
    assert t.in_flight("a") == 1
    assert "r" in rc.activity
    assert rc.note_finished("r", 0.0)
    assert t.in_flight("a") == 0
    assert "r" not in rc.activity
    rc.note_assignment("a", "r", demand_counts(1), 4, now_s=0.1)  # echo from another replica
    assert "r" not in rc.activity
    assert not rc.note_finished("r", 0.0)


def test_a_moved_request_leaves_its_first_worker_at_once() -> None:
    t = table(("a", 0), ("b", 0))
    rc = RouterCore(EldrCostProfile(), t, np.random.default_rng(0))
    t.on_assignment("a", "r", 4, now_s=0.0)
    rc.note_assignment("a", "r", demand_counts(1), 4, now_s=0.0)
    assert rc.note_moved("r", "b", now_s=0.1)
    assert (t.in_flight("a"), t.in_flight("b")) == (0, 1)
    assert rc.activity.worker_of("r") == "b"


def test_an_unavailable_capture_routes_load_only_and_says_so() -> None:
    rc = core("eldr_cost", 0.0, ("a", 3), ("b", 1))
    out = rc.decide(RouteRequest("r", "m", 10, signature_error="no_capture"), now_s=0.0)
    assert (out.worker_id, out.fallback) == ("b", "no_capture")
