"""Where each row of an engine step belongs (`eldr.vllm.layout`) and the check of the rows
the capture plugin reads (`eldr.vllm.capture.invalid_rows_reason`). The runners here are
objects shaped like vLLM's (V1: the persistent batch; V2: the step's InputBatch); the V1
path runs for real in tests/vllm."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from eldr.core.workload.trace import ModelGeometry
from eldr.vllm.capture import invalid_rows_reason
from eldr.vllm.layout import LayoutError, StepLayout, runner_generation, step_layout


def test_positions_continue_from_what_each_request_had_computed() -> None:
    layout = StepLayout(("a", "b", "c"), np.array([3, 1, 0]), np.array([0, 40, 7]))
    assert layout.total == 4
    assert layout.offsets().tolist() == [0, 3, 4, 4]
    assert layout.positions().tolist() == [0, 1, 2, 40]


def test_a_v1_runner_is_read_from_its_persistent_batch() -> None:
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(
            req_ids=["r1", "r2"], num_computed_tokens_cpu=np.array([5, 0, 99])
        )
    )
    scheduler_output = SimpleNamespace(num_scheduled_tokens={"r2": 4, "r1": 1})
    layout = step_layout(runner, scheduler_output, "v1")
    assert layout is not None
    assert layout.engine_ids == ("r1", "r2")
    assert layout.positions().tolist() == [5, 0, 1, 2, 3]
    with pytest.raises(LayoutError, match="was not scheduled"):
        step_layout(runner, SimpleNamespace(num_scheduled_tokens={"r1": 1}), "v1")


def test_a_v2_runner_is_read_from_the_steps_input_batch() -> None:
    batch = SimpleNamespace(
        req_ids=["x", "y", "pad"],
        num_reqs=2,
        num_scheduled_tokens=np.array([2, 1, 0], dtype=np.int32),
        num_computed_tokens_np=np.array([10, 3, 0], dtype=np.int32),
    )
    runner = SimpleNamespace(execute_model_state=SimpleNamespace(input_batch=batch))
    layout = step_layout(runner, None, "v2")
    assert layout is not None
    assert layout.engine_ids == ("x", "y")
    assert layout.positions().tolist() == [10, 11, 3]
    assert step_layout(SimpleNamespace(execute_model_state=None), None, "v2") is None


def test_runner_generations_are_told_by_the_module_of_the_class() -> None:
    v1 = type("GPUModelRunner", (), {"__module__": "vllm.v1.worker.gpu_model_runner"})
    cpu = type("CPUModelRunner", (v1,), {"__module__": "vllm.v1.worker.cpu_model_runner"})
    v2 = type("GPUModelRunner", (), {"__module__": "vllm.v1.worker.gpu.model_runner"})
    other = type("TPURunner", (), {"__module__": "vllm.v1.worker.tpu_model_runner"})
    assert runner_generation(cpu()) == "v1"
    assert runner_generation(v2()) == "v2"
    assert runner_generation(other()) is None


def test_a_layout_that_does_not_add_up_is_refused() -> None:
    with pytest.raises(LayoutError, match="2 requests"):
        StepLayout(("a", "b"), np.array([1]), np.array([0, 0]))
    with pytest.raises(LayoutError, match="negative"):
        StepLayout(("a",), np.array([-1]), np.array([0]))


G = ModelGeometry.of_moe(num_moe_layers=3, num_experts=8, top_k=2)


def rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 8, size=(n, 3, 2)).astype(np.int32)


def test_rows_every_layer_wrote_in_range_are_accepted() -> None:
    assert invalid_rows_reason(rows(6), [(0, 4), (4, 6), (6, 6)], G) is None


def test_a_layer_that_wrote_nothing_is_named() -> None:
    ids = rows(6)
    ids[4:, 1] = -1  # layer 1 left the step's reset value in the second request's rows
    assert invalid_rows_reason(ids, [(0, 4)], G) is None  # not a captured request's rows
    reason = invalid_rows_reason(ids, [(0, 4), (4, 6)], G)
    assert reason is not None
    assert "MoE layer(s) [1] (of 3) wrote no expert ids" in reason


def test_an_expert_id_out_of_range_is_refused() -> None:
    ids = rows(2)
    ids[1, 2, 0] = 8
    assert invalid_rows_reason(ids, [(0, 2)], G) == "expert id 8 outside [0, 8)"
