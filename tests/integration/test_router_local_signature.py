"""Local first, the signature service for misses (issue 14 item 1), against a real
nats-server: a PrefillDone that carries the whole signature is decided with no
signature-service request (none runs here; a listener on the assemble subject counts what
the router asks), and the decision records the event's signature; one whose cached blocks
the prefill worker did not hold still goes to the service."""

from __future__ import annotations

import re
import socket
import time

import aiohttp
import numpy as np
import pytest

from eldr.bus import Bus, Delivery, Topology, apply_topology
from eldr.settings import BusSettings, RetentionSettings
from eldr.wire import AssembleRequest, PrefillDone, SparseCounts
from eldr_services.router.service import setup
from eldr_services.router.settings import RouterSettings
from support.decisions import committed_decision
from support.services import running_service
from support.workers import reporting

pytestmark = pytest.mark.integration

L, E, BLOCK = 2, 4, 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def metric(port: int, name: str) -> float:
    """The series' value; 0 for a labelled series not exported."""
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{port}/metrics") as response,
    ):
        text = await response.text()
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return 0.0 if found is None else float(found.group(1))


def event(rid: str, *, signature: np.ndarray | None, computed: np.ndarray | None) -> PrefillDone:
    """A 53-token prompt (3 full blocks, all prefix-cache hits, and a partial block)."""
    partial = np.zeros((L, E), dtype=np.uint32)
    partial[:, 1] = 5
    return PrefillDone(
        request_id=rid,
        model="m",
        prefill_worker="p0",
        ts_s=time.time(),
        block_size=BLOCK,
        block_hashes=[11, 12, 13],
        n_prompt_tokens=3 * BLOCK + 5,
        partial=SparseCounts.from_dense(partial),
        num_moe_layers=L,
        num_experts=E,
        cached_prefix_blocks=3,
        signature=None if signature is None else SparseCounts.from_dense(signature),
        computed=None if computed is None else SparseCounts.from_dense(computed),
    )


async def test_an_event_with_the_whole_signature_is_decided_without_the_service(
    bus: Bus, bus_settings: BusSettings, retention: RetentionSettings, topology: Topology
) -> None:
    await apply_topology(bus, topology)
    port = free_port()
    settings = RouterSettings(
        **(bus_settings.model_dump() | retention.model_dump()),
        signature_timeout_s=0.2,
        signature_hedge_s=1.0,  # never asked twice: the test counts the requests
        stale_after_s=2.0,
        metrics_port=port,
    )
    asked: list[AssembleRequest] = []

    async def on_assemble(msg: AssembleRequest, _: Delivery) -> None:
        asked.append(msg)  # never answered: no signature service runs

    listener = await bus.subscribe(bus.subjects.sig_assemble, AssembleRequest, on_assemble)
    whole = np.arange(L * E, dtype=np.uint32).reshape(L, E) * 7 + 3
    source = "eldr_router_signature_source_total"
    try:
        async with (
            reporting(bus, {"d0": 0, "d1": 0}, period_s=0.1),
            running_service("router", settings, setup),
        ):
            await bus.js_publish(
                bus.subjects.prefill_done("p0"), event("local", signature=whole, computed=None)
            )
            local = await committed_decision(bus, "local")
            assert asked == []
            assert await metric(port, f'{source}{{source="event"}}') == 1
            assert await metric(port, f'{source}{{source="service"}}') == 0
            # Cached blocks the prefill worker held no summary of: the service is asked.
            await bus.js_publish(
                bus.subjects.prefill_done("p0"),
                event("miss", signature=None, computed=np.ones((L, E), np.uint32)),
            )
            miss = await committed_decision(bus, "miss")
            assert [a.request_id for a in asked] == ["miss"]
            assert asked[0].block_hashes == [11, 12, 13]
            assert await metric(port, f'{source}{{source="service"}}') == 1
            assert await metric(port, f'{source}{{source="event"}}') == 1
    finally:
        await listener.stop()
    assert local.signature is not None
    np.testing.assert_array_equal(local.signature.to_dense(np.uint32), whole)
    assert local.missing_blocks == 0
    assert local.fallback is None or not local.fallback.startswith("signature")
    assert miss.fallback == "signature_timeout"  # nobody answered the service's subject
    assert miss.signature is None
