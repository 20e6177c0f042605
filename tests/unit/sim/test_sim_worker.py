"""Continuous batching of one simulated decode worker (`eldr.sim.worker`)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eldr.core.costmodel import Deployment, GpuSpec, ModelSpec
from eldr.core.workload.trace import expert_counts
from eldr.sim.worker import (
    BatchingWorker,
    DecodeTask,
    StepPlan,
    UnionCounter,
    flatten_decode_ids,
)

E = 8
L = 2


def deployment(overhead_s: float = 0.01, kv_bytes_per_token: float = 0.0) -> Deployment:
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
        kv_bytes_per_token=kv_bytes_per_token,
    )
    return Deployment("p", model, gpu, gpus_per_worker=1, overhead_s=overhead_s)


def ids(rows: list[list[int]]) -> np.ndarray:
    """Decode ids [tokens, L, top_k=1] from per-token expert lists (one per layer)."""
    return np.array(rows, dtype=np.int16)[:, :, None]


def worker(**kwargs: int) -> BatchingWorker:
    return BatchingWorker("w0", deployment(), num_experts=E, **kwargs)


def run_step(w: BatchingWorker, now_s: float) -> tuple[StepPlan, float, list[str]]:
    plan = w.start_step(now_s)
    assert plan is not None
    end = now_s + plan.duration_s
    return plan, end, [f.request_id for f in w.finish_step(plan, end)]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 63), min_size=1, max_size=200))
def test_union_counter_counts_distinct_values(values: list[int]) -> None:
    counter = UnionCounter(64)
    arr = np.array(values, dtype=np.int64)
    assert counter.count(arr) == len(set(values))
    assert counter.count(arr[:1]) == 1  # the scratch mask was cleared


def test_flatten_offsets_ids_by_layer() -> None:
    assert flatten_decode_ids(ids([[1, 1], [2, 7]]), E).tolist() == [[1, 9], [2, 15]]


def test_idle_worker_plans_no_step() -> None:
    assert worker().start_step(0.0) is None


def test_request_runs_one_step_per_decode_token() -> None:
    w = worker()
    assert w.submit("r", ids([[0, 1], [0, 1], [2, 3]]), 0.0) is None
    now, done = 0.0, []
    steps = 0
    while not done:
        _, now, done = run_step(w, now)
        steps += 1
    assert steps == 3
    assert done == ["r"]
    assert w.idle


def test_step_union_counts_distinct_layer_expert_pairs_over_the_batch() -> None:
    w = worker()
    w.submit("a", ids([[0, 1]]), 0.0)
    w.submit("b", ids([[0, 2]]), 0.0)  # shares expert 0 at layer 0, not expert 1 at layer 1
    plan = w.start_step(0.0)
    assert plan is not None
    assert plan.union_total == 3
    assert plan.union_per_layer == pytest.approx(1.5)
    assert plan.batch_size == 2


def test_same_expert_at_different_layers_counts_twice() -> None:
    w = worker()
    w.submit("a", ids([[3, 3]]), 0.0)
    plan = w.start_step(0.0)
    assert plan is not None
    assert plan.union_total == 2


def test_step_duration_is_the_cost_models_step_time() -> None:
    cost = deployment(kv_bytes_per_token=1000.0)
    w = BatchingWorker("w0", cost, num_experts=E)
    w.submit("a", ids([[0, 1], [2, 3]]), 0.0, prompt_tokens=5)
    plan = w.start_step(0.0)
    assert plan is not None
    assert plan.kv_tokens == 5
    assert plan.duration_s == pytest.approx(cost.step_time_s(2, 5))


def test_request_submitted_mid_step_joins_at_the_next_boundary() -> None:
    w = worker()
    w.submit("a", ids([[0, 0]] * 3), 0.0)
    first = w.start_step(0.0)
    assert first is not None
    assert first.admitted == ("a",)
    w.submit("b", ids([[1, 1]] * 2), 0.001)
    w.finish_step(first, first.duration_s)
    second = w.start_step(first.duration_s)
    assert second is not None
    assert second.admitted == ("b",)
    assert second.batch_size == 2


def test_a_boundary_before_a_submission_does_not_admit_it() -> None:
    # A live worker catching up with a late event loop runs boundaries in its past: a
    # request that arrived later joins the first boundary after its submission.
    w = worker()
    w.submit("a", ids([[0, 0]] * 3), 0.0)
    first = w.start_step(0.0)
    assert first is not None
    w.submit("b", ids([[1, 1]] * 2), 0.05)
    w.finish_step(first, first.duration_s)
    behind = w.start_step(first.duration_s)  # 0.012 s, before b's submission
    assert behind is not None
    assert behind.admitted == ()
    assert behind.batch_size == 1
    w.finish_step(behind, 2 * first.duration_s)
    later = w.start_step(0.05)
    assert later is not None
    assert later.admitted == ("b",)


def test_full_batch_keeps_requests_waiting_until_a_slot_frees() -> None:
    w = worker(max_batch=2)
    w.submit("a", ids([[0, 0]]), 0.0)
    w.submit("b", ids([[0, 0]] * 3), 0.0)
    w.submit("c", ids([[0, 0]]), 0.0)
    plan, now, done = run_step(w, 0.0)
    assert plan.admitted == ("a", "b")
    assert [t.request_id for t in w.waiting] == ["c"]
    assert done == ["a"]
    plan, _, _ = run_step(w, now)
    assert plan.admitted == ("c",)


def test_kv_capacity_limits_admission_but_a_lone_request_always_runs() -> None:
    w = worker(kv_capacity_tokens=10)
    w.submit("big", ids([[0, 0]] * 2), 0.0, prompt_tokens=20)  # alone over capacity
    w.submit("small", ids([[0, 0]]), 0.0, prompt_tokens=1)
    plan = w.start_step(0.0)
    assert plan is not None
    assert plan.admitted == ("big",)
    assert [t.request_id for t in w.waiting] == ["small"]


def test_tpot_counts_queueing_before_admission() -> None:
    w = worker()
    w.submit("a", ids([[0, 0], [0, 0]]), 0.0)
    _plan, now, _ = run_step(w, 0.0)
    _, end, done = run_step(w, now + 1.0)  # the next step starts a second late
    assert done == ["a"]
    assert w.stats.tpot_s[-1] == pytest.approx(end / 2)


def test_finished_request_carries_its_decode_expert_counts() -> None:
    w = worker()
    decode = ids([[0, 1], [0, 2], [5, 1]])
    w.submit("a", decode, 0.0)
    finished = []
    now = 0.0
    while not finished:
        plan = w.start_step(now)
        assert plan is not None
        now += plan.duration_s
        finished = w.finish_step(plan, now)
    np.testing.assert_array_equal(finished[0].decode_counts, expert_counts(decode, E))
    assert finished[0].decode_tokens == 3


@pytest.mark.parametrize(
    ("decode", "reason"),
    [
        (ids([[0, E]]), "expert ids"),
        (np.zeros((0, L, 1), dtype=np.int16), "no decode tokens"),
        (np.zeros((2, L), dtype=np.int16), "must be [tokens, layers, top_k]"),
    ],
)
def test_unusable_decode_ids_are_refused(decode: np.ndarray, reason: str) -> None:
    refusal = worker().submit("a", decode, 0.0)
    assert refusal is not None
    assert reason in refusal


def test_duplicate_request_id_is_refused_while_in_the_worker() -> None:
    w = worker()
    assert w.submit("a", ids([[0, 0]]), 0.0) is None
    assert w.submit("a", ids([[0, 0]]), 0.0) == "duplicate request id"


def test_abandon_drops_running_and_waiting_requests() -> None:
    w = worker(max_batch=1)
    w.submit("a", ids([[0, 0]] * 2), 0.0, prompt_tokens=4)
    w.submit("b", ids([[0, 0]]), 0.0, prompt_tokens=4)
    w.start_step(0.0)
    assert sorted(w.abandon()) == ["a", "b"]
    assert w.idle
    assert w.kv_tokens == 0


def test_statistics_sum_union_and_batch_per_step_and_reset() -> None:
    w = worker()
    w.submit("a", ids([[0, 1], [2, 3]]), 0.0)
    w.submit("b", ids([[0, 2]]), 0.0)
    now = 0.0
    for _ in range(2):
        _, now, _ = run_step(w, now)
    assert w.stats.steps == 2
    assert w.stats.batch_sum == 3
    assert w.stats.union_per_layer_sum == pytest.approx(3 / 2 + 2 / 2)
    assert w.stats.finished == 2
    w.reset_stats()
    assert w.stats.steps == 0
    assert len(w.stats.tpot_s) == 0


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 6), st.integers(0, 30), st.floats(0.0, 0.05)),
        min_size=1,
        max_size=12,
    ),
    st.integers(1, 4),
)
def test_every_request_finishes_and_kv_returns_to_zero(
    jobs: list[tuple[int, int, float]], max_batch: int
) -> None:
    rng = np.random.default_rng(0)
    w = worker(max_batch=max_batch, kv_capacity_tokens=64)
    pending = sorted(jobs, key=lambda j: j[2])
    now, finished, kv_before = 0.0, set(), 0
    for i, (tokens, prompt, at_s) in enumerate(pending):
        decode = rng.integers(0, E, size=(tokens, L, 1)).astype(np.int16)
        assert w.submit(f"r{i}", decode, at_s, prompt_tokens=prompt) is None
        kv_before += prompt
    assert w.kv_tokens == kv_before
    while not w.idle:
        plan = w.start_step(now)
        if plan is None:  # idle until the next submission (a boundary admits only the past)
            now = min(t.submitted_s for t in w.waiting)
            continue
        assert plan.batch_size <= max_batch
        now += plan.duration_s
        finished |= {f.request_id for f in w.finish_step(plan, now)}
    assert finished == {f"r{i}" for i in range(len(pending))}
    assert w.kv_tokens == 0


def test_held_kv_charges_waiting_and_expected_prompts_to_the_step() -> None:
    cost = deployment(kv_bytes_per_token=1000.0)
    batch = BatchingWorker("w0", cost, num_experts=E, max_batch=1)
    held = BatchingWorker("w1", cost, num_experts=E, max_batch=1, step_kv="held")
    for w in (batch, held):
        w.submit("a", ids([[0, 1]]), 0.0, prompt_tokens=5)
        w.submit("b", ids([[0, 1]]), 0.0, prompt_tokens=7)  # waits: the batch is full
        w.expect(11)  # routed here, its job not arrived yet
        assert w.kv_tokens == 5 + 7 + 11
    plan_batch, plan_held = batch.start_step(0.0), held.start_step(0.0)
    assert plan_batch is not None
    assert plan_held is not None
    assert plan_batch.kv_tokens == 5
    assert plan_held.kv_tokens == 5 + 7 + 11
    assert plan_held.duration_s == cost.step_time_s(2, 23, 1)


def test_an_expected_request_is_taken_over_when_its_task_arrives() -> None:
    w = BatchingWorker("w0", deployment(), num_experts=E, kv_capacity_tokens=None)
    decode = ids([[0, 1], [2, 3]])
    w.expect(4)
    task = DecodeTask(
        request_id="a",
        prompt_tokens=4,
        flat=flatten_decode_ids(decode, E),
        num_moe_layers=L,
        submitted_s=0.0,
    )
    w.enqueue(task, expected=True)
    assert w.kv_tokens == 4
    now = 0.0
    while not w.idle:
        _, now, _ = run_step(w, now)
    assert w.kv_tokens == 0


def test_only_a_request_left_waiting_at_a_boundary_is_blocked() -> None:
    w = worker(max_batch=2)
    for rid in ("a", "b", "x"):  # x finds the batch full at the first boundary
        w.submit(rid, ids([[0, 0]]), 0.0)
    first = w.start_step(0.0)
    assert first is not None
    w.submit("c", ids([[0, 0]]), 0.001)  # arrives mid-step: joins the next boundary
    finished = w.finish_step(first, 0.01)
    second = w.start_step(0.01)
    assert second is not None
    finished += w.finish_step(second, 0.02)
    assert {f.request_id: f.blocked for f in finished} == {
        "a": False,
        "b": False,
        "x": True,
        "c": False,
    }
