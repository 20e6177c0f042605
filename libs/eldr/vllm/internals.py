"""The vLLM internals the capture plugin (and the gateway's vLLM-facing code) relies on,
as data, and a static check that a vLLM source tree still has them.

    python -m eldr.vllm.internals PATH [--json]

PATH is a vLLM package directory (`site-packages/vllm`) or a directory holding one (an
unzipped wheel). Nothing is imported from it: its Python files are parsed with `ast`, so
any release can be checked (a CUDA wheel on a machine without a GPU, 0.33 and 0.34 on
0.32's venv). Exit status 1 when something is missing.

What "present" means, per kind of internal:

- `module`: the module's file exists (`a/b.py` or `a/b/__init__.py`);
- `class`, `function`, `name`: bound at the module's top level (a `class`, a `def`, an
  assignment, or an import that resolves to one; what only `if TYPE_CHECKING:` imports
  does not count);
- `method`: defined in the class or a base class that resolves inside vLLM (`own`: in
  the class itself, as the plugin wraps only what `vars(cls)` holds), accepting the
  parameters the plugin passes (`params`: by name; `leading`: the first positional
  parameters after `self`, in order);
- `attribute`: assigned in the class or a resolvable base: `self.x = ...` (or
  `self.x: T = ...`, `setattr(self, "x", ...)`) in any method, a class-level assignment or
  annotation (dataclass, NamedTuple, pydantic and msgspec fields), a property or method;
- `literal`: the string appears as a constant in the module (or any module of the package);
- `unchecked`: something the plugin relies on that no static reading can confirm (a
  behaviour, a name built at run time, a third party's series); listed so that it is not
  forgotten, reported as "unchecked".

A model runner generation (`GENERATIONS`) whose runner module a release does not ship is
"absent", not missing: the plugin wraps the runners it finds (vLLM 0.34 removed Model
Runner V1). A release with neither generation fails.

The static check proves presence, not behaviour: an attribute that still exists but means
something else, a method that is no longer called, a callback called with other shapes
all pass (each entry's `note` says what else it takes). tests/vllm runs the plugin on the
installed vLLM (0.32.0 on CPU); this check is for the releases that cannot run here.

Pure: the standard library only; no vLLM import.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Kind = Literal["module", "class", "function", "name", "method", "attribute", "literal", "unchecked"]
Status = Literal["ok", "missing", "absent", "unchecked"]


@dataclass(frozen=True)
class Internal:
    """One thing of vLLM's that our code touches."""

    kind: Kind
    module: str
    """Dotted vLLM module (or package, for a literal searched in all its modules)."""
    name: str = ""
    """Class, function or module-level name; for a literal, the string."""
    member: str = ""
    """Method or attribute of the class `name`."""
    why: str = ""
    """What our code does with it."""
    ours: tuple[str, ...] = ()
    """Where, as `file:symbol` (a function, `Class.method` or module-level name; in
    libs/eldr/vllm, or from the repository's root for tests/...; `pyproject.toml:text`
    for a line holding that text). Each one's source names the internal (a unit test
    checks), and an edit elsewhere in the file moves nothing."""
    params: tuple[str, ...] = ()
    leading: tuple[str, ...] = ()
    own: bool = False
    note: str = ""
    """What the static check does not see."""

    @property
    def what(self) -> str:
        if self.kind == "literal":
            return f"{self.name!r} in {self.module}"
        if self.kind == "unchecked":
            return self.name
        text = ".".join(p for p in (self.module, self.name, self.member) if p)
        if self.kind == "method":
            return f"{text}({', '.join((*self.leading, *self.params, '...'))})"
        return text


@dataclass(frozen=True)
class Finding:
    internal: Internal
    status: Status
    detail: str
    """Where it was found (`vllm/...py:line`), or what is missing."""

    def to_json(self) -> dict[str, object]:
        i = self.internal
        return {
            "status": self.status,
            "kind": i.kind,
            "what": i.what,
            "module": i.module,
            "detail": self.detail,
            "why": i.why,
            "ours": list(i.ours),
            "note": i.note,
        }


# --- the list ------------------------------------------------------------------------------

Spec = tuple[str, str] | tuple[str, str, str]
"""(why our code needs it, our lines separated by spaces[, what the check does not see])."""

