"""The capture plugin in a real vLLM engine: expert ids equal a transformers forward pass."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from vllm_support import BLOCK_SIZE, MODEL_NAME, SKIP_REASON, Engines, post, prefill_events

from eldr.core.signature.blocks import hash_chain
from eldr.core.workload.trace import expert_counts

pytest.importorskip("vllm.version", reason=SKIP_REASON)

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

PROMPTS = (
    "alpha beta",  # shorter than one block: only a partial block
    "expert router prefill decode block cache token layer signature worker request " * 4,
    "the model answers a question about code, math, legal and medical language. " * 6,
)


async def test_captured_expert_ids_equal_a_transformers_forward_pass(
    engines: Engines, tiny_model: object
) -> None:
    from eldr.vllm.tinymodel import TransformersRouting

    run = uuid.uuid4().hex[:8]
    ids = {f"cap-{run}-{i}": f"{run} {p}" for i, p in enumerate(PROMPTS)}
    for request_id, prompt in ids.items():
        await post(
            engines.prefill.url + "/v1/completions",
            {
                "model": MODEL_NAME,
                "prompt": prompt,
                "max_tokens": 1,
                "temperature": 0,
                "vllm_xargs": {"eldr_request_id": request_id},
            },
        )
    events = await prefill_events(engines, set(ids))
    reference = TransformersRouting(tiny_model)  # type: ignore[arg-type]
    for request_id in ids:
        dump = np.load(engines.dump_dir / f"{request_id}.npz")
        tokens = dump["token_ids"].tolist()
        assert int(dump["first_row"]) == 0  # fresh prompts: nothing came from a cache
        want = reference.expert_ids(tokens)
        np.testing.assert_array_equal(np.sort(dump["expert_ids"], axis=2), want)
        event = events[request_id]
        assert event.block_hashes == hash_chain(np.asarray(tokens), BLOCK_SIZE)
        assert event.cached_prefix_blocks == 0
        assert event.computed is not None
        np.testing.assert_array_equal(
            event.computed.to_dense(np.int32), expert_counts(want, event.num_experts)
        )
