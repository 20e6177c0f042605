"""Steady load, fault injection and exactly-once accounting for the fault suite.

`SteadyLoad` plays a prefill worker plus gateway at a fixed request rate: for each request it
publishes the block summaries of its prompt (once per distinct prompt) and a `PrefillDone`
without `computed` counts, so every decision asks the signature service for every block. A
publish that fails (NATS restarting) is retried with the same `Nats-Msg-Id` for up to
`publish_retry_s`, as an at-least-once producer would; the request counts as *accepted* once
JetStream acknowledged its PrefillDone. Replies arrive on an inbox and are only recorded:
the load never waits for them, so a stalled pipeline does not slow the offered load.

`account` then reads the record of truth, the DECISIONS stream: every accepted request must
have exactly one decision there (`lost`: none; `doubled`: more than one, or a reply naming
another worker than the committed decision). Recovery times come from the decisions' own
commit times (`Decision.ts_s`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import time
import urllib.request
import uuid
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from eldr.bus import Bus, BusError, Delivery, Subscription, stream_name
from eldr.bus.topology import DECISIONS, DLQ
from eldr.core.signature.blocks import summarize_blocks, trace_token_ids
from eldr.core.workload.trace import TraceSet
from eldr.wire import (
    BlockSummaryBatch,
    BlockSummaryMsg,
    DeadLetter,
    Decision,
    PrefillDone,
    RouterControl,
    RouterControlReply,
    SparseCounts,
)

log = logging.getLogger(__name__)


@dataclass
class Sent:
    """One request of the steady load."""

    request_id: str
    created_s: float
    """Wall clock when the load generator made it."""
    accepted_s: float | None = None
    """Wall clock when JetStream acknowledged its PrefillDone; None: never accepted."""
    publish_attempts: int = 0
    reply_worker: str | None = None
    reply_s: float | None = None
    replies: int = 0
    error: str | None = None


@dataclass
class _Prompt:
    blocks: list[BlockSummaryMsg]
    partial: SparseCounts | None
    n_prompt_tokens: int
    published: asyncio.Future[None] | None = None


class SteadyLoad:
    """Offers `rate_per_s` requests per second until stopped (see the module docstring)."""

    def __init__(
        self,
        bus: Bus,
        traces: TraceSet,
        *,
        rate_per_s: float,
        model: str = "faults",
        prefill_worker: str = "prefill-faults",
        block_size: int = 16,
        publish_retry_s: float = 60.0,
        max_in_flight: int = 5000,
    ) -> None:
        self.bus = bus
        self.traces = traces
        self.rate_per_s = rate_per_s
        self.model = model
        self.prefill_worker = prefill_worker
        self.block_size = block_size
        self.publish_retry_s = publish_retry_s
        self.requests: dict[str, Sent] = {}
        self.inbox = f"_INBOX.eldr-faults.{uuid.uuid4().hex}"
        self._prompts: dict[int, _Prompt] = {}
        self._rng = np.random.default_rng(0)
        self._batch_seq = 0
        self._slots = asyncio.Semaphore(max_in_flight)
        self._tasks: set[asyncio.Task[None]] = set()
        self._stop = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._subscription: Subscription | None = None
        self._prefix = ""
        self._n = 0

    # --- lifecycle --------------------------------------------------------------------

    async def start(self, prefix: str) -> None:
        """Start offering requests with ids `{prefix}-{n}`."""
        if self._subscription is None:
            self._subscription = await self.bus.subscribe(self.inbox, Decision, self._on_reply)
        self._prefix = prefix
        self._n = 0
        self._stop.clear()
        self._loop_task = asyncio.create_task(self._offer(), name=f"load {prefix}")

    async def stop(self) -> None:
        """Stop offering; wait until every request was accepted or gave up."""
        self._stop.set()
        if self._loop_task is not None:
            await self._loop_task
            self._loop_task = None
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        await self.stop()
        if self._subscription is not None:
            await self._subscription.stop()
            self._subscription = None

    # --- offering ---------------------------------------------------------------------

    async def _offer(self) -> None:
        period = 1.0 / self.rate_per_s
        next_s = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            if next_s > now:
                await asyncio.sleep(next_s - now)
                continue
            next_s += period
            await self._slots.acquire()
            self._n += 1
            rid = f"{self._prefix}-{self._n:06d}"
            sent = Sent(request_id=rid, created_s=time.time())
            self.requests[rid] = sent
            index = int(self._rng.integers(0, len(self.traces)))
            task = asyncio.create_task(self._one(sent, index))
            self._tasks.add(task)
            task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._slots.release()

    def _prompt(self, index: int) -> _Prompt:
        prompt = self._prompts.get(index)
        if prompt is None:
            trace = self.traces.traces[index]
            full, partial = summarize_blocks(
                trace_token_ids(trace),
                trace.prefill,
                self.block_size,
                self.traces.geometry.num_experts,
            )
            prompt = _Prompt(
                blocks=[
                    BlockSummaryMsg(
                        block_hash=int(b.block_hash),
                        parent_hash=b.parent_hash,
                        n_tokens=b.n_tokens,
                        counts=SparseCounts.from_dense(b.counts),
                    )
                    for b in full
                    if b.block_hash is not None
                ],
                partial=SparseCounts.from_dense(partial.counts) if partial is not None else None,
                n_prompt_tokens=trace.prompt_tokens,
            )
            self._prompts[index] = prompt
        return prompt

    async def _retrying(self, what: str, call: Any, sent: Sent | None = None) -> bool:
        deadline = time.monotonic() + self.publish_retry_s
        while True:
            if sent is not None:
                sent.publish_attempts += 1
            try:
                await call()
                return True
            except BusError as exc:
                if time.monotonic() > deadline:
                    if sent is not None:
                        sent.error = f"{what}: {exc}"
                    log.warning("load: %s gave up: %s", what, exc)
                    return False
                await asyncio.sleep(0.2)

    async def _publish_blocks(self, prompt: _Prompt) -> bool:
        if prompt.published is not None:
            await asyncio.shield(prompt.published)
            return True
        prompt.published = asyncio.get_running_loop().create_future()
        geometry = self.traces.geometry
        self._batch_seq += 1
        batch = BlockSummaryBatch(
            worker_id=self.prefill_worker,
            seq=self._batch_seq,
            ts_s=time.time(),
            model=self.model,
            num_moe_layers=geometry.num_moe_layers,
            num_experts=geometry.num_experts,
            block_size=self.block_size,
            blocks=prompt.blocks,
        )
        subject = self.bus.subjects.blocks(self.prefill_worker)
        ok = await self._retrying(
            "blocks",
            lambda: self.bus.js_publish(subject, batch, msg_id=f"{self._prefix}-b{batch.seq}"),
        )
        prompt.published.set_result(None)
        if not ok:
            prompt.published = None
        return ok

    async def _one(self, sent: Sent, index: int) -> None:
        prompt = self._prompt(index)
        if prompt.blocks and not await self._publish_blocks(prompt):
            sent.error = "blocks not published"
            return
        geometry = self.traces.geometry
        event = PrefillDone(
            request_id=sent.request_id,
            model=self.model,
            prefill_worker=self.prefill_worker,
            ts_s=time.time(),
            block_size=self.block_size,
            block_hashes=[b.block_hash for b in prompt.blocks],
            n_prompt_tokens=prompt.n_prompt_tokens,
            partial=prompt.partial,
            num_moe_layers=geometry.num_moe_layers,
            num_experts=geometry.num_experts,
            reply_to=self.inbox,
        )
        subject = self.bus.subjects.prefill_done(self.prefill_worker)
        accepted = await self._retrying(
            "prefill done",
            lambda: self.bus.js_publish(subject, event, msg_id=sent.request_id),
            sent,
        )
        if accepted:
            sent.accepted_s = time.time()

    async def _on_reply(self, decision: Decision, _: Delivery) -> None:
        sent = self.requests.get(decision.request_id)
        if sent is None:
            return
        sent.replies += 1
        if sent.reply_worker is None:
            sent.reply_worker = decision.worker_id
            sent.reply_s = time.time()
        elif sent.reply_worker != decision.worker_id:
            log.error(
                "request %s answered with %s, then %s",
                decision.request_id,
                sent.reply_worker,
                decision.worker_id,
            )
            sent.reply_worker = f"{sent.reply_worker}|{decision.worker_id}"


# --- the record of truth ---------------------------------------------------------------


@dataclass(frozen=True)
class Committed:
    worker_id: str
    ts_s: float
    fallback: str | None
    router_id: str
    missing_blocks: int


async def read_decisions(bus: Bus, since_s: float, prefix: str) -> dict[str, list[Committed]]:
    """Every decision in DECISIONS stored since `since_s` whose request id starts with
    `prefix`, by request id (more than one per id would be a double assignment)."""
    found: dict[str, list[Committed]] = {}

    async def on_decision(decision: Decision, _: Delivery) -> None:
        if decision.request_id.startswith(prefix):
            found.setdefault(decision.request_id, []).append(
                Committed(
                    decision.worker_id,
                    decision.ts_s,
                    decision.fallback,
                    decision.router_id,
                    decision.missing_blocks,
                )
            )

    stream = stream_name(bus.subjects.namespace, DECISIONS)
    # The checker's own read: a cluster still recovering from the fault may answer 503 for a
    # moment, which is not what the scenario measures; retried as the services retry it.
    reader = await bus.retrying(
        "read back decisions",
        lambda: bus.read_back(
            stream,
            bus.subjects.decisions_all,
            Decision,
            on_decision,
            start_time_s=since_s,
            stop_at_end=True,
        ),
        give_up_s=30.0,
    )
    await reader.wait_caught_up(timeout_s=60)
    return found


async def read_dead_letters(bus: Bus, since_s: float) -> list[DeadLetter]:
    letters: list[DeadLetter] = []

    async def on_letter(letter: DeadLetter, _: Delivery) -> None:
        letters.append(letter)

    stream = stream_name(bus.subjects.namespace, DLQ)
    reader = await bus.retrying(
        "read back dead letters",
        lambda: bus.read_back(
            stream,
            bus.subjects.dlq_all,
            DeadLetter,
            on_letter,
            start_time_s=since_s,
            stop_at_end=True,
        ),
        give_up_s=30.0,
    )
    await reader.wait_caught_up(timeout_s=30)
    return letters


async def wait_decided(
    bus: Bus, load: SteadyLoad, since_s: float, prefix: str, timeout_s: float
) -> dict[str, list[Committed]]:
    """Poll DECISIONS until every accepted request of `prefix` has a decision (or time out);
    returns the last reading."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = await read_decisions(bus, since_s, prefix)
        pending = [
            s
            for rid, s in load.requests.items()
            if rid.startswith(prefix) and s.accepted_s is not None and rid not in found
        ]
        if not pending or time.monotonic() > deadline:
            return found
        await asyncio.sleep(1.0)