V1 = "vllm.v1.worker.gpu_model_runner"
V2 = "vllm.v1.worker.gpu.model_runner"
V1_BATCH = "vllm.v1.worker.gpu_input_batch"
V2_BATCH = "vllm.v1.worker.gpu.input_batch"
WORKER = "vllm.v1.worker.gpu_worker"
MOE = "vllm.model_executor.layers.fused_moe"
MK = f"{MOE}.modular_kernel"
SCHED = "vllm.v1.core.sched.output"
CONFIG = "vllm.config"
CHAT = "vllm.entrypoints.openai.chat_completion.protocol"
COMPLETION = "vllm.entrypoints.openai.completion.protocol"
TEST_V2 = "tests/vllm/test_runner_v2.py"
GENERATIONS: dict[str, tuple[str, ...]] = {
    "Model Runner V1": (V1, "vllm.v1.worker.cpu_model_runner", V1_BATCH),
    "Model Runner V2": (V2, "vllm.v1.worker.cpu.model_runner", V2_BATCH),
}
"""Each runner generation's modules, its runner's first: a release may ship either."""


def _one(kind: Kind, module: str, name: str, member: str, spec: Spec, **kw: Any) -> Internal:
    why, ours = spec[0], tuple(spec[1].split())
    note = spec[2] if len(spec) == 3 else ""
    return Internal(kind, module, name, member, why, ours, note=note, **kw)


def _attrs(module: str, cls: str, specs: dict[str, Spec]) -> list[Internal]:
    return [_one("attribute", module, cls, member, spec) for member, spec in specs.items()]


def _lits(module: str, specs: dict[str, Spec]) -> list[Internal]:
    return [_one("literal", module, text, "", spec) for text, spec in specs.items()]


def _runner(module: str, tag: str, line: str) -> list[Internal]:
    """What the plugin reads on a model runner (V1 and V2 alike)."""
    return [
        _one("class", module, "GPUModelRunner", "", (f"{tag}: wrapped", line)),
        _one(
            "method",
            module,
            "GPUModelRunner",
            "load_model",
            (
                "wrapped: binds the capture callbacks",
                "plugin.py:_register",
                "that it runs before the warm-up compile is not checked",
            ),
            own=True,
        ),
        _one(
            "method",
            module,
            "GPUModelRunner",
            "execute_model",
            (
                "wrapped: the step's start and end",
                "plugin.py:_wrap_execute_model.execute_model plugin.py:_register"
                + (" plugin.py:_wrap_execute_model.execute_model" if tag.endswith("V2") else ""),
                "that the forward pass runs inside it is not checked",
            ),
            leading=("scheduler_output",),
            params=("dummy_run",) if tag.endswith("V2") else (),
            own=True,
        ),
        _one(
            "method",
            module,
            "GPUModelRunner",
            "get_model",
            ("the MoE layers", "plugin.py:CaptureHook._bind_routers"),
        ),
        *_attrs(
            module,
            "GPUModelRunner",
            {
                "vllm_config": (
                    "parallel, speculative, KV transfer configuration",
                    "plugin.py:kv_connector_of plugin.py:CaptureHook._check_parallelism "
                    "plugin.py:_is_first_rank",
                ),
                "model_config": (
                    "model name, HF config",
                    "plugin.py:CaptureHook.__init__ plugin.py:CaptureHook._bind_routers",
                ),
                "cache_config": (
                    "KV block size: the capture's block",
                    "plugin.py:CaptureHook.__init__",
                ),
                "scheduler_config": (
                    "buffer rows, request slots",
                    "plugin.py:CaptureHook.__init__ plugin.py:CaptureHook._bind_routers",
                ),
                "device": (
                    "where the capture buffers live",
                    "plugin.py:CaptureHook.__init__ plugin.py:CaptureHook._bind_routers",
                ),
            },
        ),
    ]


