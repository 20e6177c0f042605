"""Holding a consumed JetStream message while it cannot be handled yet.

A `consume` handler that needs something momentarily missing (the router needs a live
decode worker) can hand the message back (`Retry`), but every hand-back spends one of the
consumer's `max_deliver` deliveries: a fleet down for ~15 s had its waiting requests
dead-lettered that way (found by tests/faults). `hold_while` keeps the delivery instead:
it retries the handler's attempt each time `wake` is set, tells JetStream the message is
in progress well within its ack wait, and gives up only after `hold_s`, when the service
stops, or when the requester's deadline passes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

from eldr.aio import wait_event
from eldr.bus.delivery import Delivery

T = TypeVar("T")


async def hold_while(
    attempt: Callable[[], T],
    unavailable: type[Exception],
    *,
    delivery: Delivery,
    wake: asyncio.Event,
    hold_s: float,
    progress_every_s: float,
    stopping: asyncio.Event,
    deadline_s: float | None = None,
) -> T | None:
    """`attempt()`'s result, retried while it raises `unavailable`.

    Between tries it waits for `wake` (set by whatever may make the attempt succeed, e.g.
    every load report), at most until the next in-progress signal is due (every
    `progress_every_s`, a third of the consumer's ack wait is safe) or until `deadline_s`
    (Unix seconds; the requester stops waiting then). Returns None once `deadline_s` has
    passed; re-raises the last `unavailable` after `hold_s` or once `stopping` is set
    (the caller hands the message back, e.g. with `Retry`).
    """
    give_up = time.monotonic() + hold_s
    next_progress = time.monotonic() + progress_every_s
    while True:
        try:
            return attempt()
        except unavailable:
            now = time.monotonic()
            wall = time.time()
            if deadline_s is not None and wall > deadline_s:
                return None
            remaining = give_up - now
            if remaining <= 0 or stopping.is_set():
                raise
            if now >= next_progress and delivery.in_progress is not None:
                await delivery.in_progress()
                next_progress = now + progress_every_s
            wait_s = min(remaining, max(0.0, next_progress - now))
            if deadline_s is not None:
                wait_s = min(wait_s, max(0.0, deadline_s - wall) + 0.001)
            wake.clear()
            await wait_event(wake, wait_s)