@dataclass
class ScenarioResult:
    scenario: str
    fault: str
    sent: int
    """Requests the load generator made."""
    accepted: int
    """... whose PrefillDone JetStream acknowledged (possibly after retries)."""
    decided: int
    """Accepted requests with a decision in DECISIONS."""
    lost: int
    """Accepted requests without a decision."""
    doubled: int
    """Requests with more than one decision, or a reply naming another worker."""
    not_accepted: int
    """Requests whose PrefillDone publish gave up (the producer knows: not lost)."""
    publish_retries: int
    """Extra PrefillDone publish attempts (NATS unavailable)."""
    dead_lettered: int
    redelivered_replies: int
    """Requests answered more than once (same worker: a redelivery answered from the
    committed decision)."""
    fault_s: float
    """How long the fault lasted (injection to repair done)."""
    recovery_s: float
    """From the repair to the moment every request accepted before it was decided."""
    max_decide_s: float
    """Largest accepted -> committed time of any request of the scenario."""
    p50_decide_ms: float
    stall_s: float = math.nan
    """Longest time without any decision committed, from 1 s before the fault to the end
    of the scenario (the offered load never stops: a gap is the pipeline stalling)."""
    fallbacks: dict[str, int] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarise(
    scenario: str,
    fault: str,
    load: SteadyLoad,
    prefix: str,
    found: dict[str, list[Committed]],
    dead_letters: Iterable[DeadLetter],
    *,
    fault_start_s: float,
    repaired_s: float,
) -> ScenarioResult:
    mine = [s for rid, s in load.requests.items() if rid.startswith(prefix)]
    accepted = [s for s in mine if s.accepted_s is not None]
    decided = [s for s in accepted if s.request_id in found]
    doubled = 0
    for s in mine:
        commits = found.get(s.request_id, [])
        replied_other = (
            bool(commits) and s.reply_worker is not None and s.reply_worker != commits[0].worker_id
        )
        if len(commits) > 1 or replied_other:
            doubled += 1
    decide_s = [
        found[s.request_id][0].ts_s - s.accepted_s for s in decided if s.accepted_s is not None
    ]
    before_repair = [
        found[s.request_id][0].ts_s
        for s in decided
        if s.accepted_s is not None and s.accepted_s <= repaired_s
    ]
    fallbacks: dict[str, int] = {}
    for s in decided:
        reason = found[s.request_id][0].fallback
        if reason:
            fallbacks[reason] = fallbacks.get(reason, 0) + 1
    letters = [d for d in dead_letters if prefix.encode() in d.payload]
    commits = sorted(
        c.ts_s for s in decided for c in found[s.request_id] if c.ts_s >= fault_start_s - 1.0
    )
    stall_s = max((b - a for a, b in itertools.pairwise(commits)), default=math.nan)
    return ScenarioResult(
        scenario=scenario,
        fault=fault,
        sent=len(mine),
        accepted=len(accepted),
        decided=len(decided),
        lost=len(accepted) - len(decided),
        doubled=doubled,
        not_accepted=len(mine) - len(accepted),
        publish_retries=sum(max(0, s.publish_attempts - 1) for s in mine),
        dead_lettered=len(letters),
        redelivered_replies=sum(1 for s in mine if s.replies > 1),
        fault_s=round(repaired_s - fault_start_s, 2),
        recovery_s=round(max(0.0, max(before_repair, default=repaired_s) - repaired_s), 2),
        max_decide_s=round(max(decide_s, default=math.nan), 3),
        p50_decide_ms=round(float(np.percentile(decide_s, 50)) * 1e3, 1) if decide_s else math.nan,
        stall_s=round(stall_s, 2),
        fallbacks=dict(sorted(fallbacks.items())),
        notes={
            "missing_blocks": sum(found[s.request_id][0].missing_blocks for s in decided),
            # Answered by the signature service but incomplete: blocks it should have had.
            "partial_signatures": sum(
                1
                for s in decided
                if found[s.request_id][0].fallback is None and found[s.request_id][0].missing_blocks
            ),
            "answered_by": _by_router(found[s.request_id][0] for s in decided),
        },
    )