INTERNALS: tuple[Internal, ...] = (
    # How vLLM finds the plugin and says its version.
    *_lits(
        "vllm.plugins",
        {
            "vllm.general_plugins": (
                "the entry-point group vLLM calls register() from",
                "pyproject.toml:vllm.general_plugins",
                "that workers load it before building the model runner is not checked",
            )
        },
    ),
    _one(
        "name", "vllm._version", "__version__", "", ("the version check", "plugin.py:_vllm_version")
    ),
    # Model Runner V1 (and its CPU subclass) and its persistent batch.
    *_runner(V1, "Model Runner V1", "plugin.py:V1_RUNNERS"),
    _one(
        "class",
        "vllm.v1.worker.cpu_model_runner",
        "CPUModelRunner",
        "",
        (
            "V1 CPU runner: wrapped where it defines load_model",
            "plugin.py:V1_RUNNERS",
            "relies on deriving from V1's GPUModelRunner (the inherited wrapper; "
            "layout.py's step_layout)",
        ),
    ),
    *_attrs(
        V1,
        "GPUModelRunner",
        {"input_batch": ("V1 layout: the persistent batch", "layout.py:step_layout")},
    ),
    *_attrs(
        V1_BATCH,
        "InputBatch",
        {
            "req_ids": ("V1 layout: the requests in row order", "layout.py:step_layout"),
            "num_computed_tokens_cpu": (
                "V1 layout: tokens computed before the step",
                "layout.py:step_layout",
                "that it is updated before the forward pass is not checked",
            ),
        },
    ),
    # Model Runner V2 and the step's InputBatch it keeps in execute_model_state.
    *_runner(V2, "Model Runner V2", "plugin.py:V2_RUNNERS"),
    _one(
        "class",
        "vllm.v1.worker.cpu.model_runner",
        "CPUModelRunner",
        "",
        ("V2 CPU runner", "plugin.py:V2_RUNNERS", "relies on deriving from V2's GPUModelRunner"),
    ),
    *_attrs(
        V2,
        "GPUModelRunner",
        {
            "execute_model_state": (
                "V2 layout: the step kept until sample_tokens",
                "layout.py:step_layout",
                "that it is still set when execute_model returns is not checked",
            )
        },
    ),
    *_attrs(
        V2,
        "ExecuteModelState",
        {"input_batch": ("V2 layout: the step's batch", "layout.py:step_layout")},
    ),
    *_attrs(
        V2_BATCH,
        "InputBatch",
        {
            "req_ids": ("V2 layout: the requests in row order", "layout.py:step_layout"),
            "num_reqs": ("V2 layout: requests before padding", "layout.py:step_layout"),
            "num_scheduled_tokens": ("V2 layout: rows per request", "layout.py:step_layout"),
            "num_computed_tokens_np": (
                "V2 layout: tokens computed before",
                "layout.py:step_layout",
            ),
        },
    ),
    # The workers, whose load_model says when the runner built is none of the above.
    _one("class", WORKER, "Worker", "", ("its load_model is wrapped", "plugin.py:WORKERS")),
    _one(
        "method",
        WORKER,
        "Worker",
        "load_model",
        ("wrapped: is the runner one the plugin wraps", "plugin.py:_register"),
        own=True,
    ),
    *_attrs(
        WORKER,
        "Worker",
        {"model_runner": ("the runner it built", "plugin.py:_wrap_worker_load_model.load_model")},
    ),
    _one(
        "class",
        "vllm.v1.worker.cpu_worker",
        "CPUWorker",
        "",
        ("the CPU worker: inherits Worker.load_model", "plugin.py:WORKERS"),
    ),
    # Configuration, read through the runner.
    *_attrs(
        CONFIG,
        "VllmConfig",
        {
            "parallel_config": (
                "the parallel layout",
                "plugin.py:CaptureHook._check_parallelism plugin.py:_is_first_rank",
            ),
            "speculative_config": (
                "decode summaries refuse it",
                "plugin.py:CaptureHook._check_parallelism",
            ),
            "kv_transfer_config": ("the KV connector", "plugin.py:kv_connector_of"),
        },
    ),
    *_attrs(
        CONFIG,
        "ParallelConfig",
        {
            "tensor_parallel_size": ("the first TP rank captures", "plugin.py:_is_first_rank"),
            "pipeline_parallel_size": (
                "refused when > 1",
                "plugin.py:CaptureHook._check_parallelism",
            ),
            "data_parallel_size": ("refused when > 1", "plugin.py:CaptureHook._check_parallelism"),
            "use_ubatching": (
                "refused when set: micro-batches would write over each other's rows",
                "plugin.py:CaptureHook._check_parallelism",
            ),
        },
    ),
    *_attrs(
        CONFIG,
        "KVTransferConfig",
        {"kv_connector": ("in CaptureStatus", "plugin.py:kv_connector_of")},
    ),
    *_attrs(
        CONFIG,
        "ModelConfig",
        {
            "served_model_name": ("the model name published", "plugin.py:CaptureHook.__init__"),
            "hf_config": ("MoE layer ids, from .to_dict()", "plugin.py:CaptureHook._bind_routers"),
        },
    ),
    *_attrs(
        CONFIG,
        "CacheConfig",
        {
            "block_size": (
                "the capture's block; a cache_config_info label",
                "plugin.py:CaptureHook.__init__ load.py:parse_metrics",
            ),
            "num_gpu_blocks": ("a label of vllm:cache_config_info", "load.py:parse_metrics"),
        },
    ),
    *_attrs(
        CONFIG,
        "SchedulerConfig",
        {
            "max_num_seqs": ("segment and decode slots", "plugin.py:CaptureHook.__init__"),
            "max_num_batched_tokens": (
                "capture buffer rows",
                "plugin.py:CaptureHook._bind_routers",
            ),
        },
    ),
    _one(
        "function",
        "vllm.distributed.parallel_state",
        "get_tensor_model_parallel_rank",
        "",
        ("only TP rank 0 captures", "plugin.py:_is_first_rank"),
    ),
    # The MoE layers: found by class, bound through the router (or a monolithic kernel's sink).
    _one(
        "module", f"{MOE}.layer", "", "", ("imported to find MoE layers", "plugin.py:_moe_modules")
    ),
    _one(
        "class",
        f"{MOE}.layer",
        "MoERunner",
        "",
        (
            "isinstance() finds the MoE layers",
            "plugin.py:_moe_modules",
            "that models build one per MoE layer is not checked",
        ),
    ),
    *_attrs(
        f"{MOE}.layer",
        "MoERunner",
        {
            "layer_id": ("MoE layer order", "plugin.py:_moe_modules"),
            "_quant_method": ("is the kernel monolithic", "plugin.py:_bind"),
            "router": ("the capture callback, the geometry", "plugin.py:_bind"),
            "routed_experts": ("holds a monolithic kernel's routing sink", "plugin.py:_bind"),
        },
    ),
    _one(
        "method",
        f"{MOE}.router.fused_moe_router",
        "FusedMoERouter",
        "set_capture_fn",
        ("binds the capture callback", "plugin.py:_bind"),
        leading=("capture_fn",),
    ),
    *_attrs(
        f"{MOE}.router.base_router",
        "BaseRouter",
        {
            member: (why, ours, "read on every router: one not derived from BaseRouter is not")
            for member, why, ours in (
                ("top_k", "the geometry", "plugin.py:CaptureHook._bind_routers"),
                ("global_num_experts", "the geometry", "plugin.py:CaptureHook._bind_routers"),
            )
        },
    ),
    *_attrs(
        f"{MOE}.fused_moe_method_base",
        "FusedMoEMethodBase",
        {
            "is_monolithic": ("a monolithic kernel routes inside itself", "plugin.py:_bind"),
            "moe_kernel": ("the kernel of a monolithic layer", "plugin.py:_bind"),
        },
    ),
    *_attrs(MK, "FusedMoEKernel", {"impl": ("the kernel's implementation", "plugin.py:_bind")}),
    *_attrs(
        MK, "FusedMoEKernelMonolithicImpl", {"fused_experts": ("its experts", "plugin.py:_bind")}
    ),
    _one(
        "method",
        MK,
        "FusedMoEExpertsMonolithic",
        "supports_routing_replay_capture",
        ("does the kernel report routing", "plugin.py:_bind"),
    ),
    *_attrs(MK, "FusedMoEExperts", {"moe_config": ("the sink's sizes", "plugin.py:_bind")}),
    _one(
        "module",
        f"{MOE}.routed_experts_capturer",
        "",
        "",
        ("imported for the routing sink", "plugin.py:_bind"),
    ),
    _one(
        "method",
        f"{MOE}.routed_experts_capturer",
        "RoutedExpertsSink",
        "__init__",
        (
            "a monolithic kernel's routing sink (arguments by position)",
            "plugin.py:_bind",
            "that the kernel calls its capture_fn is not checked; none runs on CPU",
        ),
        leading=("moe_config", "capture_fn"),
    ),
    *_attrs(f"{MOE}.routed_experts", "RoutedExperts", {"routing_sink": ("set", "plugin.py:_bind")}),
    # The scheduler's output, per step.
    *_attrs(
        SCHED,
        "SchedulerOutput",
        {
            "finished_req_ids": ("drops finished requests", "plugin.py:CaptureHook.begin"),
            "scheduled_new_reqs": ("registers new prompts", "plugin.py:CaptureHook.begin"),
            "total_num_scheduled_tokens": (
                "the step's rows",
                "plugin.py:CaptureHook.begin plugin.py:CaptureHook.end",
            ),
            "num_scheduled_tokens": ("V1 layout: rows per request", "layout.py:step_layout"),
        },
    ),
    *_attrs(
        SCHED,
        "NewRequestData",
        {
            "req_id": ("the engine's request id", "plugin.py:CaptureHook._add"),
            "prompt_token_ids": ("the prompt", "plugin.py:CaptureHook._add"),
            "sampling_params": ("carries extra_args", "plugin.py:CaptureHook._add"),
            "num_computed_tokens": (
                "prefix-cache and connector hits",
                "plugin.py:CaptureHook._add",
            ),
        },
    ),
    *_attrs(
        "vllm.sampling_params",
        "SamplingParams",
        {"extra_args": ("vllm_xargs and kv_transfer_params", "plugin.py:CaptureHook._add")},
    ),
    # The OpenAI server: request fields the gateway sets, response fields it reads.
    *(
        entry
        for module, prefix in ((COMPLETION, ""), (CHAT, "Chat"))
        for entry in (
            *_attrs(
                module,
                f"{prefix}CompletionRequest",
                {
                    "vllm_xargs": ("the gateway's xargs: extra_args", "pd.py:prefill_body"),
                    "kv_transfer_params": (
                        "the PD hand-off",
                        "pd.py:prefill_body plugin.py:CaptureHook._add",
                    ),
                    "return_token_ids": ("the routed-experts source", "sources.py:RETURN_FIELDS"),
                },
            ),
            *_attrs(
                module,
                f"{prefix}CompletionResponseChoice",
                {"routed_experts": ("the routed-experts source", "sources.py:routing_of")},
            ),
            *_lits(
                module,
                {
                    "kv_transfer_params": (
                        "its key in extra_args",
                        "plugin.py:CaptureHook._add",
                        "the string only, not that it keys extra_args",
                    )
                },
            ),
        )
    ),
    *_attrs(
        COMPLETION,
        "CompletionResponseChoice",
        {"prompt_token_ids": ("the prompt's tokens", "sources.py:routing_of")},
    ),
    *_attrs(
        CHAT,
        "ChatCompletionResponse",
        {"prompt_token_ids": ("the prompt's tokens", "sources.py:routing_of")},
    ),
    *_attrs(
        "vllm.engine.arg_utils",
        "EngineArgs",
        {
            "enable_return_routed_experts": (
                "the routed-experts source's flag",
                "sources.py:__doc__",
            )
        },
    ),
    *_lits(
        "vllm.distributed.kv_transfer",
        {
            "do_remote_prefill": (
                "the decode side of a PD request",
                "plugin.py:CaptureHook._add pd.py:PREFILL_KV_PARAMS",
                "the string only, anywhere in the package",
            )
        },
    ),
    *_lits(
        "vllm.distributed.kv_transfer.kv_connector.factory",
        {
            "NixlConnector": ("a connector the gateway drives", "pd.py:DRIVEN_CONNECTORS"),
            "ExampleConnector": ("a connector the gateway drives", "pd.py:DRIVEN_CONNECTORS"),
        },
    ),
    # The decode adapter's metrics (prometheus_client adds _total to the counter).
    *_lits(
        "vllm.v1.metrics.loggers",
        {
            "vllm:num_requests_running": ("running requests", "load.py:RUNNING"),
            "vllm:num_requests_waiting": ("waiting requests", "load.py:WAITING"),
            "vllm:kv_cache_usage_perc": ("KV cache usage", "load.py:KV_USAGE"),
            "vllm:cache_config_info": ("KV capacity, from its labels", "load.py:CACHE_INFO"),
            "vllm:request_success": ("finished requests", "load.py:FINISHED"),
        },
    ),
    # What no static reading confirms.
    _one(
        "unchecked",
        "prometheus_client",
        "process_start_time_seconds",
        "",
        (
            "restarts of a decode instance",
            "load.py:PROCESS_START",
            "prometheus_client's, not vLLM's",
        ),
    ),
    _one(
        "unchecked",
        "vllm.entrypoints, vllm.v1.engine",
        "request ids cmpl-<X-Request-Id>-<n>-<8 hex>",
        "",
        (
            "the gateway's id without vllm_xargs",
            "plugin.py:_ENGINE_ID plugin.py:CaptureHook._add",
            "built at run time (f-strings)",
        ),
    ),
    _one(
        "unchecked",
        f"{MOE}.router.base_router",
        "capture_fn(topk_ids), logical ids [tokens, >= top_k]",
        "",
        (
            "what the capture callback writes",
            "plugin.py:capture_callback.capture",
            "a behaviour of select_experts (and of the compiled graph)",
        ),
    ),
    # Test only: tests/vllm/test_runner_v2.py builds V2's own batch.
    _one(
        "method",
        V2_BATCH,
        "InputBatch",
        "make_dummy",
        ("test only: a padded V2 batch", f"{TEST_V2}:V2Runner.run"),
        leading=("num_reqs", "num_tokens", "input_buffers"),
    ),
    _one(
        "method",
        V2_BATCH,
        "InputBuffers",
        "__init__",
        ("test only: V2's buffers", f"{TEST_V2}:V2Runner.__init__"),
        params=("max_num_reqs", "max_num_tokens", "device"),
    ),
    *_attrs(
        V2_BATCH,
        "InputBatch",
        {
            "idx_mapping_np": ("test only: replaced", f"{TEST_V2}:V2Runner.run"),
            "num_tokens": ("test only: replaced", f"{TEST_V2}:V2Runner.run"),
            "num_tokens_after_padding": ("test only: asserted", f"{TEST_V2}:V2Runner.run"),
            "num_reqs_after_padding": ("test only: asserted", f"{TEST_V2}:V2Runner.run"),
        },
    ),
)
"""Everything, in the order the plugin meets it."""


