"""The other source of prefill routing: vLLM's built-in routed-experts output.

vLLM builds with Model Runner V2 (GPU builds; it needs Triton) can return the experts every
token routed to (`--enable-return-routed-experts`, vLLM PR #28284): a non-streaming
completion's choice (chat: the choice, with `prompt_token_ids` on the response) carries
`routed_experts`, base64 of a `.npy` array [tokens - 1, layers, top_k], and, with
`return_token_ids: true`, the prompt's token ids. vLLM keeps the rows of prefix-cached
blocks itself, so the whole prompt is covered.

`ResponseSource` turns such a response into the same `StepResult` (block summaries +
`PrefillDone`) the capture plugin produces inside the engine, through the same
`CaptureState`: the gateway publishes it when configured with this source. On CPU this
path cannot run (no Model Runner V2 without Triton): it is tested with recorded-shape
fakes only, not on real hardware.

Layers: vLLM sizes the routed-experts buffer by *all* hidden layers and writes each MoE
layer's column at its layer id, leaving dense layers' columns at zero (which would read as
"expert 0"). `LayerMap` takes the response's layer axis in either layout, all hidden
layers (the MoE layers' columns are picked by id, dense ones skipped) or MoE layers only,
and refuses any other width.
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from eldr.vllm.capture import EXPERT_ROW_DTYPE, CaptureConfig, CaptureState, StepResult

RETURN_FIELDS: Mapping[str, Any] = {"return_token_ids": True}
"""Fields a prefill request needs so that its response can be used by `ResponseSource`."""


class SourceError(ValueError):
    """The response does not carry usable routing."""


def decode_routed_experts(encoded: str) -> np.ndarray:
    """base64 `.npy` -> int array [tokens, layers, top_k] (no pickles accepted)."""
    try:
        raw = base64.b64decode(encoded, validate=True)
        array: np.ndarray = np.load(io.BytesIO(raw), allow_pickle=False)
    except (binascii.Error, ValueError, OSError) as exc:
        raise SourceError(f"routed_experts is not a base64 .npy array: {exc}") from exc
    if array.ndim != 3 or array.dtype.kind not in "iu":
        raise SourceError(f"routed_experts has shape {array.shape} and dtype {array.dtype}")
    return array


def routing_of(response: Mapping[str, Any]) -> tuple[list[int], np.ndarray]:
    """(prompt token ids, routed experts of the prompt) from a completion or chat response."""
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise SourceError("the response has no choice")
    choice = choices[0]
    tokens = choice.get("prompt_token_ids") or response.get("prompt_token_ids")
    encoded = choice.get("routed_experts")
    if not isinstance(tokens, list) or not tokens:
        raise SourceError("the response has no prompt_token_ids (send return_token_ids)")
    if not isinstance(encoded, str):
        raise SourceError(
            "the response has no routed_experts (is the server started with "
            "--enable-return-routed-experts?)"
        )
    return [int(t) for t in tokens], decode_routed_experts(encoded)


@dataclass(frozen=True)
class LayerMap:
    """Which columns of a routed-experts array are the MoE layers, in MoE-layer order."""

    num_hidden_layers: int
    moe_layer_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        ids = self.moe_layer_ids
        if not ids:
            raise ValueError("a model with no MoE layer has no routed experts")
        if list(ids) != sorted(set(ids)) or ids[0] < 0 or ids[-1] >= self.num_hidden_layers:
            raise ValueError(
                f"MoE layer ids {list(ids)} must ascend within {self.num_hidden_layers} layers"
            )

    @classmethod
    def all_moe(cls, num_layers: int) -> LayerMap:
        return cls(num_layers, tuple(range(num_layers)))

    @classmethod
    def of(cls, num_hidden_layers: int, moe_layer_ids: Sequence[int]) -> LayerMap:
        return cls(num_hidden_layers, tuple(int(i) for i in moe_layer_ids))

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layer_ids)

    def moe_columns(self, rows: np.ndarray) -> np.ndarray:
        """rows [tokens, width, top_k] -> [tokens, MoE layers, top_k]: width is either
        every hidden layer (MoE columns picked by layer id) or the MoE layers alone."""
        width = rows.shape[1]
        if width == self.num_moe_layers:
            return rows
        if width == self.num_hidden_layers:
            return rows[:, list(self.moe_layer_ids)]
        raise SourceError(
            f"routed_experts has {width} layers; the model has {self.num_hidden_layers} "
            f"hidden layers of which {self.num_moe_layers} are MoE layers"
        )


class ResponseSource:
    """Block summaries and PrefillDone from prefill responses that carry routed experts."""

    def __init__(self, config: CaptureConfig, layers: LayerMap | None = None) -> None:
        self.state = CaptureState(config)
        self.layers = layers or LayerMap.all_moe(config.geometry.num_moe_layers)
        if self.layers.num_moe_layers != config.geometry.num_moe_layers:
            raise ValueError(
                f"{self.layers.num_moe_layers} MoE layer ids for a model of "
                f"{config.geometry.num_moe_layers} MoE layers"
            )

    def from_response(
        self,
        response: Mapping[str, Any],
        request_id: str,
        now_s: float,
        wall_s: float,
        *,
        reply_to: str | None = None,
        max_tokens: int | None = None,
        prompt_start: int = 0,
        prefill_s: float = 0.0,
        decision_budget_s: float | None = None,
        client_request_id: str | None = None,
    ) -> StepResult:
        """`prompt_start`: the request's `routed_experts_prompt_start` (rows before it
        were not returned; their blocks must come from the signature cache)."""
        tokens, routed = routing_of(response)
        g = self.state.config.geometry
        n_prompt = len(tokens)
        rows = self.layers.moe_columns(routed[: max(0, n_prompt - prompt_start)])
        if rows.shape[1:] != (g.num_moe_layers, g.top_k):
            raise SourceError(
                f"routed_experts rows are [{rows.shape[1]}, {rows.shape[2]}], the model is "
                f"[{g.num_moe_layers}, {g.top_k}]"
            )
        if rows.shape[0] != n_prompt - prompt_start:
            raise SourceError(
                f"{rows.shape[0]} routed rows for {n_prompt - prompt_start} prompt tokens"
            )
        if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= g.num_experts):
            raise SourceError(f"routed expert ids outside [0, {g.num_experts})")
        capture = self.state.add_request(
            request_id,
            tokens,
            prompt_start,
            now_s - prefill_s,
            request_id=request_id,
            reply_to=reply_to,
            max_tokens=max_tokens,
            decision_budget_s=decision_budget_s,
            client_request_id=client_request_id,
        )
        if capture is None:
            raise SourceError("nothing of the prompt was routed in this prefill")
        positions = np.arange(prompt_start, n_prompt, dtype=np.int64)
        try:
            return self.state.on_step(
                [request_id],
                [positions.shape[0]],
                positions,
                rows.astype(EXPERT_ROW_DTYPE),
                now_s,
                wall_s,
            )
        finally:
            self.state.drop(request_id)
