"""The offline reference: exact loads in the lockstep model, a search that keeps the ceiling."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from eldr.bench.reference import LockstepModel


def brute_force_loads(model: LockstepModel, decode: list[np.ndarray], asg: np.ndarray) -> int:
    total = 0
    for w in range(model.num_workers):
        for step in range(model.num_steps):
            ids: set[int] = set()
            for a in np.flatnonzero(asg == w):
                k = step - int(model.first_step[a])
                if 0 <= k < int(model.tokens[a]):
                    ids.update(int(x) for x in decode[int(model.requests[a])][k])
            total += len(ids)
    return total


def two_kinds() -> tuple[list[np.ndarray], LockstepModel]:
    decode = [np.tile([0, 1], (4, 1)), np.tile([2, 3], (4, 1))]  # kind A, kind B
    requests = np.array([0, 1, 0, 1])
    model = LockstepModel(decode, requests, np.zeros(4), 0.01, num_workers=2, union_slots=4)
    return decode, model


def test_loads_count_distinct_experts_per_worker_and_step() -> None:
    decode, model = two_kinds()
    mixed = np.array([0, 1, 1, 0])  # each worker runs one A and one B
    assert model.loads(mixed) == brute_force_loads(model, decode, mixed) == 2 * 4 * 4
    assert model.batches(mixed).tolist() == [[2, 2, 2, 2], [2, 2, 2, 2]]


def test_the_search_separates_kinds_by_a_swap_when_the_ceiling_blocks_moves() -> None:
    _, model = two_kinds()
    mixed = np.array([0, 1, 1, 0])
    cap = model.batches(mixed).max(axis=0)  # 2 per worker: no single move is allowed
    found = model.search([mixed], cap)
    assert found.loads == 2 * 4 * 2
    assert found.start_loads == {"start 0": 32}
    a, b = found.assignment[[0, 2]], found.assignment[[1, 3]]
    assert a[0] == a[1]
    assert b[0] == b[1]
    assert a[0] != b[0]


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    workers=st.integers(2, 4),
    arrivals=st.integers(4, 30),
)
def test_the_search_never_worsens_the_start_and_keeps_the_ceiling(
    seed: int, workers: int, arrivals: int
) -> None:
    rng = np.random.default_rng(seed)
    slots = 12
    decode = [rng.integers(0, slots, size=(int(rng.integers(1, 6)), 2)) for _ in range(5)]
    decode = [np.sort(d, axis=1) for d in decode]
    requests = rng.integers(0, 5, size=arrivals)
    arrival_s = np.sort(rng.uniform(0, 0.1, size=arrivals))
    model = LockstepModel(decode, requests, arrival_s, 0.01, workers, slots)
    start = rng.integers(0, workers, size=arrivals)
    cap = model.batches(start).max(axis=0)
    found = model.search([start], cap)
    assert found.loads <= found.start_loads["start 0"]
    assert found.loads == model.loads(found.assignment)
    assert found.loads == brute_force_loads(model, decode, found.assignment)
    assert (model.batches(found.assignment) <= cap[None, :]).all()