# --- reading vLLM's source ---------------------------------------------------------------


def package_dir(path: Path) -> Path:
    """The `vllm` package directory at or under `path`."""
    for candidate in (path, path / "vllm"):
        if candidate.name == "vllm" and (candidate / "__init__.py").is_file():
            return candidate
    raise FileNotFoundError(f"{path} is not a vllm package directory nor holds one")


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _top_level(body: Sequence[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements run at import (through if/try/with), not those under TYPE_CHECKING."""
    for stmt in body:
        if isinstance(stmt, ast.If):
            if not _is_type_checking(stmt.test):
                yield from _top_level(stmt.body)
            yield from _top_level(stmt.orelse)
        elif isinstance(stmt, ast.Try | ast.TryStar):
            yield from _top_level(stmt.body)
            for handler in stmt.handlers:
                yield from _top_level(handler.body)
            yield from _top_level(stmt.orelse)
            yield from _top_level(stmt.finalbody)
        elif isinstance(stmt, ast.With):
            yield from _top_level(stmt.body)
        else:
            yield stmt


def _target_names(target: ast.expr) -> Iterator[str]:
    if isinstance(target, ast.Name):
        yield target.id
    elif isinstance(target, ast.Tuple | ast.List):
        for element in target.elts:
            yield from _target_names(element)


def _dotted(expr: ast.expr) -> list[str] | None:
    if isinstance(expr, ast.Subscript):  # Generic[T], Base[...]
        return _dotted(expr.value)
    if isinstance(expr, ast.Name):
        return [expr.id]
    if isinstance(expr, ast.Attribute):
        head = _dotted(expr.value)
        return None if head is None else [*head, expr.attr]
    return None


@dataclass
class _Module:
    name: str
    path: Path
    tree: ast.Module
    defs: dict[str, ast.stmt]
    """Top-level class/def/assignment per name."""
    froms: dict[str, tuple[str, str]]
    """`from M import X as Y`: Y -> (M, X), M absolute."""
    imports: dict[str, str]
    """`import M as Y`: Y -> M (`import a.b`: a -> a)."""


@dataclass(frozen=True)
class _Found:
    module: _Module
    node: ast.stmt


def _suffix(module: _Module) -> str:
    return "/__init__.py" if module.path.name == "__init__.py" else ".py"


class Source:
    """vLLM's Python source under one package directory, parsed on demand."""

    def __init__(self, root: Path) -> None:
        self.package = package_dir(root)
        self._modules: dict[str, _Module | None] = {}

    def file(self, module: str) -> Path | None:
        parts = module.split(".")
        if parts[0] != "vllm":
            return None
        base = self.package.joinpath(*parts[1:])
        for candidate in (base.parent / f"{base.name}.py", base / "__init__.py"):
            if (len(parts) > 1 or candidate.name == "__init__.py") and candidate.is_file():
                return candidate
        return None

    def module(self, name: str) -> _Module | None:
        if name not in self._modules:
            self._modules[name] = self._load(name)
        return self._modules[name]

    def _load(self, name: str) -> _Module | None:
        path = self.file(name)
        if path is None:
            return None
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except (SyntaxError, UnicodeDecodeError):
            return None
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        module = _Module(name, path, tree, {}, {}, {})
        for stmt in _top_level(tree.body):
            if isinstance(stmt, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                module.defs[stmt.name] = stmt
            elif isinstance(stmt, ast.Assign):
                for target in stmt.targets:
                    for target_name in _target_names(target):
                        module.defs[target_name] = stmt
            elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
                for target_name in _target_names(stmt.target):
                    module.defs[target_name] = stmt
            elif isinstance(stmt, ast.ImportFrom):
                source = _absolute(package, stmt.module, stmt.level)
                for alias in stmt.names:
                    module.froms[alias.asname or alias.name] = (source, alias.name)
            elif isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    if alias.asname:
                        module.imports[alias.asname] = alias.name
                    else:
                        head = alias.name.split(".")[0]
                        module.imports[head] = head
        return module

    def resolve(self, module_name: str, parts: Sequence[str], depth: int = 0) -> _Found | None:
        """The statement that binds `module.parts[0].parts[1]...`, following imports."""
        module = self.module(module_name)
        if module is None or not parts or depth > 32:
            return None
        head, rest = parts[0], list(parts[1:])
        if head in module.defs:
            return _Found(module, module.defs[head]) if not rest else None
        if head in module.froms:
            source, original = module.froms[head]
            found = self.resolve(source, [original, *rest], depth + 1)
            if found is None and rest:  # `from pkg import submodule`
                found = self.resolve(f"{source}.{original}", rest, depth + 1)
            return found
        if head in module.imports:
            return self.resolve(module.imports[head], rest, depth + 1) if rest else None
        if rest and self.file(f"{module_name}.{head}") is not None:  # pkg.submodule.X
            return self.resolve(f"{module_name}.{head}", rest, depth + 1)
        return None

    def class_def(self, module: str, name: str) -> tuple[_Module, ast.ClassDef] | None:
        found = self.resolve(module, [name])
        for _ in range(8):  # `Alias = Class`
            if found is None or not isinstance(found.node, ast.Assign):
                break
            parts = _dotted(found.node.value)
            found = None if parts is None else self.resolve(found.module.name, parts)
        if found is None or not isinstance(found.node, ast.ClassDef):
            return None
        return found.module, found.node

    def mro(self, module: _Module, cls: ast.ClassDef) -> list[tuple[_Module, ast.ClassDef]]:
        """The class and its bases defined inside vLLM (depth first, each once)."""
        out: list[tuple[_Module, ast.ClassDef]] = []
        seen: set[tuple[str, str]] = set()

        def visit(mod: _Module, node: ast.ClassDef) -> None:
            if (mod.name, node.name) in seen:
                return
            seen.add((mod.name, node.name))
            out.append((mod, node))
            for base in node.bases:
                parts = _dotted(base)
                found = None if parts is None else self.resolve(mod.name, parts)
                if found is not None and isinstance(found.node, ast.ClassDef):
                    visit(found.module, found.node)

        visit(module, cls)
        return out


def _absolute(package: str, module: str | None, level: int) -> str:
    if level == 0:
        return module or ""
    base = package.split(".")
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, module] if module else base)


def _self_attr(target: ast.expr) -> str | None:
    if (
        isinstance(target, ast.Attribute)
        and isinstance(target.value, ast.Name)
        and target.value.id == "self"
    ):
        return target.attr
    return None


def _assigned_attrs(cls: ast.ClassDef) -> Iterator[tuple[str, ast.AST]]:
    """Names a class gives its instances: class-level statements, self.x assignments."""
    for stmt in _top_level(cls.body):
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
            yield stmt.name, stmt
        elif isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                for name in _target_names(target):
                    yield name, stmt
        elif isinstance(stmt, ast.AnnAssign):
            for name in _target_names(stmt.target):
                yield name, stmt
    for node in ast.walk(cls):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        elif (  # setattr(self, "x", v) / object.__setattr__(self, "x", v)
            isinstance(node, ast.Call)
            and len(node.args) >= 2
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id == "self"
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and (_dotted(node.func) or [""])[-1] in ("setattr", "__setattr__")
        ):
            yield node.args[1].value, node
        for target in targets:
            for element in target.elts if isinstance(target, ast.Tuple | ast.List) else [target]:
                attr = _self_attr(element)
                if attr is not None:
                    yield attr, node


def _signature_problem(fn: ast.FunctionDef | ast.AsyncFunctionDef, internal: Internal) -> str:
    args = fn.args
    positional = [a.arg for a in (*args.posonlyargs, *args.args)]
    decorators = {(_dotted(d) or [""])[-1] for d in fn.decorator_list}
    if "staticmethod" not in decorators and positional:
        positional = positional[1:]
    accepted = set(positional) | {a.arg for a in args.kwonlyargs}
    shown = ", ".join(
        [*positional, *(["*" + args.vararg.arg] if args.vararg else [])]
        + [a.arg for a in args.kwonlyargs]
        + (["**" + args.kwarg.arg] if args.kwarg else [])
    )
    lead = list(internal.leading)
    if positional[: len(lead)] != lead:
        return f"first parameters ({shown}) are not ({', '.join(lead)})"
    missing = [p for p in internal.params if p not in accepted]
    if missing:
        return f"no parameter {', '.join(missing)}: ({shown})"
    return ""


def _where(module: _Module, node: ast.AST) -> str:
    return f"{module.name.replace('.', '/')}{_suffix(module)}:{getattr(node, 'lineno', 1)}"


def check_one(source: Source, internal: Internal) -> Finding:
    i = internal
    if i.kind == "unchecked":
        return Finding(i, "unchecked", i.note)
    if i.kind == "literal":
        return _check_literal(source, i)
    module = source.module(i.module)
    if module is None:
        return Finding(i, "missing", f"no module {i.module}")
    if i.kind == "module":
        return Finding(i, "ok", _where(module, module.tree))
    if i.kind in ("class", "function", "name"):
        found = source.resolve(i.module, [i.name])
        wanted: tuple[type, ...] = {
            "class": (ast.ClassDef,),
            "function": (ast.FunctionDef, ast.AsyncFunctionDef),
            "name": (ast.stmt,),
        }[i.kind]
        if found is None or not isinstance(found.node, wanted):
            return Finding(i, "missing", f"{i.kind} {i.name} not in {i.module}")
        return Finding(i, "ok", _where(found.module, found.node))
    cls = source.class_def(i.module, i.name)
    if cls is None:
        return Finding(i, "missing", f"class {i.name} not in {i.module}")
    chain = source.mro(*cls)[:1] if i.own else source.mro(*cls)
    for mod, node in chain:
        for name, stmt in _assigned_attrs(node):
            if name != i.member:
                continue
            if i.kind == "attribute":
                return Finding(i, "ok", _where(mod, stmt))
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
                problem = _signature_problem(stmt, i)
                if problem:
                    return Finding(i, "missing", f"{_where(mod, stmt)}: {problem}")
                return Finding(i, "ok", _where(mod, stmt))
    scope = f"{i.name} itself" if i.own else " < ".join(n.name for _, n in chain)
    what = "method" if i.kind == "method" else "attribute"
    return Finding(i, "missing", f"no {what} {i.member} in {scope}")


def _check_literal(source: Source, internal: Internal) -> Finding:
    path = source.file(internal.module)
    if path is None:
        return Finding(internal, "missing", f"no module {internal.module}")
    files = sorted(path.parent.rglob("*.py")) if path.name == "__init__.py" else [path]
    for file in files:
        try:
            tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value == internal.name:
                rel = file.relative_to(source.package.parent).as_posix()
                return Finding(internal, "ok", f"{rel}:{node.lineno}")
    return Finding(
        internal, "missing", f"{internal.name!r} appears in no module of {internal.module}"
    )


def check(vllm_root: Path, internals: Sequence[Internal] = INTERNALS) -> list[Finding]:
    """Each internal's finding in the vLLM source at `vllm_root` (see the module docstring)."""
    source = Source(vllm_root)
    findings = [check_one(source, internal) for internal in internals]
    shipped = {g: source.module(modules[0]) is not None for g, modules in GENERATIONS.items()}
    if not any(shipped.values()):
        return findings
    for n, finding in enumerate(findings):
        for generation, modules in GENERATIONS.items():
            if (
                not shipped[generation]
                and finding.internal.module in modules
                and finding.status == "missing"
            ):
                findings[n] = Finding(
                    finding.internal,
                    "absent",
                    f"{generation} is not in this vLLM: the plugin wraps the runners it finds",
                )
    return findings


def vllm_version(vllm_root: Path) -> str | None:
    """`__version__` from the tree's `vllm/_version.py` (written when the wheel is built)."""
    found = Source(vllm_root).resolve("vllm._version", ["__version__"])
    if found is not None and isinstance(found.node, ast.Assign):
        value = found.node.value
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            return value.value
    return None


def table(findings: Sequence[Finding]) -> str:
    width = max((len(f.internal.what) for f in findings), default=0)
    lines = [
        f"{f.status:<9} {f.internal.what:<{width}}  {f.detail}  [{', '.join(f.internal.ours)}]"
        for f in findings
    ]
    counts = {
        s: sum(f.status == s for f in findings) for s in ("ok", "missing", "absent", "unchecked")
    }
    lines.append(
        f"{len(findings)} internals: {counts['ok']} ok, {counts['missing']} missing, "
        f"{counts['absent']} absent (a runner generation this vLLM does not ship), "
        f"{counts['unchecked']} unchecked"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m eldr.vllm.internals",
        description="Check that a vLLM source tree has the internals the ELDR plugin uses.",
    )
    parser.add_argument("path", type=Path, help="site-packages/vllm, or an unzipped wheel")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    try:
        findings = check(args.path)
    except FileNotFoundError as exc:
        parser.error(str(exc))
    version = vllm_version(args.path)
    if args.json:
        report = {
            "vllm_root": str(package_dir(args.path)),
            "version": version,
            "findings": [f.to_json() for f in findings],
        }
        print(json.dumps(report, indent=2))
    else:
        print(f"vLLM {version or '?'} at {package_dir(args.path)}")
        print(table(findings))
    return 1 if any(f.status == "missing" for f in findings) else 0


if __name__ == "__main__":
    sys.exit(main())
