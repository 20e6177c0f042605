"""Measure what the capture plugin costs: the same workload with capture off and on.

    python -m eldr.bench.capture_overhead [--model DIR] [--prompts 64] [--prompt-words 300]

Builds the tiny model when no `--model` is given, starts an embedded nats-server with the
ELDR topology (so the plugin really publishes), then runs, in a fresh process each (the
plugin is installed at process start), vLLM's offline engine on: a prefill-heavy batch
(`--prompts` prompts, one output token each: every prompt token goes through the capture)
and a decode-heavy batch (32 prompts, 256 output tokens each), prefix caching off. Prints
tokens per second per run and the relative difference; `--json` writes them. Times on a
shared 2-core machine are noisy: run it more than once (`--repeat`).

`--step-cost` instead times what one 2,048-token prefill step costs the engine's thread
in the capture (no engine: the step's rows are made up), at Qwen3-30B-A3B's geometry (48
MoE layers x 128 experts, top-8, 16-token blocks), four prompts of 512 tokens: the plan of
the step, the segment counts (torch on the CPU: numpy's bincount over the buffer), and the
fold into block summaries and PrefillDone events. Median of 25.

Needs the vLLM environment (.venv-vllm, see docs/VLLM.md).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_CHILD = """
import json, sys, time
from vllm import LLM, SamplingParams

def main():
    cfg = json.loads(sys.argv[1])
    llm = LLM(model=cfg["model"], dtype="float32", block_size=32, max_model_len=2048,
              enable_prefix_caching=False, seed=0, max_num_batched_tokens=2048)
    words = "expert router prefill decode block cache token layer signature worker".split()
    out = {}
    for name, n, words_per, max_tokens in (
        ("prefill", cfg["prompts"], cfg["prompt_words"], 1),
        ("decode", 32, 32, 256),
    ):
        prompts = [f"{i} " + " ".join(words[(i + j) % len(words)] for j in range(words_per))
                   for i in range(n)]
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
        started = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        prompt_tokens = sum(len(r.prompt_token_ids) for r in results)
        output_tokens = sum(len(r.outputs[0].token_ids) for r in results)
        out[name] = {"seconds": elapsed, "prompt_tokens": prompt_tokens,
                     "output_tokens": output_tokens}
    print("ELDR_RESULT " + json.dumps(out), flush=True)

if __name__ == "__main__":
    main()
"""


def _run_child(config: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(config)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("ELDR_RESULT "):
            result: dict[str, Any] = json.loads(line.removeprefix("ELDR_RESULT "))
            return result
    raise RuntimeError(f"benchmark child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


def _apply_topology(url: str, namespace: str) -> None:
    from eldr.bus import Bus, apply_topology, build_topology
    from eldr.settings import BusSettings, RetentionSettings

    async def apply() -> None:
        bus = await Bus.connect(BusSettings(nats_url=url, namespace=namespace), "overhead")
        await apply_topology(
            bus, build_topology(namespace, RetentionSettings(blocks_max_bytes=256 << 20))
        )
        await bus.drain()

    asyncio.run(apply())


def step_cost(reps: int = 25) -> dict[str, float]:
    """Engine-thread time of the prefill capture of one step (see the module docstring)."""
    import numpy as np

    torch = importlib.import_module("torch")

    from eldr.core.workload.trace import ModelGeometry
    from eldr.vllm.capture import CaptureConfig, CaptureState
    from eldr.vllm.prefill_counts import SegmentCounter

    g, bs, n = ModelGeometry.of_moe(48, 128, 8), 16, 2048
    rng = np.random.default_rng(0)
    rows = np.argsort(rng.random((n, 48, 128)), axis=2)[:, :, :8].astype(np.int32)
    buffer = torch.from_numpy(rows)
    counter = SegmentCounter(g, max_rows=n, max_segments=n // bs + 5, block_size=bs, device="cpu")
    times = []
    for _ in range(reps):
        state = CaptureState(CaptureConfig("p", "m", bs, g, local_summary_bytes=0))
        for i in range(4):
            state.add_request(f"r{i}", rng.integers(0, 50000, 512), 0, 0.0, request_id=f"r{i}")
        started = time.perf_counter()
        plan = state.plan([f"r{i}" for i in range(4)], [512] * 4, [0] * 4)
        result = state.fold(plan, counter.count(buffer, plan).result(), 1.0, 1.0)
        times.append(time.perf_counter() - started)
        assert len(result.done) == 4
    times.sort()
    return {"median_ms": 1e3 * times[len(times) // 2], "min_ms": 1e3 * times[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=300)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--step-cost", action="store_true", help="time one step's capture")
    args = parser.parse_args(argv)
    if args.step_cost:
        cost = step_cost()
        print(f"prefill capture, one 2,048-token step at 48 x 128, top-8: {cost}")
        return 0
    from eldr.dev.natsserver import EmbeddedNats

    with tempfile.TemporaryDirectory() as tmp, EmbeddedNats() as nats:
        model = args.model
        if model is None:
            from eldr.vllm.tinymodel import build_tiny_moe

            model = build_tiny_moe(Path(tmp) / "tiny")
        namespace = "overhead"
        _apply_topology(nats.url, namespace)
        config = {"model": str(model), "prompts": args.prompts, "prompt_words": args.prompt_words}
        base_env = {k: v for k, v in os.environ.items() if not k.startswith("ELDR_")}
        base_env.update(VLLM_CPU_KVCACHE_SPACE="2", HF_HUB_OFFLINE="1")
        runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
        for _ in range(args.repeat):
            for mode in ("off", "on"):
                env = dict(base_env)
                if mode == "on":
                    env.update(
                        ELDR_VLLM_CAPTURE="1",
                        ELDR_NATS_URL=nats.url,
                        ELDR_NAMESPACE=namespace,
                        ELDR_VLLM_WORKER_ID="prefill-bench",
                    )
                started = time.perf_counter()
                runs[mode].append(_run_child(config, env))
                print(f"capture {mode}: done in {time.perf_counter() - started:.0f} s", flush=True)
    report: dict[str, Any] = {"runs": runs}
    for phase, key in (("prefill", "prompt_tokens"), ("decode", "output_tokens")):
        rates = {
            mode: max(r[phase][key] / r[phase]["seconds"] for r in runs[mode]) for mode in runs
        }
        change = rates["on"] / rates["off"] - 1.0
        report[phase] = {"tokens_per_s": rates, "change": change}
        print(
            f"{phase}: {rates['off']:,.0f} tok/s without capture, {rates['on']:,.0f} with "
            f"({change:+.1%}; best of {args.repeat})"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
