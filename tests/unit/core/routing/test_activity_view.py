"""The activity table's sparse view: what cost-aware routing reads per decision."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from eldr.core.routing.activity import (
    ActivityTable,
    ExpertDemand,
    estimate_top_k,
    expert_demand,
    request_expert_demand,
)

L, E = 3, 8

counts_st = arrays(np.int64, (L, E), elements=st.integers(0, 20))
nonzero_counts_st = counts_st.filter(lambda c: bool(c.any()))


def dense_marginal(miss: np.ndarray, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cost-aware policy's U and dU written densely over every cell."""
    return miss.shape[1] - miss.sum(axis=1), miss @ p


@settings(max_examples=60)
@given(
    st.lists(st.tuples(nonzero_counts_st, st.integers(0, 2)), min_size=1, max_size=8),
    st.lists(st.integers(0, 7), max_size=4),
    nonzero_counts_st,
)
def test_the_sparse_marginal_is_the_dense_one(
    held: list[tuple[np.ndarray, int]], finished: list[int], request: np.ndarray
) -> None:
    table = ActivityTable()
    workers = ["w0", "w1", "w2", "idle"]
    for i, (counts, worker) in enumerate(held):
        table.add(workers[worker], f"r{i}", expert_demand(counts), 0.0)
    for i in finished:
        table.finish(f"r{i}")
    demand = expert_demand(request)
    view = table.view(workers)
    assert view is not None
    assert len(view) == len(workers)
    union, added = view.marginal(demand)
    expected_union, expected_added = dense_marginal(view.miss(), demand.probability())
    np.testing.assert_allclose(union, expected_union, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(added, expected_added, rtol=1e-12, atol=1e-12)
    assert union[3] == 0.0
    assert added[3] == pytest.approx(demand.total, rel=1e-12)


@settings(max_examples=60)
@given(
    st.lists(st.tuples(nonzero_counts_st, st.integers(0, 2)), min_size=1, max_size=8),
    nonzero_counts_st,
    st.lists(st.integers(0, 3), min_size=1, max_size=4, unique=True),
)
def test_a_reader_of_a_few_workers_reads_what_the_view_of_all_reads(
    held: list[tuple[np.ndarray, int]], request: np.ndarray, asked: list[int]
) -> None:
    """A fleet-scale decision reads only its band (`ActivityTable.reader`): the same U and
    dU as the view of every worker, up to the order of float sums."""
    table = ActivityTable()
    workers = ["w0", "w1", "w2", "idle"]
    for i, (counts, worker) in enumerate(held):
        table.add(workers[worker], f"r{i}", expert_demand(counts), 0.0)
    demand = expert_demand(request)
    columns = np.array(sorted(asked))
    reader = table.reader(workers)
    assert reader is not None
    union, added = reader.marginal(demand, columns)
    view = table.view(workers)
    assert view is not None
    all_union, all_added = view.marginal(demand)
    np.testing.assert_allclose(union, all_union[columns], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(added, all_added[columns], rtol=1e-12, atol=1e-12)


def test_idle_workers_cost_exactly_the_same() -> None:
    # Ties between idle workers are broken by the decision's seed: their costs must be
    # equal to the last bit, whatever else the table holds.
    table = ActivityTable()
    rng = np.random.default_rng(3)
    for i in range(6):
        table.add("busy", f"r{i}", expert_demand(rng.integers(0, 4, (L, E))), 0.0)
    table.add("was-busy", "x", expert_demand(rng.integers(0, 4, (L, E))), 0.0)
    table.finish("x")
    view = table.view(["a", "busy", "was-busy", "b"])
    assert view is not None
    union, added = view.marginal(expert_demand(rng.integers(0, 4, (L, E))))
    assert union[0] == union[2] == union[3] == 0.0
    assert added[0] == added[2] == added[3]


def test_a_view_shows_the_table_as_it_was_until_the_next_view() -> None:
    table = ActivityTable()
    d = expert_demand(np.eye(L, E) * 5)
    table.add("w", "r0", d, 0.0)
    view = table.view(["w"])
    assert view is not None
    before = view.marginal(d)
    table.add("w", "r1", d, 0.0)
    table.finish("r0")
    table.finish("r1")
    after = view.marginal(d)  # still the table at the time of the view
    np.testing.assert_array_equal(before[0], after[0])
    np.testing.assert_array_equal(before[1], after[1])
    newer = table.view(["w"])
    assert newer is not None
    assert newer.marginal(d)[0][0] == 0.0  # the worker is idle again
    with pytest.raises(RuntimeError, match="later one"):
        view.marginal(d)


def test_rows_follow_changes_between_views_over_the_same_workers() -> None:
    table = ActivityTable()
    rng = np.random.default_rng(5)
    demands = [expert_demand(rng.integers(0, 3, (L, E))) for _ in range(12)]
    workers = ["a", "b", "c"]
    for step, d in enumerate(demands):
        table.add(workers[step % 3], f"r{step}", d, 0.0)
        if step >= 4:
            table.finish(f"r{step - 4}")
        view = table.view(workers)
        assert view is not None
        fresh = ActivityTable()
        for rid in range(max(0, step - 3), step + 1):
            fresh.add(workers[rid % 3], f"r{rid}", demands[rid], 0.0)
        reference = fresh.view(workers)
        assert reference is not None
        np.testing.assert_allclose(view.miss(), reference.miss(), rtol=1e-12)


def test_a_demand_of_another_geometry_is_refused() -> None:
    table = ActivityTable()
    table.add("w", "r", expert_demand(np.ones((L, E))), 0.0)
    view = table.view(["w"])
    assert view is not None
    with pytest.raises(ValueError, match="activity table"):
        view.marginal(expert_demand(np.ones((L + 1, E))))


@given(counts_st, st.integers(0, 40), st.integers(0, 3), st.floats(0.1, 5.0))
def test_the_request_path_demand_is_expert_demand(
    counts: np.ndarray, prompt_tokens: int, top_k: int, prior: float
) -> None:
    got = request_expert_demand(
        counts.astype(np.uint32), prompt_tokens, top_k=top_k, prior_tokens=prior
    )
    if not counts.any():
        assert got is None
        return
    k = top_k or estimate_top_k(counts, prompt_tokens)
    want = expert_demand(counts.astype(np.float64), top_k=min(k, E), prior_tokens=prior)
    assert got is not None
    # Bit for bit: the router's demand is the one the simulator and replay compute.
    np.testing.assert_array_equal(got.idx, want.idx)
    np.testing.assert_array_equal(got.base, want.base)
    np.testing.assert_array_equal(got.excess, want.excess)


def test_negative_counts_are_refused_on_the_request_path() -> None:
    counts = np.zeros((L, E))
    counts[1, 2] = -1
    with pytest.raises(ValueError, match="non-negative"):
        request_expert_demand(counts, 4)


@given(nonzero_counts_st, st.integers(1, 3))
def test_the_cached_probabilities_are_those_of_the_fields(counts: np.ndarray, top_k: int) -> None:
    made = expert_demand(counts, top_k=top_k)
    rebuilt = ExpertDemand(made.num_moe_layers, made.num_experts, made.base, made.idx, made.excess)
    np.testing.assert_array_equal(made.layer_of, rebuilt.layer_of)
    np.testing.assert_allclose(made.p_base, rebuilt.p_base, rtol=1e-12)
    np.testing.assert_allclose(made.p_excess, rebuilt.p_excess, rtol=1e-9, atol=1e-15)
    dense = made.probability()
    np.testing.assert_allclose(rebuilt.p_excess + rebuilt.p_base[rebuilt.layer_of], dense[made.idx])
    assert made.total == pytest.approx(dense.sum(), rel=1e-12)


@settings(max_examples=40)
@given(
    st.lists(
        st.tuples(st.sampled_from(["add", "finish", "move", "view"]), st.integers(0, 30)),
        max_size=40,
    )
)
def test_a_view_is_the_table_after_any_changes_since_the_last(ops: list[tuple[str, int]]) -> None:
    # Views copy only the cells that changed since the previous view (or whole columns
    # when a worker went idle or changed often): whatever happened in between, a view
    # equals one built afresh from the requests held.
    rng = np.random.default_rng(7)
    pool = [
        expert_demand(rng.integers(0, 3, (L, E)) + (rng.random((L, E)) < 0.1)) for _ in range(8)
    ]
    workers = ["a", "b", "c"]
    table = ActivityTable()
    held: dict[str, tuple[str, int]] = {}
    for n, (op, k) in enumerate(ops):
        if op == "add":
            rid, w = f"r{n}", workers[k % 3]
            if table.add(w, rid, pool[k % len(pool)], 0.0):
                held[rid] = (w, k % len(pool))
        elif op == "finish" and held:
            rid = sorted(held)[k % len(held)]
            table.finish(rid)
            del held[rid]
        elif op == "move" and held:
            rid = sorted(held)[k % len(held)]
            table.move(rid, workers[(k // 3) % 3])
            held[rid] = (workers[(k // 3) % 3], held[rid][1])
        if op != "view" and n < len(ops) - 1:
            continue  # several changes between two views
        view = table.view(workers)
        if view is None:
            continue
        fresh = ActivityTable()
        fresh.set_shape((L, E))
        for rid, (w, d) in held.items():
            fresh.add(w, rid, pool[d], 0.0)
        reference = fresh.view(workers)
        assert reference is not None
        np.testing.assert_allclose(view.miss(), reference.miss(), rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(
            view.marginal(pool[0])[1], reference.marginal(pool[0])[1], rtol=1e-9
        )
