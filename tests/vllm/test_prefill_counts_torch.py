"""`eldr.vllm.prefill_counts` with torch on the CPU (no vLLM engine): the device counting
of each step's prompt rows per (request, block) segment equals the host's
(`eldr.vllm.capture.segment_counts`), invalid ids included, and a capture fed by it gives
the same events as one fed with the rows. The CUDA branch (pinned staging, events, no
sync) runs in scripts/gpu-check on a GPU machine."""

from __future__ import annotations

import numpy as np
import pytest
from vllm_support import SKIP_REASON

from eldr.core.workload.trace import ModelGeometry
from eldr.vllm.capture import CaptureConfig, CaptureState, segment_counts

torch = pytest.importorskip("torch", reason=SKIP_REASON)

G = ModelGeometry.of_moe(num_moe_layers=3, num_experts=8, top_k=2)
BS = 4


def rows(n: int, rng: np.random.Generator) -> np.ndarray:
    out = np.empty((n, G.num_moe_layers, G.top_k), dtype=np.int32)
    for i in range(n):
        for layer in range(G.num_moe_layers):
            out[i, layer] = rng.choice(G.num_experts, size=G.top_k, replace=False)
    return out


def state() -> CaptureState:
    return CaptureState(CaptureConfig("p0", "m", BS, G, local_summary_bytes=0))


def test_device_counts_equal_host_counts_and_give_the_same_events() -> None:
    from eldr.vllm.prefill_counts import SegmentCounter

    rng = np.random.default_rng(3)
    counter = SegmentCounter(G, max_rows=64, max_segments=32, block_size=BS, device="cpu")
    by_rows, by_device = state(), state()
    prompts = {"a": 11, "b": 6}
    for s in (by_rows, by_device):
        for r, n in prompts.items():
            s.add_request(r, list(range(100 * len(r), 100 * len(r) + n)), 0, 0.0, request_id=r)
    steps = [({"a": 5, "b": 6}, {"a": 0, "b": 0}), ({"a": 6}, {"a": 5})]
    events: dict[str, list] = {"rows": [], "device": []}
    for plan_rows, computed in steps:
        ids = list(plan_rows)
        n = [plan_rows[r] for r in ids]
        c = [computed[r] for r in ids]
        step = rows(sum(n), rng)
        step[1, 2, 0] = -1  # a layer that did not write one row
        positions = np.concatenate([np.arange(ci, ci + ni) for ci, ni in zip(c, n, strict=True)])
        plan = by_device.plan(ids, n, c)
        counts = counter.count(torch.from_numpy(step), plan).result()
        np.testing.assert_array_equal(counts, segment_counts(plan, step, G))
        assert counts[:, :, G.num_experts].sum() == 1  # the unwritten one, seen
        step[1, 2, 0] = step[1, 2, 1] ^ 1  # make it valid for the fold comparison
        counts = counter.count(torch.from_numpy(step), plan).result()
        events["device"] += by_device.fold(plan, counts, 1.0, 1.0).done
        events["rows"] += by_rows.on_step(ids, n, positions, step, 1.0, 1.0).done
    assert [e.request_id for e in events["device"]] == ["b", "a"]
    assert events["device"] == events["rows"]
