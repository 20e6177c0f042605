"""Decode-worker stand-ins for router tests: the load reports a worker publishes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager

from eldr.bus import Bus
from eldr.wire import LoadReport


def load_report(
    worker: str, seq: int, running: int = 0, admitted: Sequence[str] = ()
) -> LoadReport:
    """`worker`'s report number `seq`: `running` requests (100 KV tokens each, of 100,000),
    none waiting, `admitted` listed."""
    return LoadReport(
        worker_id=worker,
        incarnation="inc",
        seq=seq,
        ts_s=time.time(),
        running=running,
        waiting=0,
        kv_tokens=running * 100,
        kv_capacity_tokens=100_000,
        admitted=list(admitted),
    )


@asynccontextmanager
async def reporting(
    bus: Bus,
    workers: Mapping[str, int],
    period_s: float = 0.2,
    admitted: Mapping[str, Sequence[str]] | None = None,
) -> AsyncIterator[None]:
    """Every worker of `workers` (id -> running requests) reports every `period_s`, listing
    as admitted what `admitted` holds for it at that moment, as workers do."""

    async def loop() -> None:
        seq = 0
        while True:
            seq += 1
            for worker, running in workers.items():
                listed = () if admitted is None else admitted.get(worker, ())
                await bus.publish(
                    bus.subjects.load(worker), load_report(worker, seq, running, listed)
                )
            await asyncio.sleep(period_s)

    task = asyncio.create_task(loop())
    try:
        yield
    finally:
        task.cancel()
