"""Fixtures of the real-vLLM tests (run with `make test-vllm`, in .venv-vllm).

Engines are expensive (20-60 s each to start on 2 cores), so they are shared by the whole
session: one tiny random-weight Qwen3-MoE built here, one prefill vLLM server (capture
plugin on, prefix caching on) and one decode vLLM server, both
`python -m vllm.entrypoints.openai.api_server` subprocesses with a KV connector, started
together the first time a test asks for them. They publish into one session namespace on
the session nats-server (tests/conftest.py); the ELDR services of a test run in-process.

In an environment without vLLM (the main .venv) every test module here skips itself with
the reason (`pytest.importorskip("vllm.version")`: this directory is itself named `vllm`
and would import as a namespace package); nothing in this file imports vLLM.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_support import (
    DECODE_IDS,
    PREFILL_ID,
    Engines,
    small_retention,
    start_server,
    wait_healthy,
)

from eldr.bus import Bus, apply_topology, build_topology
from eldr.dev.natsserver import EmbeddedNats
from eldr.settings import BusSettings


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from eldr.vllm.tinymodel import build_tiny_moe

    return build_tiny_moe(tmp_path_factory.mktemp("tiny-moe"))


@pytest.fixture(scope="session")
def vllm_namespace(nats_server: EmbeddedNats) -> str:
    """One namespace for the session (the engines' plugin is configured once)."""
    namespace = f"v{uuid.uuid4().hex[:12]}"

    async def apply() -> None:
        bus = await Bus.connect(BusSettings(nats_url=nats_server.url, namespace=namespace), "t")
        await apply_topology(bus, build_topology(namespace, small_retention()))
        await bus.drain()

    asyncio.run(apply())
    return namespace


@pytest.fixture(scope="session")
def engines(
    tiny_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
    nats_server: EmbeddedNats,
    vllm_namespace: str,
) -> Iterator[Engines]:
    """A prefill and two decode vLLM servers, started together, stopped at the session's
    end. Every one runs the capture plugin: the prefill instance in the prefill role
    (signatures), the decode instances in the decode role (decode summaries)."""
    log_dir = tmp_path_factory.mktemp("vllm-logs")
    dump_dir = tmp_path_factory.mktemp("capture-dump")
    storage_dir = tmp_path_factory.mktemp("kv-storage")
    prefill = start_server(
        PREFILL_ID,
        tiny_model,
        log_dir,
        storage_dir,
        {
            "ELDR_VLLM_CAPTURE": "1",
            "ELDR_NATS_URL": nats_server.url,
            "ELDR_NAMESPACE": vllm_namespace,
            "ELDR_VLLM_WORKER_ID": PREFILL_ID,
            "ELDR_VLLM_DUMP_DIR": str(dump_dir),
        },
        [],
    )
    # The decode instances run eagerly: they start faster, and their outputs must equal the
    # compiled prefill instance's anyway (the tests compare them). They report cached
    # prompt tokens in their usage: the tests check the prompt's KV was loaded, not redone.
    decoders = {
        name: start_server(
            name,
            tiny_model,
            log_dir,
            storage_dir,
            {
                "ELDR_VLLM_CAPTURE": "1",
                "ELDR_VLLM_ROLE": "decode",
                "ELDR_NATS_URL": nats_server.url,
                "ELDR_NAMESPACE": vllm_namespace,
                "ELDR_VLLM_WORKER_ID": name,
                "ELDR_VLLM_STATUS_INTERVAL_S": "1",
            },
            ["--enforce-eager", "--enable-prompt-tokens-details"],
        )
        for name in DECODE_IDS
    }
    try:
        wait_healthy([prefill, *decoders.values()])
        yield Engines(
            prefill,
            decoders,
            dump_dir,
            vllm_namespace,
            nats_server.url,
            tiny_model,
            storage_dir,
        )
    finally:
        prefill.stop()
        for decode in decoders.values():
            decode.stop()
