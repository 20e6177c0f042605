"""Online refit logic: drift monitor, shadow evaluation, promotion verdicts, triggers."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from eldr.core.partition.partition import Partition, fit_partition
from eldr.core.routing.profile import EldrCostProfile, EldrProfile, JsqProfile, ProfileBase
from eldr.core.signature.signature import Calibration
from eldr.core.training.online import (
    DriftBaseline,
    DriftMonitor,
    DriftThresholds,
    ShadowResult,
    holdout_mask,
    modelled_union,
    occupancy_skew,
    per_token_activation,
    promotion_verdict,
    refit_trigger,
    shadow_assignment,
    shadow_evaluate,
)
from eldr.core.workload.trace import ModelGeometry

L, E = 2, 8
GEOMETRY = ModelGeometry(num_layers=L, moe_layers=(0, 1), num_experts=E, top_k=1)


def topic_counts(rng: np.random.Generator, topic: int, n: int, tokens: int = 12) -> np.ndarray:
    """Requests of `topic` route mostly to experts 2*topic and 2*topic+1 (flat [n, L*E])."""
    out = np.zeros((n, L * E), dtype=np.float32)
    for i in range(n):
        for layer in range(L):
            for _ in range(tokens):
                e = 2 * topic + int(rng.integers(2)) if rng.random() < 0.85 else rng.integers(E)
                out[i, layer * E + int(e)] += 1
    return out


def topic_partition(topics: list[int], workers: tuple[str, ...], version: int = 1) -> Partition:
    """One centroid per worker, centred on its topic's two experts."""
    cal = Calibration(L, E, "raw", None, np.ones(L, dtype=bool))
    c = np.zeros((len(workers), L * E), dtype=np.float32)
    for i, t in enumerate(topics):
        for layer in range(L):
            c[i, [layer * E + 2 * t, layer * E + 2 * t + 1]] = 0.5
    return Partition(version, "m", cal, c, np.arange(len(workers)), workers)


# --- drift ------------------------------------------------------------------------------


def test_occupancy_skew_is_zero_when_even_and_near_one_when_all_on_one() -> None:
    assert occupancy_skew(np.array([0, 1, 2, 3]), 4) == pytest.approx(0.0)
    assert occupancy_skew(np.array([2, 2, 2, 2]), 4) == pytest.approx(0.75)
    assert occupancy_skew(np.array([-1, -1]), 4) == 0.0


def monitor(partition: Partition, baseline: DriftBaseline | None) -> DriftMonitor:
    return DriftMonitor(partition, baseline, window=64, thresholds=DriftThresholds(min_samples=32))


def test_traffic_like_the_fits_does_not_drift() -> None:
    rng = np.random.default_rng(0)
    p = topic_partition([0, 1], ("a", "b"))
    baseline = DriftBaseline.of(p, p.calibration.apply(topic_counts(rng, 0, 20)))
    m = monitor(p, DriftBaseline(baseline.best_similarity, 0.0))
    m.observe_many(np.concatenate([topic_counts(rng, 0, 20), topic_counts(rng, 1, 20)]))
    status = m.status()
    assert not status.drifted, status.reason
    assert status.samples == 40


def test_a_new_topic_far_from_every_centroid_is_drift() -> None:
    rng = np.random.default_rng(1)
    p = topic_partition([0, 1], ("a", "b"))
    train = np.concatenate([topic_counts(rng, 0, 20), topic_counts(rng, 1, 20)])
    m = monitor(p, DriftBaseline.of(p, p.calibration.apply(train)))
    for row in topic_counts(rng, 3, 40):  # experts 6-7: no centroid covers them
        m.observe(row.reshape(L, E))
    status = m.status()
    assert status.drifted
    assert status.similarity_drop > 0.3
    assert "similarity" in status.reason


def test_traffic_piling_onto_one_cluster_is_drift() -> None:
    rng = np.random.default_rng(2)
    p = topic_partition([0, 1], ("a", "b"))
    m = monitor(p, DriftBaseline(best_similarity=0.0, occupancy_skew=0.0))
    m.observe_many(topic_counts(rng, 1, 40))
    status = m.status()
    assert status.drifted
    assert "occupancy skew" in status.reason


def test_no_verdict_before_enough_samples() -> None:
    rng = np.random.default_rng(3)
    p = topic_partition([0, 1], ("a", "b"))
    m = monitor(p, DriftBaseline(best_similarity=1.0, occupancy_skew=0.0))
    m.observe_many(topic_counts(rng, 3, 10))
    status = m.status()
    assert not status.drifted
    assert "need 32" in status.reason


