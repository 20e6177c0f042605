"""Which hidden layers of a model are MoE layers, from its Hugging Face configuration.

ELDR counts experts per *MoE layer*: a signature is [MoE layers, experts]. Engines index
routing by *layer id* instead (vLLM's routed-experts buffer has one column per hidden
layer, and leaves the dense layers' columns untouched), so a model whose dense and MoE
layers interleave (Llama-4-Maverick: MoE on the odd layers; DeepSeek-V3: the first three
layers dense) needs the map from layer id to MoE layer index. The rules below are the
families' own configuration fields; a configuration that names its MoE layers explicitly
(`moe_layers`) wins, and an unknown family gives None (the caller must be told the list).

Pure: a mapping in, a list out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

ALL_LAYERS_MOE = frozenset(
    {"mixtral", "gpt_oss", "olmoe", "phimoe", "granitemoe", "jamba_moe", "dbrx"}
)
"""Families whose every decoder layer is an MoE layer."""


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part of a (possibly multimodal) configuration."""
    inner = config.get("text_config")
    return inner if isinstance(inner, Mapping) else config


EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
"""Where families (and transformers versions) keep the number of routed experts."""


def num_routed_experts(config: Mapping[str, Any]) -> int | None:
    """Routed experts per MoE layer, if the configuration says (under any of its names)."""
    c = text_config(config)
    for key in EXPERT_COUNT_KEYS:
        value = c.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def moe_layer_ids(config: Mapping[str, Any]) -> list[int] | None:
    """Ids of the hidden layers that are MoE layers, ascending; None when the family's rule
    is not known here (give the list explicitly then)."""
    c = text_config(config)
    n_layers = c.get("num_hidden_layers")
    if not isinstance(n_layers, int) or n_layers < 1:
        return None
    explicit = c.get("moe_layers")
    if isinstance(explicit, Sequence) and not isinstance(explicit, str):
        ids = sorted({int(i) for i in explicit})
        if ids and (ids[0] < 0 or ids[-1] >= n_layers):
            raise ValueError(f"moe_layers {ids} outside the model's {n_layers} layers")
        return ids
    model_type = str(c.get("model_type", ""))
    if model_type in ("qwen2_moe", "qwen3_moe", "qwen3_next"):
        step = int(c.get("decoder_sparse_step", 1) or 1)
        dense = {int(i) for i in c.get("mlp_only_layers", []) or []}
        if any(key in c for key in EXPERT_COUNT_KEYS) and num_routed_experts(c) is None:
            return []  # the expert count is given, and it is 0: a dense model
        return [i for i in range(n_layers) if i not in dense and (i + 1) % step == 0]
    if model_type.startswith("llama4"):
        step = int(c.get("interleave_moe_layer_step", 1) or 1)
        return list(range(step - 1, n_layers, step))
    if model_type in ("deepseek_v2", "deepseek_v3", "kimi_k2", "glm4_moe"):
        if any(key in c for key in EXPERT_COUNT_KEYS) and num_routed_experts(c) is None:
            return []
        first = int(c.get("first_k_dense_replace", 0) or 0)
        freq = int(c.get("moe_layer_freq", 1) or 1)
        return [i for i in range(first, n_layers) if i % freq == 0]
    if model_type in ALL_LAYERS_MOE:
        return list(range(n_layers))
    return None


def parse_layer_ids(spec: str) -> list[int]:
    """`"1,3,5"` or ranges `"1-47:2"` (start-stop inclusive, step) -> ascending ids."""
    ids: set[int] = set()
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        span, _, step_text = part.partition(":")
        lo_text, dash, hi_text = span.partition("-")
        try:
            lo = int(lo_text)
            hi = int(hi_text) if dash else lo
            step = int(step_text) if step_text else 1
        except ValueError as exc:
            raise ValueError(f"layer ids: {part!r} is not N, N-M or N-M:S") from exc
        if lo < 0 or hi < lo or step < 1:
            raise ValueError(f"layer ids: {part!r} is not an ascending range of ids >= 0")
        ids.update(range(lo, hi + 1, step))
    if not ids:
        raise ValueError("layer ids: none given")
    return sorted(ids)
