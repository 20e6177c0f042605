"""Exact signatures under prefix caching, on a real vLLM engine.

A request whose leading blocks hit vLLM's prefix cache computes (and so routes) only its
tail; the plugin adds its own summaries of the cached blocks (it computed them) and sends
the whole signature in the event (otherwise the router adds them from the signature
service). The
decision it records must carry the same signature as the same prompt computed with no
cache hit at all: a unique `cache_salt` keeps the engine's prefix cache from matching any
block of a request, which is prefix caching off for that request. With the tests'
ExampleConnector, the hit request also loads blocks through the connector (a prefix hit
"via a KV connector"): the signature must not change either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import numpy as np
import pytest
from vllm_support import (
    MODEL_NAME,
    SKIP_REASON,
    Engines,
    post,
    prefill_events,
    running,
    service_settings,
)

from eldr.bus import Bus
from eldr.bus.topology import DECISIONS
from eldr.core.workload.trace import expert_counts
from eldr.settings import BusSettings
from eldr.wire import Decision, LoadReport
from eldr_services.router.service import setup as router_setup
from eldr_services.router.settings import RouterSettings
from eldr_services.signature.service import setup as signature_setup
from eldr_services.signature.settings import SignatureSettings

pytest.importorskip("vllm.version", reason=SKIP_REASON)

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

_WORDS = [
    "locality",
    "balance",
    "latency",
    "batch",
    "memory",
    "bandwidth",
    "stream",
    "weight",
    "partition",
    "centroid",
]
PREFIX = " ".join(f"{_WORDS[i % len(_WORDS)]}{i}" for i in range(60)) + " "
"""About 200 tokens: several full 32-token blocks to hit."""


async def report_load(bus: Bus, worker: str, stop: asyncio.Event) -> None:
    """A stand-in decode worker's load reports, so the router has someone to route to."""
    seq = 0
    while not stop.is_set():
        seq += 1
        await bus.publish(
            bus.subjects.load(worker),
            LoadReport(
                worker_id=worker,
                incarnation="stand-in",
                seq=seq,
                ts_s=time.time(),
                running=0,
                waiting=0,
                kv_tokens=0,
                kv_capacity_tokens=1 << 20,
                admitted=[],
            ),
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.3)


async def decision_of(bus: Bus, request_id: str, timeout_s: float = 60) -> Decision:
    stream = f"{bus.settings.namespace.upper()}_{DECISIONS}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = await bus.get_last(stream, bus.subjects.decision(request_id), Decision)
        if found is not None:
            return found
        await asyncio.sleep(0.2)
    raise AssertionError(f"no decision for {request_id}")


async def test_prefix_cache_hits_yield_the_signature_of_an_uncached_prefill(
    engines: Engines, tiny_model: object
) -> None:
    from eldr.vllm.tinymodel import TransformersRouting

    run = uuid.uuid4().hex[:8]
    prefix = f"{run} {PREFIX}"
    target = prefix + "gamma delta zero one two three"
    requests = [
        # The target prompt with no possible hit (the KV connector may store it: with
        # ExampleConnector, the target's later run then loads most of it from there).
        (f"cold-{run}", target, f"salt-{run}"),
        (f"warm-{run}", prefix + "code math legal", None),  # puts the prefix in the cache
        (f"hit-{run}", target, None),  # its leading blocks hit the cache(s)
    ]
    router = service_settings(
        engines, RouterSettings, signature_timeout_s=5.0, assemble_wait_ms=3000
    )
    bus = await Bus.connect(
        BusSettings(nats_url=engines.nats_url, namespace=engines.namespace), "prefix-test"
    )
    stop = asyncio.Event()
    reporter = asyncio.create_task(report_load(bus, "decode-standin", stop))
    try:
        async with (
            running("signature", service_settings(engines, SignatureSettings), signature_setup),
            running("router", router, router_setup),
        ):
            for request_id, prompt, salt in requests:
                body = {
                    "model": MODEL_NAME,
                    "prompt": prompt,
                    "max_tokens": 1,
                    "temperature": 0,
                    "vllm_xargs": {"eldr_request_id": request_id},
                }
                if salt is not None:
                    body["cache_salt"] = salt
                await post(engines.prefill.url + "/v1/completions", body)
            events = await prefill_events(engines, {r for r, _, _ in requests})
            hit = await decision_of(bus, f"hit-{run}")
            cold = await decision_of(bus, f"cold-{run}")
    finally:
        stop.set()
        await reporter
        await bus.drain()
    hit_event = events[f"hit-{run}"]
    assert hit_event.cached_prefix_blocks >= 3
    assert events[f"cold-{run}"].cached_prefix_blocks == 0
    assert hit.missing_blocks == 0
    assert hit.signature is not None
    assert cold.signature is not None
    hit_counts = hit.signature.to_dense(np.int64)
    np.testing.assert_array_equal(hit_counts, cold.signature.to_dense(np.int64))
    # Local first: this instance computed every block the hit took from its prefix cache
    # or loaded through the connector (the cold run computed the whole target), so its
    # event carries the whole signature and the router asked the signature service nothing.
    assert hit_event.signature_source == "event"
    assert hit_event.computed is None
    assert hit_event.signature is not None
    np.testing.assert_array_equal(hit_event.signature.to_dense(np.int64), hit_counts)
    tokens = np.load(engines.dump_dir / f"cold-{run}.npz")["token_ids"].tolist()
    want = expert_counts(TransformersRouting(tiny_model).expert_ids(tokens), hit_counts.shape[1])  # type: ignore[arg-type]
    np.testing.assert_array_equal(hit_counts, want)
