"""`eldr.vllm.decode_summaries` with torch on the CPU (no vLLM engine): what the decode
instance's plugin counts per request, checked against numpy over the same rows.

Each step here is what vLLM's router callbacks leave in the plugin's buffer: the step's rows
[tokens, MoE layers, top_k] of expert ids, with -1 where a layer wrote nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
from vllm_support import SKIP_REASON

from eldr.core.workload.trace import ModelGeometry, expert_counts
from eldr.vllm.layout import StepLayout

torch = pytest.importorskip("torch", reason=SKIP_REASON)

G = ModelGeometry.of_moe(num_moe_layers=3, num_experts=8, top_k=2)


def profiles(max_requests: int = 4) -> object:
    from eldr.vllm.decode_summaries import DecodeSummaries

    return DecodeSummaries(G, max_requests=max_requests, max_rows=64, device="cpu")


def step_rows(n: int, rng: np.random.Generator) -> np.ndarray:
    out = np.empty((n, G.num_moe_layers, G.top_k), dtype=np.int32)
    for i in range(n):
        for layer in range(G.num_moe_layers):
            out[i, layer] = rng.choice(G.num_experts, size=G.top_k, replace=False)
    return out


def test_counts_equal_the_decode_rows_of_each_request_over_interleaved_steps() -> None:
    rng = np.random.default_rng(0)
    dp = profiles()
    prompts = {"a": 5, "b": 3}
    for engine_id, n_prompt in prompts.items():
        assert dp.follow(engine_id, f"req-{engine_id}", n_prompt, now_s=0.0)
    computed = {"a": 0, "b": 0}
    expected = {e: [] for e in prompts}
    # a prefills in two chunks while b prefills at once; then both decode one row a step.
    schedule = [{"a": 3, "b": 3}, {"a": 2, "b": 1}] + [{"a": 1, "b": 1}] * 5
    for t, plan in enumerate(schedule):
        ids = tuple(plan)
        layout = StepLayout(
            ids, np.array([plan[e] for e in ids]), np.array([computed[e] for e in ids])
        )
        buffer = step_rows(layout.total, rng)
        offsets = layout.offsets()
        for e, lo, hi, c in zip(ids, offsets[:-1], offsets[1:], layout.computed, strict=True):
            for row in range(lo, hi):
                if c + (row - lo) >= prompts[e]:
                    expected[e].append(buffer[row])
        dp.fold(layout, torch.from_numpy(buffer), now_s=float(t))
        for e in ids:
            computed[e] += plan[e]
    for e in prompts:
        dp.finish(e)
    done = {p.request_id: p for p in dp.ready()}
    for e in prompts:
        got = done[f"req-{e}"]
        want = expert_counts(np.stack(expected[e]), G.num_experts)
        np.testing.assert_array_equal(got.counts, want)
        assert got.tokens == len(expected[e])
        assert got.invalid_rows == 0
    assert len(dp) == 0


def test_rows_recomputed_after_a_preemption_count_once() -> None:
    rng = np.random.default_rng(1)
    dp = profiles()
    dp.follow("a", "ra", n_prompt=2, now_s=0.0)
    first = step_rows(4, rng)  # prompt 0-1, decode rows at 2 and 3
    dp.fold(StepLayout(("a",), np.array([4]), np.array([0])), torch.from_numpy(first), 0.0)
    # Preempted, then recomputed from scratch: positions 0-4, of which 2 and 3 again.
    again = step_rows(5, rng)
    dp.fold(StepLayout(("a",), np.array([5]), np.array([0])), torch.from_numpy(again), 1.0)
    dp.finish("a")
    (got,) = dp.ready()
    want = expert_counts(np.stack([first[2], first[3], again[4]]), G.num_experts)
    np.testing.assert_array_equal(got.counts, want)
    assert got.tokens == 3


def test_a_row_no_layer_wrote_spoils_the_profile_and_says_so() -> None:
    dp = profiles()
    dp.follow("a", "ra", n_prompt=1, now_s=0.0)
    buffer = step_rows(3, np.random.default_rng(2))
    buffer[2, 1] = -1
    dp.fold(StepLayout(("a",), np.array([3]), np.array([0])), torch.from_numpy(buffer), 0.0)
    dp.finish("a")
    (got,) = dp.ready()
    assert got.invalid_rows == G.top_k  # one row's two slots at layer 1


def test_slots_are_bounded_and_freed_after_the_read_back() -> None:
    dp = profiles(max_requests=2)
    assert dp.follow("a", "ra", 1, 0.0)
    assert dp.follow("b", "rb", 1, 0.0)
    assert not dp.follow("c", "rc", 1, 0.0)
    assert dp.no_slot == 1
    buffer = torch.from_numpy(step_rows(2, np.random.default_rng(3)))
    dp.fold(StepLayout(("a",), np.array([2]), np.array([0])), buffer, 0.0)
    dp.finish("a")
    dp.finish("b")  # nothing counted: freed at once, nothing to read back
    assert dp.follow("c", "rc", 1, 0.0)
    assert [p.request_id for p in dp.ready()] == ["ra"]
    assert dp.follow("d", "rd", 1, 0.0)  # a's slot is free again
    assert int(dp.counts.sum()) == 0  # zeroed for its next request
