"""A tiny random-weight Qwen3-MoE checkpoint with a locally trained tokenizer.

For tests and the runnable example: no download, a few MB, built in seconds. The model is
a real `Qwen3MoeForCausalLM` (transformers) saved with safetensors in float32, so vLLM
serves it with its own Qwen3-MoE implementation and the same weights can be run through
transformers to check what vLLM routed. The tokenizer is a byte-level BPE trained with the
`tokenizers` library on a small deterministic corpus, so any text encodes; it carries a
chat template so `/v1/chat/completions` works.

Router weights are drawn wider than the default initialisation (`gate_std`), so the gaps
between a token's top experts are far above float32 rounding and two implementations of
the same forward pass pick the same experts.

    python -m eldr.vllm.tinymodel OUT_DIR      # needs torch, transformers, tokenizers

torch, transformers and tokenizers are imported when called (they are not dependencies of
the main environment).
"""

from __future__ import annotations

import argparse
import importlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN, "<|system|>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_WORD_TEXT = (
    "expert router prefill decode block cache token layer signature worker request "
    "partition centroid locality balance latency batch memory bandwidth stream weight "
    "the a of to and in is that for on with as by at from it this be are was or an not "
    "mixture model serving prompt answer question code math legal medical language "
    "alpha beta gamma delta zero one two three four five six seven eight nine ten"
)
_WORDS = tuple(_WORD_TEXT.split(" "))


@dataclass(frozen=True)
class TinyMoeSpec:
    """Shape of the tiny model. Every layer is an MoE layer (Qwen3-MoE, sparse step 1)."""

    num_layers: int = 4
    hidden_size: int = 128
    num_heads: int = 2
    """Head dimension is hidden_size / num_heads (64: a size vLLM's CPU attention has)."""
    num_kv_heads: int = 2
    intermediate_size: int = 256
    moe_intermediate_size: int = 64
    num_experts: int = 16
    top_k: int = 2
    vocab_size: int = 512
    max_position_embeddings: int = 4096
    gate_std: float = 0.5
    """Standard deviation of the router weights (see the module docstring)."""


def _module(name: str) -> Any:
    # Through importlib, so that this module imports (and type-checks) without torch.
    return importlib.import_module(name)


def corpus(lines: int = 2000, seed: int = 0) -> list[str]:
    """Deterministic training text for the tokenizer."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(lines):
        n = int(rng.integers(4, 16))
        words = [_WORDS[int(i)] for i in rng.integers(0, len(_WORDS), size=n)]
        out.append(" ".join(words) + rng.choice([".", "?", "!", ",", ":"]))
    return out


def train_tokenizer(out_dir: Path, vocab_size: int, seed: int = 0) -> int:
    """Train a byte-level BPE tokenizer into `out_dir`; returns the EOS token id."""
    tokenizers = _module("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(seed=seed), trainer=trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    eos_id = int(tok.token_to_id(EOS_TOKEN))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "bos_token": None,
        "unk_token": None,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return eos_id


def build_tiny_moe(out_dir: Path, spec: TinyMoeSpec | None = None, seed: int = 0) -> Path:
    """Write the tokenizer and a random-weight Qwen3-MoE (float32) into `out_dir`."""
    spec = spec or TinyMoeSpec()
    torch = _module("torch")
    transformers = _module("transformers")
    out_dir.mkdir(parents=True, exist_ok=True)
    eos_id = train_tokenizer(out_dir, spec.vocab_size, seed)
    config = transformers.Qwen3MoeConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        moe_intermediate_size=spec.moe_intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.top_k,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=False,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        bos_token_id=None,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, spec.gate_std)
    model.eval()
    model.save_pretrained(str(out_dir), safe_serialization=True)
    (out_dir / "eldr_tiny_moe.json").write_text(json.dumps(asdict(spec) | {"seed": seed}))
    return out_dir


class TransformersRouting:
    """The reference: a transformers forward pass of the checkpoint with a hook on every
    layer's router, recording the expert ids each token routes to."""

    def __init__(self, model_dir: Path) -> None:
        self._torch = _module("torch")
        transformers = _module("transformers")
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=self._torch.float32
        )
        self.model.eval()

    def expert_ids(self, token_ids: list[int]) -> np.ndarray:
        """int16 [tokens, moe_layers, top_k], each row sorted ascending (the order of a
        token's top-k is not part of routing)."""
        return self.forward(token_ids)[0]

    def forward(self, token_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(expert ids as `expert_ids` returns them, int64 [tokens]: the greedy next token
        after each position)."""
        torch = self._torch
        captured: dict[int, Any] = {}
        hooks = []
        for index, layer in enumerate(self.model.model.layers):

            def hook(_module: Any, _inputs: Any, output: Any, index: int = index) -> None:
                captured[index] = output[2].detach().clone()  # (logits, scores, indices)

            hooks.append(layer.mlp.gate.register_forward_hook(hook))
        try:
            with torch.no_grad():
                out = self.model(torch.tensor([token_ids], dtype=torch.long))
        finally:
            for handle in hooks:
                handle.remove()
        per_layer = [captured[i].reshape(len(token_ids), -1).numpy() for i in sorted(captured)]
        greedy = out.logits[0].argmax(dim=-1).numpy().astype(np.int64)
        return np.sort(np.stack(per_layer, axis=1), axis=2).astype(np.int16), greedy


def transformers_expert_ids(model_dir: Path, token_ids: list[int]) -> np.ndarray:
    """`TransformersRouting(model_dir).expert_ids(token_ids)` (loads the model each call)."""
    return TransformersRouting(model_dir).expert_ids(token_ids)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    build_tiny_moe(args.out_dir, seed=args.seed)
    print(args.out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
