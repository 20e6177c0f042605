"""Never break the engine (issue 22, items 2 and 3): a fault injected into each part of the
capture path of a real CPU vLLM engine, and a vLLM version outside the supported range.

Each case runs `fault_driver.py` (one engine in its own process, the fault a monkeypatch of
the plugin there). Whatever the fault, the engine serves the same greedy tokens as an
engine whose plugin hooked nothing (the unsupported version's), and the plugin's
`CaptureStatus` on the bus says what happened:
"failed" with the exception for a fault (counted, capture off for that instance), "off"
for an unsupported version, "ok" for a router that appends a fused shared expert's id
after the routed ones (the callback keeps the first top-k columns).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_support import SKIP_REASON

from eldr.bus import Bus, Delivery
from eldr.dev.natsserver import EmbeddedNats
from eldr.settings import BusSettings
from eldr.wire import CaptureStatus, PrefillDone

pytest.importorskip("vllm.version", reason=SKIP_REASON)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

DRIVER = Path(__file__).with_name("fault_driver.py")
CASES = {
    # case: (prefill capture state, what the reason says)
    "shared_experts": ("ok", None),
    "callback": ("failed", "a capture callback failed: MoE layer 0: IndexError"),
    "step_end": ("failed", "step end raised RuntimeError: injected: fold failed"),
    "publisher": ("failed", "the publisher raised RuntimeError: injected: building the batches"),
    "register": ("failed", "register() raised RuntimeError: injected: register failed"),
    "version": ("off", "vLLM 0.35.0 is outside the versions the plugin supports"),
}


def run_driver(case: str, model: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, str(DRIVER), case, str(model)],
        env={**env, "ELDR_VLLM_WORKER_ID": f"fault-{case.replace('_', '-')}"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


@pytest.fixture(scope="module")
def outcomes(
    tiny_model: Path, nats_server: EmbeddedNats, vllm_namespace: str
) -> dict[str, tuple[list[list[int]], list[CaptureStatus], list[PrefillDone], str]]:
    """Every case run (two engines at a time): (tokens, statuses, PrefillDones, stderr)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELDR_VLLM_")}
    env.update(
        ELDR_VLLM_CAPTURE="1",
        ELDR_NATS_URL=nats_server.url,
        ELDR_NAMESPACE=vllm_namespace,
        ELDR_VLLM_STATUS_INTERVAL_S="0.5",
        VLLM_CPU_KVCACHE_SPACE="1",
    )
    statuses: dict[str, list[CaptureStatus]] = {}
    events: dict[str, list[PrefillDone]] = {}

    async def collect() -> dict[str, tuple[list[list[int]], str]]:
        bus = await Bus.connect(
            BusSettings(nats_url=nats_server.url, namespace=vllm_namespace), "t"
        )

        async def on_status(status: CaptureStatus, _: Delivery) -> None:
            statuses.setdefault(status.worker_id, []).append(status)

        async def on_event(event: PrefillDone, _: Delivery) -> None:
            events.setdefault(event.prefill_worker, []).append(event)

        await bus.subscribe(bus.subjects.capture_all, CaptureStatus, on_status)
        await bus.subscribe(bus.subjects.prefill_done_all, PrefillDone, on_event)
        results: dict[str, tuple[list[list[int]], str]] = {}
        names = list(CASES)
        try:
            for lo in range(0, len(names), 2):
                running = {c: run_driver(c, tiny_model, env) for c in names[lo : lo + 2]}
                for case, process in running.items():
                    out, err = await asyncio.to_thread(process.communicate, timeout=300)
                    text = (out + err).decode(errors="replace")
                    assert process.returncode == 0, (
                        f"{case}: exited {process.returncode}\n{text[-3000:]}"
                    )
                    lines = [line for line in out.decode().splitlines() if line.startswith("{")]
                    results[case] = (json.loads(lines[-1])["tokens"], text)
            await asyncio.sleep(1.0)
        finally:
            await bus.drain()
        return results

    results = asyncio.run(collect())
    return {
        case: (
            tokens,
            statuses.get(f"fault-{case.replace('_', '-')}", []),
            events.get(f"fault-{case.replace('_', '-')}", []),
            err,
        )
        for case, (tokens, err) in results.items()
    }


@pytest.mark.parametrize("case", list(CASES))
def test_the_engine_serves_and_the_status_says_what_happened(
    outcomes: dict[str, tuple[list[list[int]], list[CaptureStatus], list[PrefillDone], str]],
    case: str,
) -> None:
    tokens, statuses, events, err = outcomes[case]
    assert tokens == outcomes["version"][0]  # served, the answer of an engine not hooked
    state, reason = CASES[case]
    assert statuses, f"{case}: no CaptureStatus\n{err[-2000:]}"
    last = statuses[-1]
    assert last.prefill_capture == state, (last, err[-2000:])
    if reason is not None:
        assert last.reason is not None
        assert reason in last.reason, last.reason
    if state == "ok":
        # The prompts were captured (every row of every layer written, ids in range).
        assert [e.capture for e in events] == ["captured", "captured"]
    else:  # said in the engine's log too, once
        marker = "prefill capture FAILED" if state == "failed" else "prefill capture OFF"
        assert err.count(marker) == 1, err[-3000:]
