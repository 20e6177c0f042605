"""Prefill capture's counting on the device: per step, the (MoE layer, expert) counts of
each (request, block) segment the step computed, with tensor ops where the router
callbacks left the expert ids, and one small non-blocking copy to the host.

The plan of a step (`eldr.vllm.capture.StepPlan`, host arithmetic from the step layout)
says which rows belong to which segment. `SegmentCounter.count` then, on the model's
device and without waiting for it:

1. copies the plan's row and segment indices there (pinned memory, non-blocking);
2. gathers those rows of the capture buffer, maps every id outside [0, E) (a layer that
   did not write leaves -1) to column E, and counts (segment, layer, id) with one
   `bincount` into a table [segments, L, E + 1];
3. narrows the table (uint8 while a segment's counts fit: block size x top-k <= 255) and
   copies it to pinned host memory with `non_blocking=True`, recording a CUDA event.

No per-step host synchronisation: the engine's thread returns at once, the counts are read
once the event says the copy is done (a step later, or by the plugin's drainer thread when
the engine goes idle). Per block of 16 tokens at Qwen3-30B-A3B's 48 x 128 experts the copy
is 48 x 129 bytes = 6.2 KB, against 16 x 48 x 8 x 4 = 24.6 KB of int32 expert ids that the
blocking copy used to move (docs/VLLM.md has the arithmetic for a whole step). On the CPU
the host is the device: numpy's bincount over the buffer's own memory, at once.

torch is imported when a `SegmentCounter` is made (it runs inside vLLM's worker).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from eldr.core.workload.trace import ModelGeometry
from eldr.vllm.capture import StepPlan, segment_counts


@dataclass
class _Slot:
    """One set of pinned staging buffers and the events of their copies."""

    index_host: Any
    """int64 [2, max rows] pinned: the plan's row and segment indices."""
    counts_host: Any
    """narrow dtype [max cells] pinned: the step's counts."""
    index_event: Any = None
    counts_event: Any = None
    busy: bool = False


@dataclass
class PendingCounts:
    """The counts of one step, on their way to the host."""

    n_segments: int
    shape: tuple[int, int, int]
    host: Any = None
    """The counts when they are already on the host (CPU, or the fallback copy)."""
    slot: _Slot | None = None
    done: bool = field(default=False)

    def ready(self) -> bool:
        if self.host is not None or self.slot is None:
            return True
        event = self.slot.counts_event
        return event is None or bool(event.query())

    def wait(self) -> None:
        """Block until the copy is done (the drainer's thread; releases the GIL)."""
        if self.slot is not None and self.slot.counts_event is not None:
            self.slot.counts_event.synchronize()

    def discard(self) -> None:
        """Never read: its staging slot is free again (a later copy is ordered after)."""
        if self.slot is not None:
            self.slot.busy = False
            self.slot = None

    def result(self) -> np.ndarray:
        """uint32 [segments, L, E + 1]; waits for the copy if it is not done (once read,
        the staging slot is free again)."""
        if self.host is not None:
            return np.asarray(self.host, dtype=np.uint32).reshape(self.shape)
        assert self.slot is not None
        slot = self.slot
        if slot.counts_event is not None:
            slot.counts_event.synchronize()
        cells = self.shape[0] * self.shape[1] * self.shape[2]
        out = slot.counts_host[:cells].numpy().astype(np.uint32).reshape(self.shape)
        slot.busy = False
        self.slot = None
        self.host = out
        return np.asarray(out)