def test_without_a_baseline_the_first_requests_served_set_it() -> None:
    rng = np.random.default_rng(4)
    p = topic_partition([0, 1], ("a", "b"))
    m = monitor(p, None)
    m.observe_many(np.concatenate([topic_counts(rng, 0, 16), topic_counts(rng, 1, 16)]))
    assert m.baseline is not None
    assert len(m) == 0  # the samples that set the baseline are not judged against it
    m.observe_many(topic_counts(rng, 3, 40))
    assert m.status().drifted


def test_only_a_held_out_baseline_is_taken_from_a_fits_metrics() -> None:
    rng = np.random.default_rng(5)
    prefill = np.concatenate([topic_counts(rng, t, 12) for t in range(3)])
    held = np.concatenate([topic_counts(rng, t, 4) for t in range(3)])
    p_in, r_in = fit_partition(
        prefill, None, GEOMETRY, ["a", "b", "c"], version=1, model="m", seed=0
    )
    p_out, r_out = fit_partition(
        prefill, None, GEOMETRY, ["a", "b", "c"], version=1, model="m", seed=0, holdout_prefill=held
    )
    assert r_in.best_similarity is not None
    assert not r_in.baseline_held_out
    assert DriftBaseline.from_metrics(p_in.metrics) is None
    assert r_out.baseline_held_out
    baseline = DriftBaseline.from_metrics(p_out.metrics)
    assert baseline is not None
    assert baseline.best_similarity == pytest.approx(r_out.best_similarity)


# --- shadow evaluation --------------------------------------------------------------------


def test_the_shadow_routes_with_the_profile_it_is_given() -> None:
    rng = np.random.default_rng(3)
    prefill = np.concatenate([topic_counts(rng, t, 8) for t in (0, 1)])
    workers = ("a", "b", "c", "d")
    partition = topic_partition([0, 1, 2, 3], workers)

    def sent(profile: ProfileBase) -> list[int]:
        groups = shadow_assignment(
            partition, prefill, workers, profile=profile, batch=8, num_moe_layers=L
        )
        return list(np.bincount(groups, minlength=4).tolist())

    # The band rule at tau 0: each request to its topic's worker; JSQ ignores topics.
    assert sent(EldrProfile(tau=0.0)) == [8, 8, 0, 0]
    assert sent(JsqProfile()) == [4, 4, 4, 4]


def test_the_shadow_of_the_cost_aware_profile_reads_predicted_activity() -> None:
    rng = np.random.default_rng(4)
    prefill = np.concatenate([topic_counts(rng, t, 16) for t in (0, 1)])[rng.permutation(32)]
    workers = ("a", "b")
    partition = topic_partition([0, 1], workers)
    groups = shadow_assignment(
        partition, prefill, workers, profile=EldrCostProfile(), batch=16, num_moe_layers=L
    )
    topic = prefill[:, 0:2].sum(axis=1) > prefill[:, 2:4].sum(axis=1)
    # No partition bonus: what keeps each topic's requests together is the activity the
    # requests already on a worker are predicted to have.
    for members in (groups[topic], groups[~topic]):
        assert np.mean(members == np.bincount(members).argmax()) > 0.8
    assert set(groups[topic]) != set(groups[~topic])


def test_identical_requests_cost_their_own_union() -> None:
    act = np.zeros((4, L * E))
    act[:, [0, E + 1]] = 1.0  # every decode token uses expert 0 (layer 0) and 1 (layer 1)
    # (at batch 1 nothing is shared, so mixing costs the same: hence batches of 2 and up)
    union = modelled_union(np.zeros(4, dtype=np.int64), act, 1, batch=8, num_layers=L)
    assert union == pytest.approx(1.0)


@given(st.integers(1, 8), st.floats(2.0, 32.0))
def test_mixing_disjoint_requests_on_one_worker_costs_more_than_separating_them(
    seed: int, batch: float
) -> None:
    rng = np.random.default_rng(seed)
    act = np.zeros((8, L * E))
    for i in range(8):
        experts = [0, 1] if i < 4 else [6, 7]
        act[i, [layer * E + e for layer in range(L) for e in experts]] = rng.uniform(0.2, 0.5)
    separated = modelled_union(np.repeat([0, 1], 4), act, 2, batch, L)
    mixed = modelled_union(np.tile([0, 1], 4), act, 2, batch, L)
    assert separated < mixed


