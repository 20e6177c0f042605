"""Per-KV-block expert activation summaries and the block hash that keys them.

A request's prefill is cut into KV blocks of `block_size` tokens. Each block gets a summary:
how many of its tokens routed to each (MoE layer, expert). A request's signature counts are
the sum of its blocks' summaries, so a block whose tokens were served from a prefix cache
(and therefore never routed in this request) still contributes, looked up by its hash.

Only full blocks are hashed and cached; the trailing partial block is summarised but has no
hash, because its contents would change as the request grows.

The block hash is our own, not the engine's: vLLM's block hashes were seeded per process, so
the signature cache recomputes a chained 64-bit key from token ids that is identical in every
process and on every machine. It is a personalised BLAKE2b (8-byte digest) over

    tag (1 byte) | parent hash (8 bytes little-endian, only when tag is 1) | token ids (<u4 each)

with tag 0 meaning "first block, no parent" and tag 1 meaning "parent follows". The tag makes
"no parent" distinct from every parent value, including 0. Hashes are unsigned ints in
[0, 2**64).

The hash may be keyed with a deployment secret (`key`, BLAKE2b's own keyed mode, as vLLM
salts its prefix hashes): then a block hash reveals nothing about its tokens to whoever
reads the streams (no dictionary of common prompts), and only holders of the key can
compute the hash of a given prefix. Every producer of one deployment must use the same
key (`eldr.settings.BlockHashSettings`); the empty key is the unkeyed hash.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from eldr.core.workload.trace import RequestTrace, expert_counts

DEFAULT_BLOCK_SIZE = 16
"""Tokens per KV block unless the deployment says otherwise."""

BLOCK_HASH_PERSON = b"eldr.block.v1"
"""BLAKE2b personalisation for block hashes; change it (v2) only with a cache format change."""

STAND_IN_PERSON = b"eldr.standin.v1"
"""BLAKE2b personalisation for stand-in token ids (distinct from block hashes)."""

DEFAULT_STAND_IN_VOCAB = 2**17

_NO_PARENT_TAG = b"\x00"
_PARENT_TAG = b"\x01"
_U64_MAX = 2**64 - 1
_U32_MAX = 2**32 - 1
_U16_MAX = 2**16 - 1

COUNT_DTYPE = np.uint16
"""Dtype of per-block counts: a block holds at most block_size * top_k routed slots."""


def _token_bytes(token_ids: npt.ArrayLike) -> bytes:
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"token_ids must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return b""
    if arr.dtype.kind not in "iu":
        raise ValueError(f"token_ids must be integers, got dtype {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) > _U32_MAX:
        raise ValueError("token ids must lie in [0, 2**32)")
    return arr.astype("<u4", copy=False).tobytes()


MAX_HASH_KEY_BYTES = 64
"""BLAKE2b keys are at most 64 bytes."""


HASH_KEY_PERSON = b"eldr.hashkey.v1"
"""BLAKE2b personalisation deriving a block-hash key from a deployment secret."""


def hash_key_from_secret(secret: bytes) -> bytes:
    """The 32-byte block-hash key of a deployment secret (any length; empty: no key)."""
    if not secret:
        return b""
    return hashlib.blake2b(secret, digest_size=32, person=HASH_KEY_PERSON).digest()


def block_hash(parent: int | None, token_ids: npt.ArrayLike, key: bytes = b"") -> int:
    """Chained 64-bit hash of one block: identical in every process and on every machine
    that uses the same `key`.

    parent: the previous block's hash, or None for the first block of a sequence.
    token_ids: the block's token ids, each in [0, 2**32). key: the deployment's block-hash
    key (at most 64 bytes; empty: unkeyed).
    """
    if len(key) > MAX_HASH_KEY_BYTES:
        raise ValueError(f"a block-hash key has at most {MAX_HASH_KEY_BYTES} bytes")
    h = hashlib.blake2b(digest_size=8, person=BLOCK_HASH_PERSON, key=key)
    if parent is None:
        h.update(_NO_PARENT_TAG)
    else:
        if isinstance(parent, bool) or not isinstance(parent, int | np.integer):
            raise TypeError(f"parent must be an int or None, got {type(parent).__name__}")
        parent_int = int(parent)
        if not 0 <= parent_int <= _U64_MAX:
            raise ValueError(f"parent hash must lie in [0, 2**64), got {parent_int}")
        h.update(_PARENT_TAG)
        h.update(parent_int.to_bytes(8, "little"))
    h.update(_token_bytes(token_ids))
    return int.from_bytes(h.digest(), "little")


def _check_block_size(block_size: int) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int | np.integer):
        raise TypeError(f"block_size must be an int, got {type(block_size).__name__}")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")


def hash_chain(
    token_ids: npt.ArrayLike, block_size: int, parent: int | None = None, *, key: bytes = b""
) -> list[int]:
    """Hashes of the FULL blocks of a token sequence, each chained to the one before.

    A trailing partial block is never hashed. `parent` continues an existing chain (None
    starts a new sequence); `key` as for `block_hash`.
    """
    _check_block_size(block_size)
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"token_ids must be one-dimensional, got shape {arr.shape}")
    hashes: list[int] = []
    prev = parent
    for start in range(0, arr.shape[0] - block_size + 1, block_size):
        prev = block_hash(prev, arr[start : start + block_size], key)
        hashes.append(prev)
    return hashes


@dataclass(frozen=True, eq=False)
class BlockSummary:
    """Expert counts of one KV block of a request's prefill.

    index: block position in the request (0-based). block_hash: chained hash for a full
    block, None for the trailing partial block (never cached). parent_hash: hash of the
    previous full block, None for the first block. counts: uint16 [moe_layers, experts].
    """

    index: int
    block_hash: int | None
    parent_hash: int | None
    n_tokens: int
    counts: np.ndarray = field(repr=False)

    @property
    def is_full(self) -> bool:
        return self.block_hash is not None


def summarize_blocks(
    token_ids: npt.ArrayLike,
    prefill_ids: np.ndarray,
    block_size: int,
    num_experts: int,
    *,
    key: bytes = b"",
) -> tuple[list[BlockSummary], BlockSummary | None]:
    """Cut a prefill into KV blocks and count experts per block (hashes keyed with `key`).

    token_ids: [prompt_tokens] prompt token ids; prefill_ids: int [prompt_tokens, moe_layers,
    top_k] routed expert ids. Returns (full blocks in order, trailing partial block or None).
    The counts of all returned summaries add up to `expert_counts(prefill_ids, num_experts)`.
    """
    _check_block_size(block_size)
    tokens = np.asarray(token_ids)
    if tokens.ndim != 1:
        raise ValueError(f"token_ids must be one-dimensional, got shape {tokens.shape}")
    if prefill_ids.ndim != 3:
        raise ValueError(
            f"prefill_ids must be shaped [tokens, moe_layers, top_k], got {prefill_ids.shape}"
        )
    if tokens.shape[0] != prefill_ids.shape[0]:
        raise ValueError(
            f"token_ids has {tokens.shape[0]} tokens but prefill_ids has {prefill_ids.shape[0]}"
        )
    if num_experts <= 0:
        raise ValueError(f"num_experts must be positive, got {num_experts}")
    if prefill_ids.size and (int(prefill_ids.min()) < 0 or int(prefill_ids.max()) >= num_experts):
        raise ValueError(f"expert ids must lie in [0, {num_experts})")
    top_k = prefill_ids.shape[2]
    if block_size * top_k > _U16_MAX:
        raise ValueError(
            f"block_size * top_k = {block_size * top_k} does not fit uint16 block counts"
        )
    n_tokens = tokens.shape[0]
    full: list[BlockSummary] = []
    parent: int | None = None
    n_full = n_tokens // block_size
    for b in range(n_full):
        lo, hi = b * block_size, (b + 1) * block_size
        h = block_hash(parent, tokens[lo:hi], key)
        counts = expert_counts(prefill_ids[lo:hi], num_experts).astype(COUNT_DTYPE)
        full.append(BlockSummary(b, h, parent, block_size, counts))
        parent = h
    partial: BlockSummary | None = None
    rest = n_tokens - n_full * block_size
    if rest:
        # Validate the partial block's tokens the same way a hash would, for symmetry.
        _token_bytes(tokens[n_full * block_size :])
        counts = expert_counts(prefill_ids[n_full * block_size :], num_experts).astype(COUNT_DTYPE)
        partial = BlockSummary(n_full, None, parent, rest, counts)
    return full, partial


def block_top_k(
    idx: np.ndarray, val: np.ndarray, n_layers: int, n_experts: int, n_tokens: int
) -> tuple[int | None, str]:
    """The top-k a block's sparse counts imply, or (None, why no real block has them).

    Every token of a block routes to exactly top_k distinct experts in every MoE layer, so
    a real block's counts sum to n_tokens x top_k in each layer (the same total in every
    layer, a multiple of n_tokens, at most n_experts per token) and no cell exceeds
    n_tokens. idx: flat indices (l * E + e) into [n_layers, n_experts]; val: their counts.
    """
    if n_tokens < 1:
        return None, f"{n_tokens} tokens"
    if val.size and int(val.max()) > n_tokens:
        return None, f"a cell counts {int(val.max())} of a {n_tokens}-token block"
    per_layer = np.bincount(
        np.asarray(idx, dtype=np.int64) // n_experts,
        weights=np.asarray(val, dtype=np.float64),
        minlength=n_layers,
    )
    total = int(per_layer[0])
    if not bool(np.all(per_layer == total)):
        return None, (
            f"layer totals differ ({int(per_layer.min())} to {int(per_layer.max())}); every "
            "layer routes each token the same number of times"
        )
    if total == 0 or total % n_tokens:
        return None, f"layer total {total} is not a positive multiple of {n_tokens} tokens"
    top_k = total // n_tokens
    if top_k > n_experts:
        return None, f"top-{top_k} of {n_experts} experts"
    return top_k, ""


def sum_summaries(
    summaries: Iterable[BlockSummary | np.ndarray], shape: tuple[int, int] | None = None
) -> np.ndarray:
    """Sum block counts into request counts: int32 [moe_layers, experts].

    Accepts BlockSummary objects or bare count arrays. `shape` is required when the
    iterable may be empty (the result is then all zeros) and checked otherwise.
    """
    total: np.ndarray | None = None
    if shape is not None:
        total = np.zeros(shape, dtype=np.int32)
    for item in summaries:
        counts = item.counts if isinstance(item, BlockSummary) else np.asarray(item)
        if counts.ndim != 2:
            raise ValueError(f"block counts must be 2-D [moe_layers, experts], got {counts.shape}")
        if total is None:
            total = np.zeros(counts.shape, dtype=np.int32)
        elif counts.shape != total.shape:
            raise ValueError(f"block counts shaped {counts.shape}, expected {total.shape}")
        total += counts
    if total is None:
        raise ValueError("sum of no summaries needs an explicit shape")
    return total


def stand_in_token_ids(
    request_id: str, n: int, vocab_size: int = DEFAULT_STAND_IN_VOCAB
) -> np.ndarray:
    """Deterministic pseudo token ids (uint32 [n]) for traces that carry no token ids.

    Derived from a personalised BLAKE2b of the request id in counter mode, so the same
    request id always yields the same ids everywhere. These are NOT real tokens: two
    requests with different ids never share a stand-in prefix, so prefix-cache hits between
    such requests cannot occur. Values lie in [0, vocab_size) (tiny modulo bias, irrelevant
    for hashing).
    """
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}")
    if not 0 < vocab_size <= 2**32:
        raise ValueError(f"vocab_size must lie in [1, 2**32], got {vocab_size}")
    key = hashlib.blake2b(request_id.encode("utf-8"), digest_size=32, person=STAND_IN_PERSON)
    seed = key.digest()
    per_block = 16  # a 64-byte digest yields 16 uint32 values
    n_blocks = -(-n // per_block)
    chunks = [
        hashlib.blake2b(
            i.to_bytes(8, "little"), digest_size=64, key=seed, person=STAND_IN_PERSON
        ).digest()
        for i in range(n_blocks)
    ]
    raw = np.frombuffer(b"".join(chunks), dtype="<u4")[:n]
    return (raw.astype(np.uint64) % np.uint64(vocab_size)).astype(np.uint32)


def trace_token_ids(trace: RequestTrace, vocab_size: int = DEFAULT_STAND_IN_VOCAB) -> np.ndarray:
    """The trace's prompt token ids, or deterministic stand-ins when it carries none."""
    if trace.token_ids is not None:
        return np.asarray(trace.token_ids)
    return stand_in_token_ids(trace.request_id, trace.prompt_tokens, vocab_size)
