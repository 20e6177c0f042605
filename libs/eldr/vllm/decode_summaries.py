"""Decode summaries inside a decode engine: each request's decode-step experts, counted on
the device, read back once when the request ends.

A decode step runs one (or, with chunking, a few) new token per request through every MoE
layer; the capture plugin's router callbacks write the step's top-k expert ids into one
device buffer `[rows, MoE layers, top_k]`. `DecodeSummaries` folds the rows of the
requests it follows into a per-request count table on the same device:

    counts[slot, layer, expert] += 1   for every decode row of the request in `slot`

with one scatter-add per step and no host synchronisation: the row and slot indices are
small host arrays (from the step layout, `eldr.vllm.layout`) copied to the device from
pinned memory without blocking. An id outside [0, E) (a layer that did not write its rows
this step, or garbage) is counted in an extra column E, so a profile can be refused at
the end without checking every step on the host. When the engine reports the request
finished or aborted, its slot is copied to pinned host memory asynchronously and read on
a later step, once a CUDA event says the copy is done (on CPU: at once). Slots are freed
only after that read, so a reused slot never mixes two requests.

Decode rows are the rows at positions >= the prompt length: the generated tokens fed
back in (the last generated token is never fed, so a request that generated n tokens
has n - 1 decode rows here). A position already folded is skipped, so recomputation
after a preemption does not count twice.

Memory is fixed at construction: `max_requests x L x (E + 1)` int32 on the device and as
much pinned on the host (Qwen3-30B-A3B's 48 x 128 experts, 512 requests: 12.7 MB each).

torch is imported when a `DecodeSummaries` is made (it runs inside vLLM's worker).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from eldr.core.workload.trace import ModelGeometry
from eldr.vllm.layout import StepLayout


@dataclass
class _Followed:
    request_id: str
    slot: int
    n_prompt: int
    next_position: int
    tokens: int = 0
    first_s: float | None = None
    last_s: float | None = None


@dataclass(frozen=True)
class FinishedSummary:
    """One request's decode summary, read back from the device."""

    engine_id: str
    request_id: str
    counts: np.ndarray
    """uint32 [L, E]: decode rows per (MoE layer, expert)."""
    tokens: int
    """Decode rows counted (generated tokens fed back in)."""
    invalid_rows: int
    """(row, layer) cells whose expert id was out of range: the profile is not usable."""
    first_s: float | None
    last_s: float | None

    @property
    def tpot_s(self) -> float | None:
        if self.first_s is None or self.last_s is None or self.tokens < 2:
            return None
        return max(0.0, (self.last_s - self.first_s) / (self.tokens - 1))


@dataclass
class _Copy:
    followed: _Followed
    engine_id: str
    event: Any = None
    host: np.ndarray | None = field(default=None, repr=False)


