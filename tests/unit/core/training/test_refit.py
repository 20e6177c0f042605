"""The trainer's refit plan (`eldr.core.training.refit`): which requests, whether gated,
the fit, the shadow gate and the verdict, and the state between refits; pure, no I/O."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from eldr.core.routing.profile import DEFAULT_PROFILE, EldrCostProfile
from eldr.core.signature.sparse import SparseRow
from eldr.core.training.config import TrainerConfig
from eldr.core.training.online import per_token_activation, promotion_verdict, shadow_evaluate
from eldr.core.training.refit import (
    FitAborted,
    FitFailed,
    RefitSkipped,
    TrainerState,
    plan_refit,
    shadow_batch,
)
from eldr.core.workload.synthetic import SyntheticSpec, generate
from eldr.core.workload.trace import expert_counts

SPEC = SyntheticSpec(
    num_topics=3,
    num_moe_layers=4,
    num_experts=16,
    top_k=2,
    prompt_len_range=(8, 32),
    decode_len_range=(4, 16),
)
WORKERS = ("dw0", "dw1", "dw2")
CONFIG = TrainerConfig(
    min_samples=30,
    min_profiled=10,
    reduce_dim=0,
    shadow_min_requests=5,
    shadow_holdout_fraction=0.3,
    drift_detection=False,
)


def fed(
    n: int, config: TrainerConfig = CONFIG, *, start: int = 0, ts_s: float = 0.0
) -> TrainerState:
    """A state whose window holds n requests at ts_s, each with its decode summary."""
    state = TrainerState(config, mono_s=0.0)
    feed(state, n, start=start, ts_s=ts_s)
    return state


def feed(state: TrainerState, n: int, *, start: int = 0, ts_s: float = 0.0) -> None:
    traces = generate(SPEC, n, np.random.default_rng(start)).traces
    for i, trace in enumerate(traces):
        rid = f"req-{start + i}"
        prefill = expert_counts(trace.prefill, SPEC.num_experts).astype(np.float32)
        decode = expert_counts(trace.decode, SPEC.num_experts).astype(np.float32)
        state.add_decision(rid, "m", WORKERS[i % 3], SparseRow.from_dense(prefill), ts_s)
        state.add_summary(rid, SparseRow.from_dense(decode), ts_s)


def refit(state: TrainerState, trigger: str, *, now_s: float = 1.0) -> None:
    selection = state.select(now_s=now_s, live=WORKERS, k=None, trigger=trigger)
    state.apply(plan_refit(selection, state.active, config=CONFIG, in_flight={}))


# --- the requests ----------------------------------------------------------------------------


def test_a_scheduled_refit_of_an_unchanged_window_is_skipped() -> None:
    state = fed(60)
    refit(state, "request")
    with pytest.raises(RefitSkipped, match="no new requests"):
        state.select(now_s=2.0, live=WORKERS, k=None, trigger="schedule")


def test_too_few_requests_or_workers_are_skipped_with_the_reason() -> None:
    state = fed(10)
    with pytest.raises(RefitSkipped, match="10 request"):
        state.select(now_s=1.0, live=WORKERS, k=None, trigger="request")
    with pytest.raises(RefitSkipped, match="no live decode workers"):
        state.select(now_s=1.0, live=(), k=None, trigger="request")
    with pytest.raises(RefitSkipped, match="k=4"):
        state.select(now_s=1.0, live=WORKERS, k=4, trigger="request")


def test_a_drift_refit_fits_on_recent_requests_when_there_are_enough() -> None:
    config = dataclasses.replace(CONFIG, drift_fit_max_age_s=10.0)
    state = fed(40, config, ts_s=0.0)
    feed(state, 40, start=100, ts_s=50.0)
    recent = state.select(now_s=55.0, live=WORKERS, k=None, trigger="drift")
    assert (len(recent.snapshot), recent.window_requests, recent.cut) == (40, 80, 40)
    assert recent.since_s == 45.0


def test_with_too_few_recent_requests_a_drift_refit_fits_on_the_whole_window() -> None:
    config = dataclasses.replace(CONFIG, drift_fit_max_age_s=10.0)
    state = fed(40, config, ts_s=0.0)
    feed(state, 5, start=100, ts_s=50.0)
    selection = state.select(now_s=55.0, live=WORKERS, k=None, trigger="drift")
    assert len(selection.snapshot) == 45
    assert selection.cut == 0


# --- fit, shadow, verdict -----------------------------------------------------------------------


def test_the_first_version_is_promoted_without_a_gate_and_fitted_on_every_request() -> None:
    state = fed(60)
    selection = state.select(now_s=1.0, live=WORKERS, k=None, trigger="schedule")
    result = plan_refit(selection, None, config=CONFIG, in_flight={})
    assert result.promote
    assert result.ungated == "no active version"
    assert (result.n_held_out, result.shadow) == (0, None)
    assert result.report.n_train == 60
    assert result.partition.version == 1


def test_a_gated_refit_holds_out_requests_and_judges_by_the_shadow() -> None:
    state = fed(60)
    refit(state, "request")
    feed(state, 60, start=100)
    selection = state.select(now_s=1.0, live=WORKERS, k=None, trigger="schedule")
    result = plan_refit(selection, state.active, config=CONFIG, in_flight={})
    assert result.ungated == ""
    assert result.n_held_out > 0
    assert result.report.n_train == 120 - result.n_held_out
    assert result.shadow is not None
    assert result.shadow.n_eval == result.n_held_out
    assert result.promote == (result.shadow.change < 0)
    assert result.partition.version == 2


def test_churn_refits_are_ungated_and_name_who_joined_and_left() -> None:
    state = fed(60)
    refit(state, "request")
    live = ("dw0", "dw1", "dw9")
    selection = state.select(now_s=1.0, live=live, k=None, trigger="churn")
    result = plan_refit(selection, state.active, config=CONFIG, in_flight={})
    assert result.promote
    assert result.ungated == "the workers differ from version 1's (joined: dw9; left: dw2)"
    assert result.partition.workers == live


def test_too_few_held_out_requests_reject_a_gated_candidate() -> None:
    config = dataclasses.replace(CONFIG, shadow_min_requests=10_000)
    state = fed(60, config)
    refit(state, "request")
    feed(state, 10, start=100)
    selection = state.select(now_s=1.0, live=WORKERS, k=None, trigger="schedule")
    result = plan_refit(selection, state.active, config=config, in_flight={})
    assert not result.promote
    assert "a shadow evaluation needs 10000" in result.verdict.reason


def test_a_checkpoint_that_aborts_ends_the_refit_before_any_verdict() -> None:
    state = fed(60)
    selection = state.select(now_s=1.0, live=WORKERS, k=None, trigger="request")

    def stop() -> None:
        raise FitAborted("the fit took longer than fit_timeout_s=1 s")

    with pytest.raises(FitFailed, match=r"fit abandoned after .* \(60 requests, 3 workers\)"):
        plan_refit(selection, None, config=CONFIG, in_flight={}, checkpoint=stop)


def test_the_shadow_batch_is_the_setting_else_the_mean_in_flight_but_at_least_eight() -> None:
    assert shadow_batch(3.0, {"a": 100}, ("a",)) == 3.0
    assert shadow_batch(0.0, {"a": 10, "b": 16}, ("a", "b")) == 13.0
    assert shadow_batch(0.0, {}, ("a",)) == 8.0


# --- between refits ----------------------------------------------------------------------------


def test_only_a_promoted_drift_refit_moves_the_drift_cut() -> None:
    config = dataclasses.replace(CONFIG, drift_fit_max_age_s=10.0)
    state = fed(60, config)
    refit(state, "request")
    assert state.drift_cut_s == -math.inf
    feed(state, 60, start=100, ts_s=50.0)
    selection = state.select(now_s=55.0, live=WORKERS, k=None, trigger="drift")
    result = plan_refit(selection, state.active, config=config, in_flight={})
    state.apply(result)
    assert state.drift_cut_s == (45.0 if result.promote else -math.inf)
    assert result.drift_cut_s == state.drift_cut_s


def test_a_refit_is_due_on_the_schedule_and_on_a_settled_worker_change() -> None:
    config = dataclasses.replace(CONFIG, refit_interval_s=10.0, churn_settle_s=2.0)
    state = fed(60, config)
    refit(state, "request")
    state.restart_schedule(0.0)
    assert state.due(now_s=5.0, mono_s=5.0, live=WORKERS, drift=None) is None
    assert state.due(now_s=10.0, mono_s=10.0, live=WORKERS, drift=None) == ("schedule", "scheduled")
    state.restart_schedule(10.0)
    changed = ("dw0", "dw1", "dw3")
    assert state.due(now_s=11.0, mono_s=11.0, live=changed, drift=None) is None  # not settled yet
    assert state.due(now_s=13.0, mono_s=13.0, live=changed, drift=None) == (
        "churn",
        "worker set changed: joined dw3, left dw2",
    )


# --- the trainer matters under the routers' default ---------------------------------------------

TOPIC_EXPERTS = 4
"""Experts each topic's tokens route to (per layer), in the SPEC geometry (4 x 16)."""


