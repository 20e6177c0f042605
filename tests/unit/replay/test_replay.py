"""Replay of recorded decisions: reproduction on recorded inputs, what-if replays with the
load correction, the decode model, and `explain`."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eldr.core.partition.partition import Partition
from eldr.core.routing.decide import DecisionRng, RouterCore, RouteRequest
from eldr.core.routing.loadtable import LoadTable, Report
from eldr.core.routing.profile import params_taken, profile_from_params
from eldr.core.signature.signature import Calibration
from eldr.data.deployments import load_catalog
from eldr.partitions.codec import partition_to_blob
from eldr.replay.effect import _batch_union as batch_union
from eldr.replay.effect import model_decode_effect
from eldr.replay.engine import Replayer, replay
from eldr.replay.eventlog import Event, EventLog
from eldr.replay.explain import explain
from eldr.replay.inputs import request_end
from eldr.replay.reproduction import reproduce_decision
from eldr.replay.whatif import ReplayConfig
from eldr.wire import (
    Decision,
    DecodeSummary,
    PartitionAnnouncement,
    RequestFinished,
    SparseCounts,
)
from eldr.wire.records import decision_record

L, E = 2, 8
T0 = 1_700_000_000.0


def partition(workers: tuple[str, ...] = ("d0", "d1", "d2", "d3"), version: int = 1) -> Partition:
    """Worker k owns experts 2k and 2k+1 in both layers."""
    cal = Calibration(L, E, "raw", None, np.ones(L, dtype=bool))
    c = np.zeros((len(workers), L * E), dtype=np.float32)
    for k in range(len(workers)):
        c[k, [2 * k, 2 * k + 1, E + 2 * k, E + 2 * k + 1]] = 0.5
    return Partition(version, "m", cal, c, np.arange(len(workers)), workers)


def counts(topic: int, noise: int = 0, extra: int = 0) -> np.ndarray:
    x = np.zeros((L, E), dtype=np.uint32)
    x[:, 2 * topic] = 3
    x[:, 2 * topic + 1] = 1
    x[:, extra % E] += np.uint32(noise)
    return x


def record(
    core: RouterCore,
    req: RouteRequest,
    ts_s: float,
    router_id: str = "r1",
    rng_seed: bool = True,
    typed: bool = True,
    version: int = 4,
) -> Decision:
    """What the router service commits for a decision (`decision_record`); `version` 3: as
    routers wrote it before Decision v4 (the fleet and the policy's loads, no candidates);
    `typed` False: before v3 (untyped `params`)."""
    out = core.decide(req, 0.0)
    current = decision_record(
        out,
        request_id=req.request_id,
        ts_s=ts_s,
        router_id=router_id,
        model=req.model,
        signature=None if req.counts is None else SparseCounts.from_dense(req.counts),
        missing_blocks=req.missing_blocks,
        decide_s=0.001,
        prompt_tokens=req.prompt_tokens,
    )
    if typed and version == 4 and rng_seed:
        return current
    old = {
        "v": 3 if typed else 2,
        "loads": list(out.loads),
        "considered": [],
        "live_workers": None,
        "fleet_totals": None,
        "rng_seed": out.rng_seed if rng_seed else None,
        "fleet": list(out.fleet) if rng_seed else [],
    }
    if not typed:
        old.update(profile=None, params=out.profile.params())
    return msgspec.structs.replace(current, **old)


def router(
    loads: dict[str, int], policy: str = "eldr", tau: float = 0.1, seed: int = 0
) -> RouterCore:
    table = LoadTable()
    for w, running in loads.items():
        table.on_report(Report(w, "x", 1, running, 0, running * 100), 0.0)
    profile = profile_from_params(policy, params_taken(policy, {"tau": tau}))
    core = RouterCore(profile, table, np.random.default_rng(seed))
    core.set_partition(partition(tuple(loads)))
    return core


def log_of(
    decisions: list[Decision], profiles: Sequence[DecodeSummary] = (), blobs: bool = True
) -> EventLog:
    p = partition()
    events = [Event.of(d, stream="DECISIONS", seq=i + 1) for i, d in enumerate(decisions)]
    events += [Event.of(x, stream="PROFILES", seq=i + 1) for i, x in enumerate(profiles)]
    events.append(
        Event.of(
            PartitionAnnouncement(
                version=1,
                model="m",
                object_name="v1",
                sha256="0" * 64,
                created_ts_s=T0 - 10,
                k=p.k,
                dim=p.calibration.dim,
                workers=list(p.workers),
            ),
            stream="PARTITIONS",
            seq=1,
        )
    )
    return EventLog("t", events, {"v1": partition_to_blob(p)} if blobs else {})


# --- reproduction ---------------------------------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(["eldr", "eldr_bounded", "oracle", "jsq", "p2c", "random"]),
    tau=st.sampled_from([0.0, 0.05, 0.3, 1.5]),
    loads=st.lists(st.integers(0, 2), min_size=4, max_size=4),
    topics=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 4), st.integers(0, 7)), max_size=8),
    seed=st.integers(0, 2**32 - 1),
)
def test_every_decision_reproduces_from_its_record(policy, tau, loads, topics, seed) -> None:
    core = router(dict(zip(("d0", "d1", "d2", "d3"), loads, strict=True)), policy, tau, seed)
    p = core.partition
    for i, (topic, noise, extra) in enumerate(topics):
        d = record(core, RouteRequest(f"r{i}", "m", 10, counts(topic, noise, extra)), T0 + i)
        core.table.on_assignment(d.worker_id, d.request_id, 10, 0.0)
        result = reproduce_decision(d, p if d.partition_version else None, DecisionRng())
        assert result.status == "reproduced", result.detail


@pytest.mark.parametrize("policy", ["eldr", "eldr_bounded", "jsq", "p2c", "random"])
def test_records_from_before_typed_profiles_replay_through_the_same_mapping(policy: str) -> None:
    core = router({"d0": 2, "d1": 0, "d2": 1, "d3": 0}, policy, 0.3, seed=4)
    for i in range(8):
        d = record(core, RouteRequest(f"r{i}", "m", 10, counts(i % 4, i, i)), T0 + i, typed=False)
        assert d.profile is None
        assert d.v == 2
        assert d.routing_profile == core.profile
        core.table.on_assignment(d.worker_id, d.request_id, 10, 0.0)
        partition = core.partition if d.partition_version else None
        assert reproduce_decision(d, partition, DecisionRng()).status == "reproduced"


def test_cost_aware_decisions_replay_on_a_rebuilt_activity_table() -> None:
    core = router({"d0": 0, "d1": 0, "d2": 0, "d3": 0}, "eldr_cost")
    decisions = []
    for i in range(24):
        x = counts(i % 4, i % 3, i)
        d = record(core, RouteRequest(f"r{i}", "m", 10, x), T0 + i, version=3)
        core.table.on_assignment(d.worker_id, d.request_id, 10, 0.0)
        core.note_assignment(d.worker_id, d.request_id, x, 10, T0 + i)
        decisions.append(d)
    assert len({d.worker_id for d in decisions}) > 1
    report = Replayer(log_of(decisions)).reproduce()
    # every request is still in flight, so the rebuilt table is the router's exactly
    assert (report.approximate, report.approximate_mismatched) == (24, 0)
    assert (report.checked, report.mismatched) == (0, 0)


@pytest.mark.parametrize("policy", ["eldr_cost", "eldr_band_cost"])
def test_activity_decisions_replay_exactly_from_what_they_recorded(policy: str) -> None:
    """Since Decision v4 a decision records the activity terms its scorer read, so the
    replay needs no rebuilt table: every decision reproduces, none is approximate, even
    where the window does not show what the router knew (requests decided before it)."""
    core = router({"d0": 0, "d1": 1, "d2": 0, "d3": 2}, policy)
    for i in range(6):  # in flight before the window: absent from the log
        core.note_assignment(f"d{i % 4}", f"old{i}", counts(i % 4, 1, i), 10, T0 - 10)
    decisions = []
    for i in range(24):
        x = counts(i % 4, i % 3, i)
        d = record(core, RouteRequest(f"r{i}", "m", 10, x), T0 + i)
        assert d.considered
        assert any(row[4] is not None for row in d.considered)
        core.table.on_assignment(d.worker_id, d.request_id, 10, 0.0)
        core.note_assignment(d.worker_id, d.request_id, x, 10, T0 + i)
        decisions.append(d)
    report = Replayer(log_of(decisions)).reproduce()
    assert (report.reproduced, report.approximate, report.mismatched) == (24, 0, 0)
    assert report.share == 1.0


def test_the_default_records_only_its_candidates_and_the_fleet_totals() -> None:
    core = router({"d0": 0, "d1": 3, "d2": 1, "d3": 0}, "eldr_band_cost")
    d = record(core, RouteRequest("q", "m", 10, counts(1)), T0)
    assert d.fleet == []
    assert d.loads == []
    assert [row[0] for row in d.considered] == ["d0", "d1", "d2", "d3"]  # k 16 > 4 workers
    assert d.live_workers == 4
    assert d.fleet_totals == (4, 400)
    assert d.band == ["d1", "d3"] or d.worker_id in d.band


def test_a_tampered_record_of_the_default_does_not_reproduce() -> None:
    core = router({"d0": 0, "d1": 0, "d2": 0, "d3": 0}, "eldr_band_cost")
    core.note_assignment("d1", "old", counts(1), 10, T0)
    d = record(core, RouteRequest("q", "m", 10, counts(1)), T0)
    p = core.partition
    assert reproduce_decision(d, p, DecisionRng()).status == "reproduced"
    rows = [list(r) for r in d.considered]
    assert sum(r[4] is not None for r in rows) >= 2  # the band was scored
    for row in rows:  # the winner now looks busy, the rest idle
        if row[4] is not None:
            row[4], row[5] = (1e6, 1.0) if row[0] == d.worker_id else (0.0, 1.0)
    changed = msgspec.structs.replace(d, considered=[tuple(r) for r in rows])
    result = reproduce_decision(changed, p, DecisionRng())
    assert result.status == "mismatch"
    rescored = [(*r[:3], None if r[3] is None else r[3] - 0.2, *r[4:]) for r in d.considered]
    result = reproduce_decision(msgspec.structs.replace(d, considered=rescored), p, DecisionRng())
    assert (result.status, result.detail[:16]) == ("mismatch", "recorded scores ")


def test_finished_requests_leave_the_rebuilt_activity_table_as_they_left_the_routers() -> None:
    # The router saw each request end through the gateway's finish event (no decode
    # profiles: decode instances without the capture plugin); the replay must too, or its
    # rebuilt table keeps every request and disagrees with what the router decided on.
    core = router({"d0": 0, "d1": 0, "d2": 0, "d3": 0}, "eldr_cost")
    decisions, finishes = [], []
    for i in range(24):
        x = counts(i % 4, i % 3, i)
        d = record(core, RouteRequest(f"r{i}", "m", 10, x), T0 + i, version=3)
        core.table.on_assignment(d.worker_id, d.request_id, 10, 0.0)
        core.note_assignment(d.worker_id, d.request_id, x, 10, T0 + i)
        decisions.append(d)
        if i >= 2:  # each request ends 2.5 s after it was decided
            rid = f"r{i - 2}"
            core.note_finished(rid, 0.0)
            finishes.append(
                RequestFinished(
                    request_id=rid,
                    gateway_id="gw",
                    ts_s=T0 + i + 0.5,
                    reason="stop",
                    worker_id=decisions[i - 2].worker_id,
                )
            )
    log = log_of(decisions)
    events = [
        *log.events,
        *(Event.of(f, stream="FINISHED", seq=n + 1) for n, f in enumerate(finishes)),
    ]
    log = EventLog("t", events, log.blobs)
    assert request_end(decisions[0], log) == T0 + 2.5
    assert request_end(decisions[-1], log) is None
    report = Replayer(log).reproduce()
    assert (report.approximate, report.approximate_mismatched) == (24, 0)
    # Without the finish events the rebuilt table keeps every request: it no longer
    # matches what the router saw, and some decisions come out differently.
    unfinished = Replayer(log_of(decisions)).reproduce()
    assert unfinished.approximate_mismatched > 0


def test_a_what_if_can_switch_to_a_cost_aware_policy() -> None:
    decisions = stream_of_decisions(30, tau=0.1)
    cf = replay(log_of(decisions), ReplayConfig(policy="eldr_cost")).counterfactual
    assert cf is not None
    assert cf.policy.startswith("eldr_cost")
    assert sum(cf.after.per_worker.values()) == 30


def test_a_what_if_sets_policy_parameters() -> None:
    decisions = stream_of_decisions(30, tau=0.1)
    config = ReplayConfig(policy="eldr_bounded", params=(("slack", 0.0),))
    cf = replay(log_of(decisions), config).counterfactual
    assert cf is not None
    assert cf.changes == {"policy": "eldr -> eldr_bounded", "slack": "default -> 0"}
    assert "slack 0" in cf.policy


def test_round_robin_decisions_replay_from_the_previous_decision_of_their_router() -> None:
    cores = {r: router({"d0": 0, "d1": 0, "d2": 0}, "round_robin") for r in ("r1", "r2")}
    decisions = [
        record(cores[r], RouteRequest(f"{r}-{i}", "m", 1, counts(0)), T0 + i + 0.5 * (r == "r2"), r)
        for i in range(6)
        for r in ("r1", "r2")
    ]
    report = Replayer(log_of(decisions)).reproduce()
    assert (report.anchored, report.reproduced, report.mismatched) == (2, 10, 0)


def test_a_tie_without_a_recorded_seed_is_not_called_a_mismatch() -> None:
    core = router({"d0": 0, "d1": 0}, "jsq")
    rngs = DecisionRng()
    # find a decision whose recorded tie-break differs from what seed 0 draws
    for i in range(50):
        d = record(core, RouteRequest(f"r{i}", "m", 1, counts(0)), T0, rng_seed=False)
        if reproduce_decision(d, None, rngs).status != "reproduced":
            break
    result = reproduce_decision(d, None, rngs)
    assert result.status == "tie_unrecorded"


def test_a_decision_the_inputs_do_not_explain_is_reported_with_what_differs() -> None:
    d = record(router({"d0": 5, "d1": 0}, "jsq"), RouteRequest("r1", "m", 1, counts(0)), T0)
    assert d.worker_id == "d1"
    forged = msgspec.structs.replace(d, worker_id="d0")
    report = Replayer(log_of([forged])).reproduce()
    assert report.mismatched == 1
    assert report.mismatches[0]["detail"] == "worker d0 recorded, d1 replayed"


def test_a_decision_whose_partition_blob_is_missing_is_unreplayable() -> None:
    d = record(router({"d0": 0, "d1": 0}), RouteRequest("r1", "m", 1, counts(0)), T0)
    report = Replayer(log_of([d], blobs=False)).reproduce()
    assert (report.unreplayable, report.mismatched, report.checked) == (1, 0, 0)


# --- counterfactual -------------------------------------------------------------------------


def stream_of_decisions(n: int, tau: float, *, period_s: float = 0.1) -> list[Decision]:
    """n decisions on four workers, topics cycling, assignments counted as pending."""
    core = router({"d0": 0, "d1": 0, "d2": 0, "d3": 0}, "eldr", tau)
    out = []
    for i in range(n):
        d = record(core, RouteRequest(f"r{i}", "m", 10, counts(i % 4, i % 3, i)), T0 + i * period_s)
        core.table.on_assignment(d.worker_id, d.request_id, 10, 0.0)
        out.append(d)
    return out


def test_tau_zero_sends_requests_to_their_best_centroid_and_raises_similarity() -> None:
    decisions = stream_of_decisions(40, tau=1.5)  # a band of everyone: load decides
    report = replay(log_of(decisions), ReplayConfig(params=(("tau", 0.0),)))
    cf = report.counterfactual
    assert report.reproduction.reproduced == 40
    assert cf is not None
    assert cf.changes == {"tau": "1.5 -> 0"}
    assert cf.changed > 0
    best = np.mean([d.scores[0][1] for d in decisions])  # every request at its best centroid
    assert cf.after.similarity_mean == pytest.approx(best)
    assert cf.before.similarity_mean is not None
    assert cf.before.similarity_mean < best - 0.1


def test_a_load_only_replay_corrects_loads_for_the_requests_it_moved() -> None:
    # Recorded: everything went to d0 (tau 0, one topic), and the recorded loads show d0
    # filling up. JSQ must spread the same requests evenly over both workers, which it can
    # only do if the load it sees counts its own moved requests.
    core = router({"d0": 0, "d1": 0}, "eldr", 0.0)
    decisions = []
    for i in range(20):
        d = record(core, RouteRequest(f"r{i}", "m", 10, counts(0)), T0 + i)
        core.table.on_assignment(d.worker_id, d.request_id, 10, 0.0)
        decisions.append(d)
    assert {d.worker_id for d in decisions} == {"d0"}
    cf = replay(log_of(decisions), ReplayConfig(policy="jsq", default_duration_s=1e6))
    assert cf.counterfactual is not None
    assert cf.counterfactual.after.per_worker == {"d0": 10, "d1": 10}
    assert cf.counterfactual.changed == 10


def test_requests_that_finished_stop_counting_in_the_corrected_load() -> None:
    core = router({"d0": 0, "d1": 0}, "eldr", 0.0)
    decisions = [
        record(core, RouteRequest(f"r{i}", "m", 10, counts(0)), T0 + 10 * i) for i in range(6)
    ]  # recorded loads stay 0: nothing pending, every request done before the next
    cf = replay(log_of(decisions), ReplayConfig(policy="jsq", default_duration_s=1.0))
    assert cf.counterfactual is not None
    # each decision sees an idle fleet, so JSQ's choice is its seeded tie-break alone
    rngs = DecisionRng()
    expected = [("d0", "d1")[int(rngs.seeded(d.rng_seed).integers(2))] for d in decisions]
    assert [m["to"] for m in cf.counterfactual.moves] == [w for w in expected if w != "d0"]


# --- the decode model -----------------------------------------------------------------------


@given(st.lists(st.lists(st.floats(0.0, 1.0), min_size=3, max_size=3), min_size=1, max_size=5))
def test_expected_union_is_one_minus_the_product_of_misses(probs) -> None:
    p = np.array(probs)
    cells = [np.arange(3) for _ in probs]
    with np.errstate(divide="ignore"):
        logq = [np.log1p(-row) for row in p]
    expected = float(np.sum(1.0 - np.prod(1.0 - p, axis=0)))
    assert batch_union(np.arange(len(probs)), cells, logq, 3) == pytest.approx(expected)


def profile_of(d: Decision, expert: int, end_s: float) -> DecodeSummary:
    x = np.zeros((L, E), dtype=np.uint32)
    x[:, expert] = 20  # every token of the request uses this expert in each layer
    return DecodeSummary(
        request_id=d.request_id,
        worker_id=d.worker_id,
        ts_s=end_s,
        tokens=20,
        counts=SparseCounts.from_dense(x),
    )


def test_grouping_requests_by_expert_halves_the_modelled_union_and_cuts_tpot() -> None:
    decisions = stream_of_decisions(4, tau=0.0)
    profiles = {d.request_id: profile_of(d, i % 2, T0 + 100) for i, d in enumerate(decisions)}
    mixed = ["d0", "d0", "d1", "d1"]  # each worker: one request of each expert
    grouped = ["d0", "d1", "d0", "d1"]  # each worker: one expert
    cost = load_catalog().get("qwen3-30b-a3b-h200")
    effect = model_decode_effect(decisions, profiles, mixed, grouped, cost)
    assert effect.before.expert_union_per_layer == pytest.approx(2.0)
    assert effect.after.expert_union_per_layer == pytest.approx(1.0)
    assert effect.after.tpot_mean_ms < effect.before.tpot_mean_ms
    assert effect.profiled == 4


# --- explain --------------------------------------------------------------------------------


def test_explain_says_why_the_band_held_its_members_and_why_the_winner_won() -> None:
    core = router({"d0": 3, "d1": 1, "d2": 0, "d3": 0}, "eldr", 0.1)
    d = record(core, RouteRequest("q", "m", 10, counts(0)), T0)
    text = explain(d, core.partition).render()
    assert "Request q went to decode worker d1." in text
    assert "only d0 scored within tau 0.1 of the best (0.894" in text
    assert "the band widens to the 2 best-scoring workers" in text
    assert "d1 had the least load in the band: 1 in-flight request" in text
    assert "JSQ on in-flight requests) would have chosen" in text
    assert "reproduced" in text


def test_explain_reports_the_load_bound_the_bounded_band_computed() -> None:
    core = router({"d0": 9, "d1": 0, "d2": 0, "d3": 0}, "eldr_bounded", 0.1)
    d = record(core, RouteRequest("q", "m", 10, counts(0)), T0)
    explained = explain(d, core.partition)
    # mean 2.25: bound (1 + 0.1) x 2.25 + 1 = 3.5, so d0 (the best centroid) is not eligible
    assert "slack 0.1) x mean + 1 = 3.5 were eligible (not: d0)" in explained.band_reason
    assert d.worker_id != "d0"
    assert explained.params == {"load_measure": "requests", "tau": 0.1, "widen_to": 2, "slack": 0.1}


def test_explain_names_a_tie_and_the_seed_that_broke_it() -> None:
    core = router({"d0": 0, "d1": 0, "d2": 5, "d3": 5}, "eldr", 2.0)
    d = record(core, RouteRequest("q", "m", 10, counts(2)), T0)
    text = explain(d, core.partition).render()
    assert "d0, d1 tied for the least load in the band (0 in-flight requests)" in text
    assert f"rng seed {d.rng_seed}" in text


def test_explain_of_a_cost_aware_record_from_before_v4_says_what_it_lacks() -> None:
    core = router({"d0": 0, "d1": 0}, "eldr_cost")
    d = record(core, RouteRequest("q", "m", 10, counts(0)), T0, version=3)
    text = explain(d, core.partition).render()
    assert "Band: none: eldr_cost weighs every live worker by predicted step cost" in text
    assert "the per-worker costs are not shown" in text
    assert "Replay: not checked alone" in text


def test_explain_of_the_default_shows_the_costs_that_chose_the_worker() -> None:
    core = router({"d0": 0, "d1": 1, "d2": 4, "d3": 0}, "eldr_band_cost")
    core.note_assignment("d1", "old", counts(1), 10, T0)
    d = record(core, RouteRequest("q", "m", 10, counts(1)), T0)
    e = explain(d, core.partition)
    text = e.render()
    assert f"{'U':>8} {'dU':>7} {'cost':>9}" in text
    costed = [c for c in e.candidates if c.cost is not None]
    assert {c.worker for c in costed} == set(d.band)
    winner = next(c for c in costed if c.chosen)
    assert winner.cost == min(c.cost for c in costed if c.cost is not None)
    assert f"Winner: {d.worker_id} adds the least predicted decode-step cost in the band" in text
    assert "Only workers with load <= (1 + slack 0.2) x mean + 1 = 2.5 were eligible" in text
    assert "Replay: re-running the decision on its recorded inputs gives" in text


def test_explain_gives_the_fallback_reason() -> None:
    core = router({"d0": 2, "d1": 0}, "eldr", 0.1)
    core.set_partition(None)
    d = record(core, RouteRequest("q", "m", 10, counts(0)), T0)
    text = explain(d).render()
    assert "Fallback: no_partition: the router had no partition loaded" in text
    assert "Winner: d1 had the least load among all 2 live workers" in text
