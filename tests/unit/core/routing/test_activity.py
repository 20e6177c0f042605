"""Predicted per-step expert activity: request demand and the per-worker table."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from eldr.core.routing.activity import ActivityTable, estimate_top_k, expert_demand

L, E = 3, 8

counts_st = arrays(np.int64, (L, E), elements=st.integers(0, 20))


def routed_counts(tokens: int, top_k: int, seed: int) -> np.ndarray:
    """Counts of `tokens` tokens each routed to top_k distinct experts per layer."""
    rng = np.random.default_rng(seed)
    counts = np.zeros((L, E))
    for layer in range(L):
        for _ in range(tokens):
            counts[layer, rng.choice(E, size=top_k, replace=False)] += 1
    return counts


@given(st.integers(0, 30), st.integers(1, 4), st.floats(0.1, 10.0), st.integers(0, 1000))
def test_demand_per_layer_sums_to_top_k(tokens: int, top_k: int, prior: float, seed: int) -> None:
    # Every token activates top_k experts per layer, so the expected number of active
    # experts per layer and token is top_k whatever the prompt.
    counts = routed_counts(tokens, top_k, seed)
    p = expert_demand(counts, top_k=top_k, prior_tokens=prior).probability().reshape(L, E)
    assert np.all((p > 0) & (p < 1))
    np.testing.assert_allclose(p.sum(axis=1), top_k, rtol=1e-6)


@given(counts_st)
def test_demand_follows_the_prompt_and_is_sparse_around_a_base(counts: np.ndarray) -> None:
    d = expert_demand(counts, top_k=1, prior_tokens=1.0)
    h = d.log_miss().reshape(L, E)
    assert d.idx.tolist() == np.flatnonzero(counts.reshape(-1)).tolist()
    for layer in range(L):
        untouched = counts[layer] == 0
        np.testing.assert_allclose(h[layer][untouched], d.base[layer])
        # An expert the prompt used more is more likely in decode.
        order = np.argsort(counts[layer], kind="stable")
        assert np.all(np.diff(h[layer][order]) >= -1e-12)
    np.testing.assert_allclose(d.probability(), -np.expm1(-d.log_miss()))


def test_a_layer_without_counts_predicts_uniform() -> None:
    counts = np.zeros((L, E))
    counts[0, 2] = 5
    p = expert_demand(counts, top_k=2, prior_tokens=1.0).probability().reshape(L, E)
    np.testing.assert_allclose(p[1], 2 / E)


def test_demand_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="layers, experts"):
        expert_demand(np.zeros(4))
    with pytest.raises(ValueError, match="top_k"):
        expert_demand(np.ones((L, E)), top_k=E + 1)
    with pytest.raises(ValueError, match="prior"):
        expert_demand(np.ones((L, E)), prior_tokens=0.0)


def test_top_k_is_estimated_from_layer_totals() -> None:
    counts = np.zeros((L, E))
    counts[:, :2] = 7  # 7 tokens, each routed to 2 experts per layer
    assert estimate_top_k(counts, prompt_tokens=7) == 2
    assert estimate_top_k(counts, prompt_tokens=0) == 1
    assert estimate_top_k(np.zeros((L, E)), prompt_tokens=5) == 1


def one_hot(expert: int, tokens: int = 10) -> np.ndarray:
    counts = np.zeros((L, E))
    counts[:, expert] = tokens
    return counts


@settings(max_examples=30)
@given(st.lists(counts_st, min_size=1, max_size=5))
def test_idle_probability_is_the_product_over_in_flight_requests(
    prompts: list[np.ndarray],
) -> None:
    table = ActivityTable()
    demands = [expert_demand(c) for c in prompts]
    for i, d in enumerate(demands):
        assert table.add("w", f"r{i}", d, now_s=0.0)
    miss = table.miss_view(["w", "idle"])
    assert miss is not None
    expected = np.prod([1.0 - d.probability() for d in demands], axis=0)
    np.testing.assert_allclose(miss[0], expected, rtol=1e-9, atol=1e-12)
    np.testing.assert_array_equal(miss[1], 1.0)


def test_finishing_every_request_leaves_the_worker_exactly_idle() -> None:
    table = ActivityTable()
    for i in range(5):
        table.add("w", f"r{i}", expert_demand(one_hot(i % E)), 0.0)
    for i in range(5):
        assert table.finish(f"r{i}")
    assert not table.finish("r0")
    assert table.requests_on("w") == 0
    miss = table.miss_view(["w"])
    assert miss is not None
    np.testing.assert_array_equal(miss, 1.0)


def test_a_request_is_counted_once() -> None:
    table = ActivityTable()
    d = expert_demand(one_hot(1))
    assert table.add("w", "r", d, 0.0)
    assert not table.add("other", "r", d, 0.0)
    assert table.requests_on("w") == 1
    assert table.requests_on("other") == 0


def test_requests_whose_finish_never_arrives_expire() -> None:
    table = ActivityTable(ttl_s=10.0)
    table.add("w", "old", expert_demand(one_hot(1)), now_s=0.0)
    table.add("w", "new", expert_demand(one_hot(2)), now_s=8.0)
    assert table.expire(now_s=12.0) == 1
    assert "old" not in table
    assert "new" in table


def test_a_worker_that_leaves_is_forgotten_with_its_requests() -> None:
    table = ActivityTable()
    table.add("a", "r1", expert_demand(one_hot(1)), 0.0)
    table.add("b", "r2", expert_demand(one_hot(2)), 0.0)
    assert table.remove_worker("a") == 1
    assert len(table) == 1
    assert table.requests_on("a") == 0


def test_a_demand_of_another_geometry_cannot_wipe_the_table() -> None:
    # One event of a forged geometry used to clear every worker's activity.
    table = ActivityTable()
    table.add("a", "r1", expert_demand(one_hot(1)), 0.0)
    shape = table.shape
    assert not table.add("a", "r2", expert_demand(np.ones((2, 4))), 0.0)
    assert table.refused_shape == 1
    assert table.shape == shape
    assert "r1" in table
    assert len(table) == 1
    assert ActivityTable().miss_view(["a"]) is None


def test_an_empty_table_takes_the_next_geometry() -> None:
    table = ActivityTable()
    table.add("a", "r1", expert_demand(one_hot(1)), 0.0)
    table.finish("r1")
    assert table.add("a", "r2", expert_demand(np.ones((2, 4))), 0.0)
    assert table.shape == (2, 4)
    assert table.miss_view(["a"]) is not None


def test_a_fixed_geometry_refuses_others_even_when_empty() -> None:
    table = ActivityTable()
    table.set_shape((2, 4))
    assert not table.add("a", "r1", expert_demand(one_hot(1)), 0.0)
    assert table.add("a", "r2", expert_demand(np.ones((2, 4))), 0.0)
    table.set_shape((3, 4))  # a partition of another geometry starts it afresh
    assert len(table) == 0
    assert table.shape == (3, 4)


def test_evict_over_drops_a_workers_oldest_entries_first() -> None:
    table = ActivityTable()
    for i in range(5):
        table.add("w", f"r{i}", expert_demand(one_hot(i % E)), float(i))
    table.add("other", "x", expert_demand(one_hot(0)), 0.0)
    assert table.evict_over("w", 3) == 2
    assert "r0" not in table
    assert "r1" not in table
    assert all(f"r{i}" in table for i in (2, 3, 4))
    assert table.requests_on("other") == 1
    assert table.evict_over("w", 3) == 0
    assert table.evict_over("nobody", 0) == 0


def test_the_whole_table_is_bounded_and_its_memory_is_accounted() -> None:
    table = ActivityTable(max_entries=3)
    assert table.nbytes == 0
    for i in range(5):
        table.add(f"w{i % 2}", f"r{i}", expert_demand(one_hot(i % E)), float(i))
    assert len(table) == 3
    assert table.evicted_capacity == 2
    assert "r0" not in table
    assert "r1" not in table
    held = table.nbytes
    assert held > 0
    for rid in ("r2", "r3", "r4"):
        table.finish(rid)
    assert table.nbytes == 0
    assert table.per_worker() == {}


def test_a_moved_request_leaves_its_first_worker_and_keeps_its_age() -> None:
    table = ActivityTable(ttl_s=10.0)
    d = expert_demand(one_hot(3))
    table.add("a", "r", d, now_s=0.0)
    assert table.move("r", "b")
    assert table.worker_of("r") == "b"
    assert table.requests_on("a") == 0
    assert table.requests_on("b") == 1
    miss = table.miss_view(["a", "b"])
    assert miss is not None
    np.testing.assert_array_equal(miss[0], 1.0)
    np.testing.assert_allclose(miss[1], 1.0 - d.probability())
    assert not table.move("unknown", "b")
    assert table.expire(now_s=11.0) == 1  # the age came along


@given(st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, 9)), max_size=60))
@settings(max_examples=60, deadline=None)
def test_finishing_and_evicting_in_any_order_keeps_the_sums_exact(
    ops: list[tuple[str, int]],
) -> None:
    # Whatever the interleaving of adds, finishes, moves and evictions, each worker's
    # view equals the product over the requests it still holds.
    table = ActivityTable(max_entries=6)
    held: dict[str, tuple[str, np.ndarray]] = {}
    for step, (worker, n) in enumerate(ops):
        rid = f"r{n}"
        if n < 5:
            d = expert_demand(one_hot(n % E))
            if table.add(worker, rid, d, float(step)):
                held[rid] = (worker, d.probability())
        elif n < 7:
            table.finish(f"r{n - 5}")
        elif n == 7:
            table.move(f"r{step % 5}", worker)
        else:
            table.evict_over(worker, 1)
        held = {r: (table.worker_of(r), p) for r, (_, p) in held.items() if r in table}
    for worker in "abc":
        miss = table.miss_view([worker])
        mine = [p for (w, p) in held.values() if w == worker]
        if miss is None:
            continue
        expected = np.prod([1.0 - p for p in mine], axis=0) if mine else 1.0
        np.testing.assert_allclose(miss[0], expected, rtol=1e-9, atol=1e-12)
        assert table.requests_on(worker) == len(mine)
