"""Which request and prompt position each row of an engine step belongs to.

Inside vLLM's worker the MoE routers see the step's tokens flattened, all requests in a
row. The model runner knows the order: the requests of the step in row order, the rows
each has (its scheduled tokens), and how many tokens each had computed before the step,
so a row's position is `computed + its index among the request's rows`. The two model
runners keep this in different places:

- Model Runner V1 (`vllm.v1.worker.gpu_model_runner.GPUModelRunner` and the CPU runner
  derived from it): the persistent batch `runner.input_batch` (`req_ids`,
  `num_computed_tokens_cpu`) and the scheduler output's `num_scheduled_tokens`;
- Model Runner V2 (`vllm.v1.worker.gpu.model_runner`): the step's `InputBatch`, kept in
  `runner.execute_model_state` between `execute_model` and `sample_tokens`
  (`req_ids`, `num_scheduled_tokens`, `num_computed_tokens_np`).

Everything is read on the host: no device tensor is copied to find positions. Only the
first `num_reqs` requests count: V2 pads the batch for a CUDA graph (more rows,
`num_tokens_after_padding`, and more requests, `num_reqs_after_padding`), and the padding
rows belong to nobody. These are vLLM internals of the supported versions (0.32.x to
0.34.x; 0.34 has no V1; `eldr.vllm.internals` checks a release for them): V1 runs on real
vLLM in tests/vllm; V2, which needs Triton's GPU backend to run a
model, is checked against its own classes (`InputBatch`, `ExecuteModelState`, built on the
CPU) through chunked prefill, prefix hits, padding and async scheduling's one-step lag in
tests/vllm/test_runner_v2.py, with the same steps through V1's persistent batch.

Pure: duck-typed attribute reads, numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

RunnerGeneration = Literal["v1", "v2"]

V1_MODULES = ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.cpu_model_runner")
V2_MODULE_PREFIXES = ("vllm.v1.worker.gpu.", "vllm.v1.worker.cpu.")


class LayoutError(RuntimeError):
    """The step's rows cannot be mapped to requests (the runner is not what we know)."""


@dataclass(frozen=True)
class StepLayout:
    """The step's requests in row order, rows per request, tokens computed before."""

    engine_ids: tuple[str, ...]
    num_tokens: np.ndarray
    """int64 [requests]."""
    computed: np.ndarray
    """int64 [requests]: tokens of the request computed before this step."""

    def __post_init__(self) -> None:
        n = len(self.engine_ids)
        if self.num_tokens.shape != (n,) or self.computed.shape != (n,):
            raise LayoutError(
                f"{n} requests but {self.num_tokens.shape} token counts and "
                f"{self.computed.shape} computed counts"
            )
        if n and (self.num_tokens.min() < 0 or self.computed.min() < 0):
            raise LayoutError("negative token counts in the step layout")

    @property
    def total(self) -> int:
        return int(self.num_tokens.sum())

    def offsets(self) -> np.ndarray:
        """int64 [requests + 1]: request i owns rows offsets[i]:offsets[i + 1]."""
        out = np.zeros(len(self.engine_ids) + 1, dtype=np.int64)
        np.cumsum(self.num_tokens, out=out[1:])
        return out

    def positions(self) -> np.ndarray:
        """int64 [rows]: each row's position in its request."""
        total = self.total
        if total == 0:
            return np.zeros(0, dtype=np.int64)
        starts = self.offsets()[:-1]
        owner = np.repeat(np.arange(len(self.engine_ids)), self.num_tokens)
        return np.asarray(self.computed[owner] + (np.arange(total) - starts[owner]), dtype=np.int64)


def runner_generation(runner: Any) -> RunnerGeneration | None:
    """Which model runner `runner` is, by the module its class (or a base) comes from."""
    for cls in type(runner).__mro__:
        module = cls.__module__
        if module in V1_MODULES:
            return "v1"
        if module.startswith(V2_MODULE_PREFIXES):
            return "v2"
    return None


def step_layout(
    runner: Any, scheduler_output: Any, generation: RunnerGeneration
) -> StepLayout | None:
    """The layout of the step the runner just ran; None when it ran no model (V2 keeps no
    batch then)."""
    if generation == "v1":
        batch = runner.input_batch
        engine_ids = tuple(str(r) for r in batch.req_ids)
        scheduled = scheduler_output.num_scheduled_tokens
        try:
            num_tokens = np.array([int(scheduled[r]) for r in engine_ids], dtype=np.int64)
        except KeyError as exc:
            raise LayoutError(f"request {exc} of the batch was not scheduled") from exc
        computed = np.asarray(batch.num_computed_tokens_cpu[: len(engine_ids)], dtype=np.int64)
        return StepLayout(engine_ids, num_tokens, computed)
    state = getattr(runner, "execute_model_state", None)
    batch = getattr(state, "input_batch", None)
    if batch is None:
        return None
    engine_ids = tuple(str(r) for r in batch.req_ids[: int(batch.num_reqs)])
    n = len(engine_ids)
    return StepLayout(
        engine_ids,
        np.asarray(batch.num_scheduled_tokens[:n], dtype=np.int64),
        np.asarray(batch.num_computed_tokens_np[:n], dtype=np.int64),
    )
