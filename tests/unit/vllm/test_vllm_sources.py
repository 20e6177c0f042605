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

from eldr.core.signature.blocks import summarize_blocks
from eldr.core.workload.trace import ModelGeometry
from eldr.vllm.capture import CaptureConfig
from eldr.vllm.moe_layers import moe_layer_ids, parse_layer_ids
from eldr.vllm.sources import (
    LayerMap,
    ResponseSource,
    SourceError,
    decode_routed_experts,
    routing_of,
)

L, E, K, BS = 2, 8, 2, 4
geometry = ModelGeometry.of_moe


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
    return ResponseSource(CaptureConfig("prefill-0", "m", BS, ModelGeometry.of_moe(L, E, K)))


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
    with pytest.raises(SourceError, match="routed_experts has 1 layers; the model has 2"):
        source().from_response(response, "r", 1.0, 1.0)


def test_pickled_arrays_are_not_loaded() -> None:
    buffer = io.BytesIO()
    np.save(buffer, np.array([object()], dtype=object), allow_pickle=True)
    with pytest.raises(SourceError):
        decode_routed_experts(base64.b64encode(buffer.getvalue()).decode())


# --- models with dense layers -----------------------------------------------------------

LLAMA4_LIKE = {
    "model_type": "llama4",
    "text_config": {
        "model_type": "llama4_text",
        "num_hidden_layers": 6,
        "interleave_moe_layer_step": 2,
        "num_local_experts": E,
        "num_experts_per_tok": K,
    },
}
"""MoE on the odd layers, as Llama-4-Maverick (48 layers, 24 MoE) interleaves them."""


def hidden_layout(moe_rows: np.ndarray, moe_ids: list[int], n_hidden: int) -> np.ndarray:
    """What vLLM returns: one column per hidden layer, the MoE rows at their layer ids and
    zeros (as its buffer is initialised) in the dense layers' columns."""
    out = np.zeros((moe_rows.shape[0], n_hidden, moe_rows.shape[2]), dtype=moe_rows.dtype)
    out[:, moe_ids] = moe_rows
    return out


@pytest.mark.parametrize("layout", ["all_hidden_layers", "moe_layers_only"])
def test_interleaved_dense_layers_are_skipped_in_either_layout(layout: str) -> None:
    ids = moe_layer_ids(LLAMA4_LIKE)
    assert ids == [1, 3, 5]
    n_moe = len(ids)
    rng = np.random.default_rng(3)
    n_prompt = 9
    moe_rows = np.stack([rng.permutation(E)[:K] for _ in range(n_prompt * n_moe)]).reshape(
        n_prompt, n_moe, K
    )
    sent = hidden_layout(moe_rows, ids, 6) if layout == "all_hidden_layers" else moe_rows
    tokens = rng.integers(0, 500, size=n_prompt).tolist()
    response = {
        "choices": [{"routed_experts": npy_b64(sent.astype(np.uint8)), "prompt_token_ids": tokens}]
    }
    src = ResponseSource(CaptureConfig("p", "m", BS, geometry(n_moe, E, K)), LayerMap.of(6, ids))
    (done,) = src.from_response(response, "r", 1.0, 1.0).done
    full, partial = summarize_blocks(np.asarray(tokens), moe_rows, BS, E)
    assert done.computed is not None
    expected = sum(b.counts.astype(np.int64) for b in full) + (
        0 if partial is None else partial.counts
    )
    np.testing.assert_array_equal(done.computed.to_dense(np.int64), expected)
    # Read as if every layer were MoE, the dense zeros would have counted as expert 0.
    assert int(expected[:, 0].sum()) < n_prompt * n_moe


def test_a_layer_axis_of_neither_width_is_refused() -> None:
    src = ResponseSource(CaptureConfig("p", "m", BS, geometry(3, E, K)), LayerMap.of(6, [1, 3, 5]))
    rows = np.zeros((5, 4, K), dtype=np.uint8)
    response = {"choices": [{"routed_experts": npy_b64(rows), "prompt_token_ids": [1] * 5}]}
    with pytest.raises(SourceError, match="6 hidden layers of which 3 are MoE"):
        src.from_response(response, "r", 1.0, 1.0)


def test_layer_maps_must_fit_the_geometry() -> None:
    with pytest.raises(ValueError, match="2 MoE layer ids for a model of 3"):
        ResponseSource(CaptureConfig("p", "m", BS, geometry(3, E, K)), LayerMap.of(6, [1, 3]))
    with pytest.raises(ValueError, match="must ascend"):
        LayerMap.of(4, [3, 1])
    with pytest.raises(ValueError, match="must ascend"):
        LayerMap.of(4, [0, 4])


@pytest.mark.parametrize(
    ("config", "ids"),
    [
        ({"model_type": "qwen3_moe", "num_hidden_layers": 4, "num_experts": 8}, [0, 1, 2, 3]),
        # transformers 5 names it num_local_experts (the tiny test model's config.json)
        ({"model_type": "qwen3_moe", "num_hidden_layers": 2, "num_local_experts": 8}, [0, 1]),
        ({"model_type": "qwen3_moe", "num_hidden_layers": 2, "num_experts": 0}, []),
        (
            {
                "model_type": "qwen3_moe",
                "num_hidden_layers": 6,
                "num_experts": 8,
                "decoder_sparse_step": 2,
                "mlp_only_layers": [5],
            },
            [1, 3],
        ),
        (
            {
                "model_type": "deepseek_v3",
                "num_hidden_layers": 61,
                "n_routed_experts": 256,
                "first_k_dense_replace": 3,
            },
            list(range(3, 61)),
        ),
        ({"model_type": "mixtral", "num_hidden_layers": 3}, [0, 1, 2]),
        ({"model_type": "anything", "num_hidden_layers": 4, "moe_layers": [2, 0]}, [0, 2]),
        ({"model_type": "unknown_family", "num_hidden_layers": 4}, None),
    ],
)
def test_moe_layer_ids_follow_each_familys_config(config: dict, ids: list[int] | None) -> None:
    assert moe_layer_ids(config) == ids


def test_layer_id_lists_parse_ranges_with_steps() -> None:
    assert parse_layer_ids("1-47:2")[:3] == [1, 3, 5]
    assert len(parse_layer_ids("1-47:2")) == 24
    assert parse_layer_ids("0, 2,4-5") == [0, 2, 4, 5]
    for bad in ("", "a", "5-1", "1-3:0", "-1"):
        with pytest.raises(ValueError, match="layer ids"):
            parse_layer_ids(bad)