def test_a_partition_that_matches_the_topics_wins_the_shadow_evaluation() -> None:
    rng = np.random.default_rng(6)
    prefill = np.concatenate([topic_counts(rng, t, 16) for t in range(4)])
    order = rng.permutation(prefill.shape[0])
    prefill = prefill[order]
    decode = prefill * 4  # decode follows the prompt's topic
    workers = ("a", "b", "c", "d")
    good = topic_partition([0, 1, 2, 3], workers)
    bad = topic_partition([0, 0, 1, 1], workers)  # topics 2 and 3 have no home
    act = per_token_activation(decode, L)
    # tau 0: each request to its best-scoring worker (tau > 0 widens a one-member band to
    # the two best, which sends about half of each topic to a random second-best worker).
    tau0 = EldrProfile(tau=0.0)
    result = shadow_evaluate(
        bad, good, prefill, act, workers, profile=tau0, batch=8, num_moe_layers=L
    )
    assert result.n_eval == 64
    assert result.candidate_union < result.active_union
    assert result.change < 0
    again = shadow_evaluate(
        good, good, prefill, act, workers, profile=EldrProfile(), batch=8, num_moe_layers=L
    )
    assert again.change == pytest.approx(0.0)


def test_per_token_activation_divides_by_decode_tokens() -> None:
    counts = np.zeros((1, L * E))
    counts[0, [0, 1]] = [3, 1]  # 4 tokens, layer 0
    counts[0, [E + 2]] = 4
    act = per_token_activation(counts, L)
    assert act[0, 0] == pytest.approx(0.75)
    assert act[0, E + 2] == pytest.approx(1.0)


# --- verdicts and triggers ------------------------------------------------------------------


def shadow(active: float, candidate: float) -> ShadowResult:
    return ShadowResult(100, 16.0, active, candidate)


def test_a_candidate_is_promoted_only_when_the_shadow_predicts_a_lower_union() -> None:
    assert promotion_verdict(shadow(10.0, 9.5), 0.0).promote
    kept = promotion_verdict(shadow(10.0, 10.0), 0.0)
    assert not kept.promote
    assert "rejected" in kept.reason
    assert "+0.00%" in kept.reason
    margin = promotion_verdict(shadow(10.0, 9.95), 0.01)
    assert not margin.promote
    assert "1.00% lower" in margin.reason


def test_without_a_shadow_result_the_active_version_stays_unless_forced() -> None:
    kept = promotion_verdict(None, 0.0, missing="3 held-out requests")
    assert not kept.promote
    assert "3 held-out requests" in kept.reason
    forced = promotion_verdict(None, 0.0, forced="no active version")
    assert forced.promote
    assert "no active version" in forced.reason


def trigger(**kw: object) -> str | None:
    base: dict[str, object] = dict(
        now_s=100.0,
        last_fit_s=90.0,
        interval_s=60.0,
        live=("a", "b"),
        active_workers=("a", "b"),
        live_since_s=0.0,
        churn_settle_s=5.0,
        drift=None,
        min_gap_s=30.0,
    )
    base.update(kw)
    return refit_trigger(**base)  # type: ignore[arg-type]


def test_triggers() -> None:
    assert trigger() is None
    assert trigger(last_fit_s=30.0) == "schedule"
    assert trigger(interval_s=0.0, last_fit_s=0.0) is None
    # A worker joined 10 s ago: churn; 2 s ago: wait for the set to settle.
    assert trigger(live=("a", "b", "c"), live_since_s=90.0) == "churn"
    assert trigger(live=("a", "b", "c"), live_since_s=98.0) is None
    assert trigger(live=("a",), live_since_s=0.0) == "churn"
    assert trigger(live=("a", "b", "c"), active_workers=None) is None


def test_drift_triggers_a_refit_at_most_once_per_gap() -> None:
    rng = np.random.default_rng(7)
    p = topic_partition([0, 1], ("a", "b"))
    m = monitor(p, DriftBaseline(best_similarity=1.0, occupancy_skew=0.0))
    m.observe_many(topic_counts(rng, 3, 40))
    drifted = m.status()
    assert drifted.drifted
    assert trigger(drift=drifted, last_fit_s=60.0) == "drift"
    assert trigger(drift=drifted, last_fit_s=80.0) is None


def test_holdout_is_a_stable_hash_of_the_request_id() -> None:
    ids = [f"req-{i}" for i in range(4000)]
    mask = holdout_mask(ids, 0.2)
    assert 0.17 < mask.mean() < 0.23
    assert holdout_mask(ids[::-1], 0.2).tolist() == mask[::-1].tolist()
    assert not holdout_mask(ids, 0.0).any()
    with pytest.raises(ValueError, match="fraction"):
        holdout_mask(ids, 1.0)
