"""One simulated decode worker's continuous batching, as a pure state machine.

Shared by the discrete-event simulator (`eldr.sim.cluster`, simulated time, one worker per
decode worker slot) and the live simulated decode workers (`eldr_services.simdecode`, scaled
real time). The caller owns the clock: it calls `start_step(now_s)`, waits the returned
plan's `duration_s` (simulated or real), then calls `finish_step(plan, now_s)`; nothing here
reads a clock or sleeps.

Semantics:

- A submitted request waits until the next step boundary; there the waiting requests join
  the batch in arrival order while the batch has fewer than `max_batch` requests and their
  KV (prompt plus decode budget) fits `kv_capacity_tokens` (a lone request is always
  admitted, so an oversized one cannot block the queue forever). A boundary earlier than a
  request's submission does not admit it (a live worker running its steps on schedule
  while it catches up with a late event loop). A request still waiting after a boundary
  that it could have joined is `blocked` (it waited for a batch slot or for KV).
- A step advances every running request by one decode token. It costs what the cost model
  says for the distinct (MoE layer, expert) pairs the batch's current decode tokens route
  to and for the KV tokens it is charged for (`step_kv`): the running requests' (what the
  batch's attention reads), or all the worker holds.
- A request finishes at the end of the step that produced its last decode token; its TPOT
  is (finish - submit) / decode tokens, so queueing before admission counts, as a user
  waiting for tokens would see it.
- KV held: every request's prompt (its KV arrived with it) plus the decode tokens generated
  so far; a request announced with `expect` holds its prompt's KV from then on, before its
  job arrives (the simulator counts a request's KV at its worker from the routing decision).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from eldr.core.costmodel import Deployment
from eldr.core.workload.trace import expert_counts

MAX_TPOT_SAMPLES = 65_536
"""Newest per-request TPOTs kept for statistics (the `SimStats.tpot_s` bound)."""

StepKv = Literal["batch", "held"]
"""What a step's KV term counts: the running requests' KV, or all KV the worker holds."""


def flatten_decode_ids(decode_ids: np.ndarray, num_experts: int) -> np.ndarray:
    """[tokens, layers, top_k] expert ids -> int32 [tokens, layers * top_k] layer-offset ids.

    Each id becomes `layer * num_experts + expert`, so the distinct (layer, expert) pairs of
    a set of tokens are the distinct values among their rows.
    """
    tokens, layers, top_k = decode_ids.shape
    offsets = (np.arange(layers, dtype=np.int32) * num_experts)[None, :, None]
    return (decode_ids.astype(np.int32) + offsets).reshape(tokens, layers * top_k)


class UnionCounter:
    """Counts distinct layer-offset expert ids with a reusable scratch mask.

    Marking the ids in a boolean mask, counting and unmarking costs O(ids + slots) with no
    sort, which beats `np.unique` for the batch sizes of a decode step.
    """

    __slots__ = ("_seen",)

    def __init__(self, slots: int) -> None:
        if slots <= 0:
            raise ValueError(f"slots must be positive, got {slots}")
        self._seen = np.zeros(slots, dtype=bool)

    @property
    def slots(self) -> int:
        return int(self._seen.shape[0])

    def ensure(self, slots: int) -> None:
        """Grow the id space to at least `slots` (ids already counted stay valid)."""
        if slots > self._seen.shape[0]:
            self._seen = np.zeros(slots, dtype=bool)

    def count(self, ids: np.ndarray) -> int:
        """Distinct values of `ids` (non-negative ints below `slots`)."""
        seen = self._seen
        seen[ids] = True
        distinct = int(np.count_nonzero(seen))
        seen[ids] = False
        return distinct


@dataclass(slots=True, eq=False)
class DecodeTask:
    """A request inside a worker: waiting, or running at decode token `position`."""

    request_id: str
    prompt_tokens: int
    flat: np.ndarray
    """int32 [decode_tokens, moe_layers * top_k], layer-offset ids."""
    num_moe_layers: int
    submitted_s: float
    label: str = ""
    decode_ids: np.ndarray | None = None
    """int16 [decode_tokens, moe_layers, top_k] as received, for the decode summary (None:
    the simulator's requests, flattened once for every arrival that replays them)."""
    decode_tokens: int = field(init=False)
    position: int = 0
    admitted_s: float | None = None
    blocked: bool = False
    """Still waiting after a step boundary it could have joined (batch or KV full)."""

    def __post_init__(self) -> None:
        self.decode_tokens = int(self.flat.shape[0])

    @property
    def kv_reserved_tokens(self) -> int:
        """KV the request holds once fully decoded (what admission reserves)."""
        return self.prompt_tokens + self.decode_tokens


@dataclass(frozen=True)
class StepPlan:
    """What one decode step does and costs."""

    batch_size: int
    union_total: int
    """Distinct (MoE layer, expert) pairs of the step, summed over layers."""
    union_per_layer: float
    """union_total / MoE layers: distinct experts per layer."""
    kv_tokens: int
    """KV tokens the step is charged for (`BatchingWorker.step_kv`)."""
    duration_s: float
    """Step time by the cost model (simulated seconds)."""
    admitted: tuple[str, ...]
    """Requests that joined the batch at this step boundary."""


@dataclass(frozen=True)
class FinishedRequest:
    request_id: str
    label: str
    decode_tokens: int
    tpot_s: float
    """(finish - submit) / decode tokens, in the caller's time unit."""
    queue_s: float
    """Submit -> admission into the batch."""
    blocked: bool
    """It waited past a step boundary for a batch slot or KV (`DecodeTask.blocked`)."""
    decode_ids: np.ndarray | None
    num_experts: int

    @property
    def decode_counts(self) -> np.ndarray:
        """int32 [moe_layers, num_experts]: decode expert counts over all generated tokens
        (counted when asked: only a worker that publishes decode summaries needs them)."""
        if self.decode_ids is None:
            raise ValueError(f"request {self.request_id} was queued without its decode ids")
        return expert_counts(self.decode_ids, self.num_experts)


@dataclass
class WorkerStats:
    """Statistics since the last reset (what `SimStats` reports)."""

    steps: int = 0
    union_per_layer_sum: float = 0.0
    batch_sum: int = 0
    finished: int = 0
    tpot_s: deque[float] = field(default_factory=lambda: deque(maxlen=MAX_TPOT_SAMPLES))

    @property
    def union_per_layer_mean(self) -> float:
        return self.union_per_layer_sum / self.steps if self.steps else float("nan")

    @property
    def batch_mean(self) -> float:
        return self.batch_sum / self.steps if self.steps else float("nan")


class BatchingWorker:
    """Continuous batching of one decode worker (see the module docstring).

    num_experts: the model's experts per MoE layer; every expert id must lie below it, and
    decode summaries are shaped [moe_layers, num_experts]. kv_capacity_tokens: None for no
    limit. step_kv: what a step's KV term counts: "batch", the running requests' KV (what
    the attention reads; simdecode), or "held", all KV the worker holds, waiting and
    expected requests' prompts included (the discrete-event simulator's cost, on which its
    recorded results rest).
    """

    def __init__(
        self,
        worker_id: str,
        cost: Deployment,
        *,
        num_experts: int,
        max_batch: int = 64,
        kv_capacity_tokens: int | None = 1 << 20,
        step_kv: StepKv = "batch",
    ) -> None:
        if num_experts <= 0:
            raise ValueError(f"num_experts must be positive, got {num_experts}")
        if max_batch <= 0:
            raise ValueError(f"max_batch must be positive, got {max_batch}")
        if kv_capacity_tokens is not None and kv_capacity_tokens <= 0:
            raise ValueError(f"kv_capacity_tokens must be positive, got {kv_capacity_tokens}")
        if step_kv not in ("batch", "held"):
            raise ValueError(f"step_kv must be 'batch' or 'held', got {step_kv!r}")
        self.worker_id = worker_id
        self.cost = cost
        self.num_experts = num_experts
        self.max_batch = max_batch
        self.kv_capacity_tokens = kv_capacity_tokens
        self.step_kv = step_kv
        self.running: list[DecodeTask] = []
        self.waiting: deque[DecodeTask] = deque()
        self.stats = WorkerStats()
        self._ids: set[str] = set()
        self._union = UnionCounter(num_experts)
        self._kv_running = 0
        """KV of the running requests: prompts plus decode tokens so far."""
        self._kv_waiting = 0
        """Prompts of the waiting requests."""
        self._kv_expected = 0
        """Prompts of the requests announced with `expect` whose jobs have not arrived."""
        self._kv_budget = 0
        """Prompt plus decode budget of the running requests (what admission checks)."""

    # --- state ------------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    @property
    def kv_tokens(self) -> int:
        """KV tokens held: every request's prompt (its KV arrived with it, or is on its way
        for an expected one) plus the decode tokens generated so far."""
        return self._kv_running + self._kv_waiting + self._kv_expected

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._ids

    # --- transitions ------------------------------------------------------------------

    def check(self, decode_ids: np.ndarray) -> str | None:
        """Why a request with these decode expert ids cannot run here, or None."""
        if decode_ids.ndim != 3:
            return f"decode ids must be [tokens, layers, top_k], got shape {decode_ids.shape}"
        if decode_ids.shape[0] == 0:
            return "no decode tokens"
        if decode_ids.shape[1] == 0 or decode_ids.shape[2] == 0:
            return f"decode ids have an empty dimension: {decode_ids.shape}"
        low, high = int(decode_ids.min()), int(decode_ids.max())
        if low < 0 or high >= self.num_experts:
            return f"expert ids span [{low}, {high}], this worker's model has {self.num_experts}"
        return None

    def submit(
        self,
        request_id: str,
        decode_ids: np.ndarray,
        now_s: float,
        *,
        prompt_tokens: int = 0,
        label: str = "",
    ) -> str | None:
        """Check and queue a request; returns None, or the reason it was refused."""
        if request_id in self._ids:
            return "duplicate request id"
        problem = self.check(decode_ids)
        if problem is not None:
            return problem
        if prompt_tokens < 0:
            return f"prompt_tokens must be non-negative, got {prompt_tokens}"
        self.enqueue(
            DecodeTask(
                request_id=request_id,
                prompt_tokens=prompt_tokens,
                flat=flatten_decode_ids(decode_ids, self.num_experts),
                num_moe_layers=int(decode_ids.shape[1]),
                submitted_s=now_s,
                label=label,
                decode_ids=decode_ids,
            )
        )
        return None

    def expect(self, prompt_tokens: int) -> None:
        """A request was routed here and its job is on its way: its prompt's KV counts as
        held from now; `enqueue(..., expected=True)` takes it over when the job arrives."""
        self._kv_expected += prompt_tokens

    def enqueue(self, task: DecodeTask, *, expected: bool = False) -> None:
        """Queue a task that is already checked and flattened (`submit` checks a job's;
        the simulator's requests are flattened once for every arrival that replays them).
        expected: it was announced with `expect`."""
        self._union.ensure(task.num_moe_layers * self.num_experts)
        self._ids.add(task.request_id)
        self.waiting.append(task)
        self._kv_waiting += task.prompt_tokens
        if expected:
            self._kv_expected -= task.prompt_tokens

    def _admit(self, now_s: float) -> list[str]:
        admitted: list[str] = []
        running, waiting, capacity = self.running, self.waiting, self.kv_capacity_tokens
        while waiting and len(running) < self.max_batch:
            task = waiting[0]
            if task.submitted_s > now_s:
                break  # not there yet at this step boundary (a live worker catching up)
            budget = task.kv_reserved_tokens
            if capacity is not None and running and self._kv_budget + budget > capacity:
                break
            waiting.popleft()
            task.admitted_s = now_s
            running.append(task)
            self._kv_waiting -= task.prompt_tokens
            self._kv_running += task.prompt_tokens
            self._kv_budget += budget
            admitted.append(task.request_id)
        for task in waiting:
            if task.submitted_s <= now_s:
                task.blocked = True
        return admitted

    def start_step(self, now_s: float) -> StepPlan | None:
        """Admit waiting requests, then plan the next step; None when there is nothing to
        run (the worker is idle)."""
        admitted = self._admit(now_s)
        running = self.running
        if not running:
            return None
        rows = [t.flat[t.position] for t in running]
        ids = np.concatenate(rows) if len(rows) > 1 else rows[0]
        union_total = self._union.count(ids)
        layers = max(t.num_moe_layers for t in running)
        kv = self._kv_running if self.step_kv == "batch" else self.kv_tokens
        return StepPlan(
            batch_size=len(running),
            union_total=union_total,
            union_per_layer=union_total / layers,
            kv_tokens=kv,
            duration_s=self.cost.step_time_s(union_total, kv, len(running)),
            admitted=tuple(admitted),
        )

    def finish_step(self, plan: StepPlan, now_s: float) -> list[FinishedRequest]:
        """The planned step ended at `now_s`: advance every running request by one token,
        record the step's statistics, return the requests that finished."""
        stats = self.stats
        stats.steps += 1
        stats.union_per_layer_sum += plan.union_per_layer
        stats.batch_sum += plan.batch_size
        finished: list[FinishedRequest] = []
        keep: list[DecodeTask] = []
        self._kv_running += len(self.running)
        for task in self.running:
            task.position += 1
            if task.position < task.decode_tokens:
                keep.append(task)
                continue
            self._kv_running -= task.prompt_tokens + task.decode_tokens
            self._kv_budget -= task.prompt_tokens + task.decode_tokens
            self._ids.discard(task.request_id)
            tpot_s = (now_s - task.submitted_s) / task.decode_tokens
            admitted_s = task.admitted_s if task.admitted_s is not None else task.submitted_s
            finished.append(
                FinishedRequest(
                    request_id=task.request_id,
                    label=task.label,
                    decode_tokens=task.decode_tokens,
                    tpot_s=tpot_s,
                    queue_s=admitted_s - task.submitted_s,
                    blocked=task.blocked,
                    decode_ids=task.decode_ids,
                    num_experts=self.num_experts,
                )
            )
            stats.finished += 1
            stats.tpot_s.append(tpot_s)
        self.running = keep
        return finished

    def abandon(self) -> list[str]:
        """Drop every running and waiting request (shutdown); returns their ids."""
        dropped = [t.request_id for t in self.running] + [t.request_id for t in self.waiting]
        self.running = []
        self.waiting.clear()
        self._ids.clear()
        self._kv_running = self._kv_waiting = self._kv_expected = self._kv_budget = 0
        return dropped

    def reset_stats(self) -> None:
        self.stats = WorkerStats()
