"""RouterCore with an elastic decode pool, and with worker activity for cost-aware routing."""

from __future__ import annotations

import numpy as np
import pytest

import eldr.core.routing.decide as router_module
from eldr.core.partition.partition import Partition
from eldr.core.routing.decide import RouterCore, RouteRequest
from eldr.core.routing.loadtable import LoadTable, Report
from eldr.core.routing.profile import EldrCostProfile, EldrProfile
from eldr.core.signature.signature import Calibration

L, E = 2, 4


def table(*workers: tuple[str, int]) -> LoadTable:
    t = LoadTable()
    for w, running in workers:
        t.on_report(
            Report(worker_id=w, incarnation="x", seq=1, running=running, waiting=0, kv_tokens=0),
            now_s=0.0,
        )
    return t


def partition(workers: tuple[str, ...] = ("a", "b")) -> Partition:
    cal = Calibration(L, E, "raw", None, np.ones(L, dtype=bool))
    c = np.zeros((2, L * E), dtype=np.float32)
    c[0, [0, 1, 4, 5]] = 0.5  # experts 0-1
    c[1, [2, 3, 6, 7]] = 0.5  # experts 2-3
    return Partition(
        version=7,
        model="m",
        calibration=cal,
        centroids=c,
        owners=np.array([0, 1]),
        workers=workers,
    )


def counts_for(*experts: int) -> np.ndarray:
    x = np.zeros((L, E), dtype=np.uint32)
    for e in experts:
        x[:, e] = 3
    return x


def request(rid: str, *experts: int) -> RouteRequest:
    return RouteRequest(rid, "m", prompt_tokens=3, counts=counts_for(*experts))


def test_a_departed_workers_cluster_goes_to_a_live_worker() -> None:
    # b left: its centroid must not attract anything, and nothing falls back to load-only.
    core = RouterCore(EldrProfile(tau=0.0), table(("a", 3)), np.random.default_rng(0))
    core.set_partition(partition())
    out = core.decide(request("r", 2, 3), now_s=0.0)
    assert out.worker_id == "a"
    assert out.fallback is None
    assert all(w != "b" for w, _ in out.scores)


def test_a_new_worker_without_a_centroid_gets_traffic_before_any_refit() -> None:
    core = RouterCore(
        EldrProfile(tau=0.1), table(("a", 3), ("b", 3), ("c", 0)), np.random.default_rng(0)
    )
    core.set_partition(partition())
    out = core.decide(request("r", 0, 1), now_s=0.0)
    assert out.worker_id == "c"
    assert "c" in out.band
    assert out.partition_version == 7


def test_cost_aware_routing_follows_the_activity_of_every_replicas_decisions() -> None:
    core = RouterCore(EldrCostProfile(), table(("a", 2), ("b", 2)), np.random.default_rng(0))
    # Decisions seen on the stream: a decodes expert-0 requests, b expert-3 ones.
    core.note_assignment("a", "x1", counts_for(0), 3, now_s=0.0)
    core.note_assignment("a", "x2", counts_for(0), 3, now_s=0.0)
    core.note_assignment("b", "y1", counts_for(3), 3, now_s=0.0)
    core.note_assignment("b", "y2", counts_for(3), 3, now_s=0.0)
    assert core.decide(request("r1", 3), 0.0).worker_id == "b"
    assert core.decide(request("r2", 0), 0.0).worker_id == "a"
    out = core.decide(request("r3", 0), 0.0)
    assert out.policy == "eldr_cost"
    assert out.partition_version is None  # no partition score is used by default
    assert out.fallback is None


def test_finished_requests_stop_weighing_on_their_worker() -> None:
    core = RouterCore(EldrCostProfile(), table(("a", 0), ("b", 0)), np.random.default_rng(0))
    for i in range(3):
        core.note_assignment("a", f"x{i}", counts_for(1), 3, now_s=0.0)
    assert core.activity.requests_on("a") == 3
    for i in range(3):
        core.note_finished(f"x{i}", 0.0)
    assert core.activity.requests_on("a") == 0
    assert len(core.activity) == 0


def test_cost_aware_routing_without_a_signature_is_load_only_and_says_why() -> None:
    core = RouterCore(EldrCostProfile(), table(("a", 5), ("b", 1)), np.random.default_rng(0))
    out = core.decide(
        RouteRequest("r", "m", 3, counts=None, signature_error="signature_timeout"), 0.0
    )
    assert (out.worker_id, out.fallback) == ("b", "signature_timeout")


def test_interleaved_decisions_count_each_request_once_with_the_demand_it_was_decided_with(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Decisions are awaited concurrently in the service: r1 and r2 are decided before
    either assignment is noted, and each is seen again on the decisions stream."""
    core = RouterCore(EldrCostProfile(), table(("a", 0), ("b", 0)), np.random.default_rng(0))
    computed = []
    real = router_module.request_demand

    def counting(policy: object, req: RouteRequest) -> object:
        demand = real(policy, req)  # type: ignore[arg-type]
        computed.append((req.request_id, demand))
        return demand

    monkeypatch.setattr(router_module, "request_demand", counting)
    r1, r2 = request("r1", 0), request("r2", 3)
    w1 = core.decide(r1, 0.0).worker_id
    w2 = core.decide(r2, 0.0).worker_id
    core.note_assignment(w1, "r1", r1.counts, 3, now_s=0.0)
    core.note_assignment(w2, "r2", r2.counts, 3, now_s=0.0)
    core.note_assignment(w1, "r1", r1.counts, 3, now_s=0.0)  # echoed by the stream
    core.note_assignment(w2, "r2", r2.counts, 3, now_s=0.0)
    assert [rid for rid, _ in computed] == ["r1", "r2"]  # none computed again
    assert len(core.activity) == 2
    assert core.activity.requests_on(w1) + core.activity.requests_on(w2) == 2
    # Another replica's decision is still counted, from its own counts.
    core.note_assignment("b", "elsewhere", counts_for(1), 3, now_s=0.0)
    assert [rid for rid, _ in computed][-1] == "elsewhere"
    assert len(core.activity) == 3
