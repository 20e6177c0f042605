"""Minimal valid wire messages for tests, with only what a test cares about to set.

Tests of the schema itself (`tests/unit/wire/test_wire.py`, golden bytes, fuzz targets) spell
every field out on purpose and do not use these."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from eldr.core.routing.profile import JsqProfile
from eldr.wire import Decision, PrefillDone, SparseCounts


def decision(
    request_id: str = "r",
    worker_id: str = "d0",
    *,
    counts: np.ndarray | None = None,
    ts_s: float | None = None,
    **fields: Any,
) -> Decision:
    """A `Decision` sending `request_id` to `worker_id`: policy "jsq" (its profile; another
    `policy` given by name: none), no partition, no scores; `counts` (dense [L, E]) becomes
    its signature; `ts_s` defaults to now; any other field can be given by name."""
    values: dict[str, Any] = {
        "request_id": request_id,
        "ts_s": time.time() if ts_s is None else ts_s,
        "router_id": "r0",
        "model": "m",
        "worker_id": worker_id,
        "policy": "jsq",
        "profile": JsqProfile(),
        "partition_version": None,
        "fallback": None,
        "scores": [],
        "band": [],
        "loads": [],
        "signature": None if counts is None else SparseCounts.from_dense(counts),
        "missing_blocks": 0,
        "decide_s": 0.001,
    }
    if "policy" in fields:
        values["profile"] = None
    values.update(fields)
    return Decision(**values)


def prefill_done(**fields: Any) -> PrefillDone:
    """A `PrefillDone` for request "r" of model "m": two hashed blocks of 2 tokens, 5 prompt
    tokens, 2 MoE layers x 4 experts, no counts; any field can be given by name."""
    values: dict[str, Any] = {
        "request_id": "r",
        "model": "m",
        "prefill_worker": "p0",
        "ts_s": time.time(),
        "block_size": 2,
        "block_hashes": [11, 12],
        "n_prompt_tokens": 5,
        "partial": None,
        "num_moe_layers": 2,
        "num_experts": 4,
    }
    return PrefillDone(**(values | fields))
