"""`eldr.vllm.sources`: vLLM's built-in routed-experts output as a signature source.

The responses here are fakes shaped like vLLM's (`routed_experts` = base64 `.npy`
[tokens - 1, layers, top_k] on the choice, `prompt_token_ids` with `return_token_ids`);
the real output needs Model Runner V2 (GPU builds) and is untested on real hardware here.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from eldr.core.blocks import summarize_blocks
from eldr.vllm.capture import CaptureConfig, Geometry
from eldr.vllm.sources import ResponseSource, SourceError, decode_routed_experts, routing_of

L, E, K, BS = 2, 8, 2, 4


def npy_b64(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return base64.b64encode(buffer.getvalue()).decode()


def fake_response(n_prompt: int, *, chat: bool = False, seed: int = 0) -> tuple[dict, np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 500, size=n_prompt).tolist()
    routed = np.stack([rng.permutation(E)[:K] for _ in range(n_prompt * L)]).reshape(n_prompt, L, K)
    # One generated token: vLLM returns rows for tokens - 1 = the prompt.
    choice = {"index": 0, "text": "x", "routed_experts": npy_b64(routed.astype(np.uint8))}
    if chat:
        return {"choices": [choice], "prompt_token_ids": tokens}, routed
    return {"choices": [{**choice, "prompt_token_ids": tokens}]}, routed


def source() -> ResponseSource:
    return ResponseSource(CaptureConfig("prefill-0", "m", BS, Geometry(L, E, K)))


@pytest.mark.parametrize("chat", [False, True])
def test_a_response_yields_the_blocks_and_event_of_the_capture_plugin(chat: bool) -> None:
    response, routed = fake_response(10, chat=chat)
    result = source().from_response(response, "r1", 5.0, 100.0, reply_to="inbox", max_tokens=3)
    tokens, _ = routing_of(response)
    full, partial = summarize_blocks(np.asarray(tokens), routed, BS, E)
    assert [b.block_hash for b in result.batches[0].blocks] == [b.block_hash for b in full]
    (done,) = result.done
    assert (done.request_id, done.reply_to, done.max_tokens) == ("r1", "inbox", 3)
    assert done.cached_prefix_blocks == 0
    assert partial is not None
    assert done.partial is not None
    np.testing.assert_array_equal(done.partial.to_dense(np.uint16), partial.counts)


def test_rows_skipped_by_prompt_start_come_from_the_cache() -> None:
    response, _ = fake_response(10)
    choice = response["choices"][0]
    rows = decode_routed_experts(choice["routed_experts"])
    choice["routed_experts"] = npy_b64(rows[4:])
    (done,) = source().from_response(response, "r", 1.0, 1.0, prompt_start=4).done
    assert done.cached_prefix_blocks == 1


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda r: r["choices"][0].pop("routed_experts"), "no routed_experts"),
        (lambda r: r["choices"][0].pop("prompt_token_ids"), "no prompt_token_ids"),
        (lambda r: r["choices"][0].update(routed_experts="!!"), "base64"),
        (lambda r: r.update(choices=[]), "no choice"),
    ],
)
def test_unusable_responses_are_refused(mutate: object, match: str) -> None:
    response, _ = fake_response(6)
    mutate(response)  # type: ignore[operator]
    with pytest.raises(SourceError, match=match):
        source().from_response(response, "r", 1.0, 1.0)


def test_rows_of_another_geometry_are_refused() -> None:
    response, routed = fake_response(6)
    response["choices"][0]["routed_experts"] = npy_b64(routed[:, :1])
    with pytest.raises(SourceError, match="the model is"):
        source().from_response(response, "r", 1.0, 1.0)


def test_pickled_arrays_are_not_loaded() -> None:
    buffer = io.BytesIO()
    np.save(buffer, np.array([object()], dtype=object), allow_pickle=True)
    with pytest.raises(SourceError):
        decode_routed_experts(base64.b64encode(buffer.getvalue()).decode())
