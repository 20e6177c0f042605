"""One real vLLM engine, in this process, with one fault injected into the capture plugin
(run by tests/vllm/test_never_break.py; not a test module).

    python tests/vllm/fault_driver.py CASE MODEL_DIR

vLLM runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`: the engine core and the one CPU
worker live here), so the fault is a monkeypatch of the plugin's own code in this process,
made before vLLM loads the plugin. The engine must serve whatever the fault: the greedy
token ids of two prompts go to stdout as one JSON line. The plugin's `CaptureStatus`
goes to the NATS server named by the ELDR_* environment, where the test reads it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPTS = [
    "expert router prefill decode block cache token layer signature worker " * 3,
    "partition centroid locality balance latency batch memory bandwidth " * 2,
]


def inject(case: str) -> None:
    import torch

    from eldr.vllm import capture, plugin

    if case == "none":
        return
    if case == "register":

        def broken_register(_: Any) -> None:
            raise RuntimeError("injected: register failed")

        plugin._register = broken_register  # type: ignore[assignment]
    elif case == "version":
        plugin._vllm_version = lambda: "0.35.0"
    elif case in ("callback", "shared_experts"):
        bind = plugin._bind

        def wrapped_bind(module: Any, capture_fn: Any) -> str:
            if case == "callback":
                # A router whose ids are not [tokens, top_k] (here one dimension): the
                # copy inside the forward pass fails.
                return bind(module, lambda ids: capture_fn(ids[:, 0]))
            # A router that appends a fused shared expert's id after the routed ones.
            return bind(module, lambda ids: capture_fn(torch.cat([ids, ids[:, :1]], dim=1)))

        plugin._bind = wrapped_bind
    elif case == "step_end":

        def broken_fold(*_: Any, **__: Any) -> Any:
            raise RuntimeError("injected: fold failed")

        capture.CaptureState.fold = broken_fold  # type: ignore[method-assign]
    elif case == "publisher":

        def broken_batches(_: Any) -> Any:
            raise RuntimeError("injected: building the batches failed")

        capture.StepResult.batches = property(broken_batches)  # type: ignore[assignment,method-assign]
    else:
        raise SystemExit(f"unknown case {case}")


def main() -> None:
    case, model = sys.argv[1], sys.argv[2]
    inject(case)
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model,
        dtype="float32",
        block_size=32,
        max_model_len=512,
        max_num_seqs=4,
        enforce_eager=True,
    )
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0))
    print(json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outputs]}), flush=True)
    time.sleep(1.5)  # a status heartbeat (the interval is 0.5 s in the test)


if __name__ == "__main__":
    main()