class SegmentCounter:
    """See the module docstring. Not thread-safe: one caller at a time (the plugin holds
    its lock around `count` and around reading results)."""

    def __init__(
        self,
        geometry: ModelGeometry,
        *,
        max_rows: int,
        max_segments: int,
        block_size: int,
        device: Any,
        ring: int = 4,
    ) -> None:
        torch = importlib.import_module("torch")
        self._torch = torch
        self.geometry = geometry
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.max_rows = max_rows
        self.max_segments = max_segments
        L, k = geometry.num_moe_layers, geometry.top_k
        self._width = geometry.num_experts + 1
        per_cell = block_size * k
        self.narrow = (
            torch.uint8 if per_cell <= 255 else torch.int16 if per_cell <= 32767 else torch.int32
        )
        self._layer = torch.arange(L, dtype=torch.int64, device=self.device).view(1, L, 1)
        self._slots: list[_Slot] = []
        self._next = 0
        if self.cuda:
            cells = max_segments * L * self._width
            for _ in range(ring):
                self._slots.append(
                    _Slot(
                        index_host=torch.empty((2, max_rows), dtype=torch.int64, pin_memory=True),
                        counts_host=torch.empty(cells, dtype=self.narrow, pin_memory=True),
                        index_event=torch.cuda.Event(),
                        counts_event=torch.cuda.Event(),
                    )
                )
            self._dev_idx = torch.empty((2, max_rows), dtype=torch.int64, device=self.device)
        self.fallbacks = 0
        """Steps with more segments than the staging holds: read with a blocking copy."""

    @property
    def nbytes(self) -> int:
        """Pinned host memory held (the device's tables are allocated per step)."""
        return sum(
            int(s.index_host.numel()) * 8
            + int(s.counts_host.numel()) * int(s.counts_host.element_size())
            for s in self._slots
        )

    def count(self, buffer: Any, plan: StepPlan) -> PendingCounts:
        """Queue the counting of `plan`'s segments from `buffer` (int32 [rows, L, k] on
        the device); returns at once."""
        torch = self._torch
        g = self.geometry
        S, m = plan.n_segments, int(plan.row_idx.shape[0])
        shape = (S, g.num_moe_layers, self._width)
        if m == 0:
            return PendingCounts(S, shape, host=np.zeros(shape, dtype=np.uint32))
        if not self.cuda:
            # The CPU is the host: numpy's bincount over the buffer's memory, no copy.
            return PendingCounts(S, shape, host=segment_counts(plan, buffer.numpy(), g))
        slot = self._take_slot() if self.cuda and self.max_segments >= S else None
        if slot is not None:
            host_idx = slot.index_host
            view = host_idx.numpy()
            view[0, :m] = plan.row_idx
            view[1, :m] = plan.seg_idx
            self._dev_idx[:, :m].copy_(host_idx[:, :m], non_blocking=True)
            slot.index_event.record()
            rows, segs = self._dev_idx[0, :m], self._dev_idx[1, :m]
        else:
            rows = torch.from_numpy(plan.row_idx).to(self.device)
            segs = torch.from_numpy(plan.seg_idx).to(self.device)
        ids = buffer[rows].to(torch.int64)  # [m, L, k]
        ids = ids.masked_fill((ids < 0) | (ids >= g.num_experts), g.num_experts)
        flat = (segs.view(m, 1, 1) * g.num_moe_layers + self._layer) * self._width + ids
        cells = S * g.num_moe_layers * self._width
        narrow = torch.bincount(flat.reshape(-1), minlength=cells).to(self.narrow)
        if slot is None:
            self.fallbacks += 1
            return PendingCounts(S, shape, host=narrow.cpu().numpy())
        slot.counts_host[: narrow.numel()].copy_(narrow, non_blocking=True)
        slot.counts_event.record()
        return PendingCounts(S, shape, slot=slot)

    def _take_slot(self) -> _Slot | None:
        """The next free staging slot; None when every one still holds counts nobody
        read (the caller then copies this step's counts with a blocking copy)."""
        for _ in range(len(self._slots)):
            slot = self._slots[self._next]
            self._next = (self._next + 1) % len(self._slots)
            if not slot.busy:
                # Its index copy of an earlier step must be done before it is rewritten.
                slot.index_event.synchronize()
                slot.busy = True
                return slot
        return None