class DecodeSummaries:
    """Per-request decode expert counts on the engine's device (see the module docstring).

    Not thread-safe: the engine's worker thread calls it, one step at a time.
    """

    def __init__(
        self, geometry: ModelGeometry, *, max_requests: int, max_rows: int, device: Any
    ) -> None:
        if max_requests < 1 or max_rows < 1:
            raise ValueError("max_requests and max_rows must be positive")
        torch = importlib.import_module("torch")
        self._torch = torch
        self.geometry = geometry
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        L, E = geometry.num_moe_layers, geometry.num_experts
        self._width = E + 1
        self.counts = torch.zeros((max_requests, L, self._width), dtype=torch.int32, device=device)
        self._ones = torch.ones(max_rows * L * geometry.top_k, dtype=torch.int32, device=device)
        self._layer = torch.arange(L, dtype=torch.int64, device=device).view(1, L, 1)
        self._free = list(range(max_requests - 1, -1, -1))
        self._followed: dict[str, _Followed] = {}
        self._copies: list[_Copy] = []
        if self._cuda:
            # Double-buffered pinned staging for the per-step index arrays, each with the
            # event of its last copy: a buffer is rewritten only after its copy ran.
            pin = {"pin_memory": True}
            self._host_idx = [
                torch.empty((2, max_rows), dtype=torch.int64, **pin) for _ in range(2)
            ]
            self._idx_events = [torch.cuda.Event(), torch.cuda.Event()]
            self._turn = 0
            self._dev_idx = torch.empty((2, max_rows), dtype=torch.int64, device=device)
            self._staging = torch.empty(
                (max_requests, L, self._width), dtype=torch.int32, pin_memory=True
            )
        self.no_slot = 0
        """Requests not followed because every slot was taken."""

    def __len__(self) -> int:
        return len(self._followed)

    def __contains__(self, engine_id: str) -> bool:
        return engine_id in self._followed

    @property
    def nbytes(self) -> int:
        size = int(self.counts.numel()) * 4
        return size * 2 if self._cuda else size

    def follow(self, engine_id: str, request_id: str, n_prompt: int, now_s: float) -> bool:
        """Start counting a request's decode rows; False (counted) without a free slot."""
        if engine_id in self._followed:
            return True
        if not self._free:
            self.no_slot += 1
            return False
        slot = self._free.pop()
        self._followed[engine_id] = _Followed(request_id, slot, n_prompt, n_prompt)
        return True

    def fold(self, layout: StepLayout, rows: Any, now_s: float) -> int:
        """Count the step's decode rows of followed requests from `rows` (the device
        buffer of expert ids, int32 [>= layout.total, L, top_k]). Returns the rows
        folded. Queues device work only."""
        picked: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        offsets = layout.offsets()
        for i, engine_id in enumerate(layout.engine_ids):
            f = self._followed.get(engine_id)
            if f is None:
                continue
            n, computed = int(layout.num_tokens[i]), int(layout.computed[i])
            first = max(f.next_position, f.n_prompt) - computed
            if first >= n:
                continue
            first = max(first, 0)
            row_ids = np.arange(offsets[i] + first, offsets[i] + n, dtype=np.int64)
            picked.append(row_ids)
            slots.append(np.full(row_ids.shape[0], f.slot, dtype=np.int64))
            f.tokens += row_ids.shape[0]
            f.next_position = computed + n
            f.first_s = now_s if f.first_s is None else f.first_s
            f.last_s = now_s
        if not picked:
            return 0
        row_idx = np.concatenate(picked)
        slot_idx = np.concatenate(slots)
        m = int(row_idx.shape[0])
        dev_rows, dev_slots = self._to_device(row_idx, slot_idx)
        torch = self._torch
        g = self.geometry
        ids = rows[dev_rows].to(torch.int64)  # [m, L, k]
        bad = (ids < 0) | (ids >= g.num_experts)
        ids = ids.masked_fill(bad, g.num_experts)
        flat = (dev_slots.view(m, 1, 1) * g.num_moe_layers + self._layer) * self._width + ids
        self.counts.view(-1).index_put_(
            (flat.reshape(-1),), self._ones[: m * g.num_moe_layers * g.top_k], accumulate=True
        )
        return m

    def _to_device(self, row_idx: np.ndarray, slot_idx: np.ndarray) -> tuple[Any, Any]:
        torch = self._torch
        m = row_idx.shape[0]
        if not self._cuda:
            return (
                torch.from_numpy(row_idx).to(self.device),
                torch.from_numpy(slot_idx).to(self.device),
            )
        turn = self._turn
        self._turn ^= 1
        self._idx_events[turn].synchronize()  # the copy of two steps ago; done long since
        host = self._host_idx[turn]
        view = host.numpy()
        view[0, :m] = row_idx
        view[1, :m] = slot_idx
        self._dev_idx[:, :m].copy_(host[:, :m], non_blocking=True)
        self._idx_events[turn].record()
        return self._dev_idx[0, :m], self._dev_idx[1, :m]

    def finish(self, engine_id: str) -> None:
        """The engine finished or aborted the request: read its counts back (without
        waiting on the device) and zero its slot."""
        f = self._followed.pop(engine_id, None)
        if f is None:
            return
        if f.tokens == 0:
            self._free.append(f.slot)  # nothing counted, nothing to read
            return
        copy = _Copy(f, engine_id)
        if self._cuda:
            torch = self._torch
            self._staging[f.slot].copy_(self.counts[f.slot], non_blocking=True)
            copy.event = torch.cuda.Event()
            copy.event.record()
        else:
            copy.host = self.counts[f.slot].numpy().copy()
        self.counts[f.slot].zero_()
        self._copies.append(copy)

    def ready(self) -> list[FinishedSummary]:
        """The profiles whose read-back completed (their slots are free again)."""
        out: list[FinishedSummary] = []
        waiting: list[_Copy] = []
        for copy in self._copies:
            if copy.event is not None and not copy.event.query():
                waiting.append(copy)
                continue
            f = copy.followed
            host = copy.host if copy.host is not None else self._staging[f.slot].numpy().copy()
            self._free.append(f.slot)
            E = self.geometry.num_experts
            out.append(
                FinishedSummary(
                    engine_id=copy.engine_id,
                    request_id=f.request_id,
                    counts=host[:, :E].astype(np.uint32),
                    tokens=f.tokens,
                    invalid_rows=int(host[:, E].sum()),
                    first_s=f.first_s,
                    last_s=f.last_s,
                )
            )
        self._copies = waiting
        return out