def topic_rows(topic: int, n: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(prefill, decode) counts of `n` requests of one topic: 85% of tokens on its experts."""
    rng = np.random.default_rng([seed, topic])
    layers, experts = SPEC.num_moe_layers, SPEC.num_experts
    out = []
    for _ in range(n):
        rows = []
        for tokens in (16, 48):
            c = np.zeros(layers * experts, dtype=np.float32)
            for layer in range(layers):
                for _ in range(tokens):
                    if rng.random() < 0.85:
                        e = TOPIC_EXPERTS * topic + int(rng.integers(TOPIC_EXPERTS))
                    else:
                        e = int(rng.integers(experts))
                    c[layer * experts + e] += SPEC.top_k
            rows.append(c)
        out.append((rows[0], rows[1]))
    return out


def feed_topics(state: TrainerState, topics: list[int], n: int, start: int, ts_s: float) -> None:
    for k, (prefill, decode) in enumerate(row for t in topics for row in topic_rows(t, n, start)):
        rid = f"t{start}-{k}"
        shape = (SPEC.num_moe_layers, SPEC.num_experts)
        state.add_decision(
            rid, "m", WORKERS[k % 3], SparseRow.from_dense(prefill.reshape(shape)), ts_s
        )
        state.add_summary(rid, SparseRow.from_dense(decode.reshape(shape)), ts_s)


def test_under_the_default_a_refit_after_the_traffic_shifts_is_promoted() -> None:
    """The routers' default routes by the partition, so the trainer's gate sees a partition
    fitted for traffic that is gone differ from one fitted for the traffic now: a refit on
    the new traffic is promoted (before issue 21 every candidate tied the active version,
    0.00%, and was rejected)."""
    config = dataclasses.replace(CONFIG, drift_fit_max_age_s=10.0, shadow_min_requests=20)
    assert config.routing_profile == DEFAULT_PROFILE
    state = TrainerState(config, mono_s=0.0)
    feed_topics(state, [0, 1], 40, start=1, ts_s=0.0)
    first = state.select(now_s=1.0, live=WORKERS, k=None, trigger="request")
    state.apply(plan_refit(first, None, config=config, in_flight={}))
    feed_topics(state, [2, 3], 60, start=2, ts_s=50.0)  # the traffic shifts
    selection = state.select(now_s=55.0, live=WORKERS, k=None, trigger="drift")
    result = plan_refit(selection, state.active, config=config, in_flight={})
    assert result.shadow is not None
    assert result.shadow.change < -0.02, result.verdict.reason
    assert result.promote, result.verdict.reason
    # The gate of a profile that reads no partition cannot tell the two apart.
    blind = dataclasses.replace(config, routing_profile=EldrCostProfile())
    unseen = plan_refit(selection, state.active, config=blind, in_flight={})
    assert unseen.shadow is not None
    assert unseen.shadow.change == 0.0
    assert not unseen.promote


def test_under_the_default_a_worse_partition_is_rejected() -> None:
    """The shadow gate, routing with the default, prefers the active partition to a
    candidate whose centroids point nowhere useful (shuffled across experts) and finds no
    gain in one whose centroids were only permuted across workers: both are rejected."""
    config = dataclasses.replace(CONFIG, shadow_min_requests=20)
    state = TrainerState(config, mono_s=0.0)
    feed_topics(state, [0, 1, 2], 40, start=3, ts_s=0.0)
    selection = state.select(now_s=1.0, live=WORKERS, k=None, trigger="request")
    state.apply(plan_refit(selection, None, config=config, in_flight={}))
    good = state.active
    assert good is not None
    held = topic_rows(0, 30, 9) + topic_rows(1, 30, 9) + topic_rows(2, 30, 9)
    order = np.random.default_rng(5).permutation(len(held))
    prefill = np.stack([held[i][0] for i in order])
    act = per_token_activation(np.stack([held[i][1] for i in order]), SPEC.num_moe_layers)
    rng = np.random.default_rng(11)
    shuffled = rng.permutation(good.centroids.shape[1])
    candidates = {
        "shuffled across experts": dataclasses.replace(
            good, version=good.version + 1, centroids=good.centroids[:, shuffled]
        ),
        "permuted across workers": dataclasses.replace(
            good, version=good.version + 1, owners=np.roll(good.owners, 1)
        ),
    }
    changes = {}
    for name, bad in candidates.items():
        shadow = shadow_evaluate(
            good,
            bad,
            prefill,
            act,
            WORKERS,
            profile=DEFAULT_PROFILE,
            batch=8,
            num_moe_layers=SPEC.num_moe_layers,
        )
        verdict = promotion_verdict(shadow, config.shadow_min_gain)
        assert not verdict.promote, (name, verdict.reason)
        changes[name] = shadow.change
    assert changes["shuffled across experts"] > 0.02
    assert abs(changes["permuted across workers"]) < 0.02