def _by_router(commits: Iterable[Committed]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for c in commits:
        counts[c.router_id] = counts.get(c.router_id, 0) + 1
    return dict(sorted(counts.items()))


# --- observing services ------------------------------------------------------------------


def scrape(url: str, timeout_s: float = 2.0) -> dict[str, float]:
    """A service's /metrics as {'name{label="v",...}': value} (samples, not families)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=timeout_s) as response:
        text = response.read().decode()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def metric_sum(samples: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total


async def router_views(bus: Bus, routers: int, timeout_s: float = 1.0) -> list[RouterControlReply]:
    replies = await bus.request_many(
        bus.subjects.control_router,
        RouterControl(policy=None, tau=None, load_measure=None),
        RouterControlReply,
        timeout_s=timeout_s,
        max_replies=routers,
    )
    return [r for r in replies if isinstance(r, RouterControlReply)]


async def wait_until(predicate: Any, timeout_s: float, what: str, poll_s: float = 0.1) -> float:
    """Await `predicate()` (an async callable returning bool) until true; returns the seconds
    it took. Raises TimeoutError naming `what`."""
    started = time.monotonic()
    while True:
        if await predicate():
            return time.monotonic() - started
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"{what}: not within {timeout_s:g} s")
        await asyncio.sleep(poll_s)


# --- the report ----------------------------------------------------------------------------


COLUMNS = (
    ("scenario", "scenario"),
    ("sent", "sent"),
    ("accepted", "accepted"),
    ("decided", "decided"),
    ("lost", "lost"),
    ("doubled", "doubled"),
    ("dead_lettered", "DLQ"),
    ("redelivered_replies", "answered twice"),
    ("publish_retries", "publish retries"),
    ("fault_s", "fault s"),
    ("recovery_s", "recovery s"),
    ("max_decide_s", "max decide s"),
    ("p50_decide_ms", "P50 decide ms"),
)
CLUSTER_COLUMNS = (
    ("scenario", "scenario"),
    ("sent", "sent"),
    ("decided", "decided"),
    ("lost", "lost"),
    ("doubled", "doubled"),
    ("dead_lettered", "DLQ"),
    ("fault_s", "fault s"),
    ("stall_s", "stall s"),
    ("recovery_s", "recovery s"),
    ("max_decide_s", "max decide s"),
)


def markdown_table(
    results: Iterable[ScenarioResult], columns: tuple[tuple[str, str], ...] = COLUMNS
) -> str:
    lines = [
        "| " + " | ".join(title for _, title in columns) + " |",
        "|" + "|".join("---" for _ in columns) + "|",
    ]
    for r in results:
        row = r.as_dict()
        lines.append("| " + " | ".join(str(row[key]) for key, _ in columns) + " |")
    return "\n".join(lines)


def write_report(
    path: Path,
    results: list[ScenarioResult],
    meta: dict[str, Any],
    columns: tuple[tuple[str, str], ...] = COLUMNS,
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "results": [r.as_dict() for r in results]}, indent=2))
    with contextlib.suppress(OSError):
        path.with_suffix(".md").write_text(markdown_table(results, columns) + "\n")
