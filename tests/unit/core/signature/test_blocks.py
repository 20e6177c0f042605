"""Block hashes, per-block expert summaries, sparse encoding, stand-in token ids."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eldr.core.signature.blocks import (
    BLOCK_HASH_PERSON,
    DEFAULT_BLOCK_SIZE,
    BlockSummary,
    block_hash,
    block_top_k,
    hash_chain,
    hash_key_from_secret,
    stand_in_token_ids,
    sum_summaries,
    summarize_blocks,
    trace_token_ids,
)
from eldr.core.signature.sparse import SparseRow
from eldr.core.workload.trace import RequestTrace, expert_counts

# block_hash(None, 0..15) and the next block 16..31 chained to it. These constants pin the
# cache key format: changing them invalidates every stored block summary.
GOLDEN_FIRST = 0xECF96AB5F4EBC377
GOLDEN_SECOND = 0x8FD98BD36A7122CE

token_lists = st.lists(st.integers(min_value=0, max_value=2**32 - 1), min_size=0, max_size=80)


@st.composite
def prefills(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, int, int]:
    """(token_ids, prefill_ids [T, L, k] with distinct experts per token, block_size, E)."""
    n_tokens = draw(st.integers(0, 70))
    n_layers = draw(st.integers(1, 4))
    n_experts = draw(st.integers(1, 12))
    top_k = draw(st.integers(1, min(3, n_experts)))
    block_size = draw(st.integers(1, 20))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    ids = np.empty((n_tokens, n_layers, top_k), dtype=np.int16)
    for t in range(n_tokens):
        for layer in range(n_layers):
            ids[t, layer] = rng.choice(n_experts, size=top_k, replace=False)
    tokens = rng.integers(0, 50_000, size=n_tokens).astype(np.uint32)
    return tokens, ids, block_size, n_experts


def test_default_block_size_is_16() -> None:
    assert DEFAULT_BLOCK_SIZE == 16


def test_block_hash_golden_constant() -> None:
    first = block_hash(None, np.arange(16))
    assert first == GOLDEN_FIRST
    assert block_hash(first, np.arange(16, 32)) == GOLDEN_SECOND


def test_block_hash_matches_documented_encoding() -> None:
    tokens = np.arange(16, 32, dtype="<u4")
    h = hashlib.blake2b(digest_size=8, person=BLOCK_HASH_PERSON)
    h.update(b"\x01" + GOLDEN_FIRST.to_bytes(8, "little") + tokens.tobytes())
    assert block_hash(GOLDEN_FIRST, tokens) == int.from_bytes(h.digest(), "little")


def test_block_hash_same_in_fresh_process_with_other_hash_seed() -> None:
    code = (
        "import numpy as np\n"
        "from eldr.core.signature.blocks import block_hash\n"
        "h = block_hash(None, np.arange(16))\n"
        "print(h, block_hash(h, list(range(16, 32))))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "4242"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == [str(GOLDEN_FIRST), str(GOLDEN_SECOND)]


def test_block_hash_is_unsigned_64_bit() -> None:
    h = block_hash(None, [1, 2, 3])
    assert 0 <= h < 2**64


def test_block_hash_same_for_list_and_any_integer_dtype() -> None:
    tokens = [5, 70_000, 3]
    assert block_hash(None, tokens) == block_hash(None, np.array(tokens, dtype=np.int64))


def test_no_parent_differs_from_parent_zero() -> None:
    assert block_hash(None, [1, 2]) != block_hash(0, [1, 2])


@given(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), token_lists)
def test_block_hash_depends_on_parent(p1: int, p2: int, tokens: list[int]) -> None:
    if p1 != p2:
        assert block_hash(p1, tokens) != block_hash(p2, tokens)


@given(token_lists.filter(len), st.data())
def test_block_hash_changes_when_any_token_changes(tokens: list[int], data: st.DataObject) -> None:
    pos = data.draw(st.integers(0, len(tokens) - 1))
    new = data.draw(st.integers(0, 2**32 - 1).filter(lambda v: v != tokens[pos]))
    changed = [*tokens[:pos], new, *tokens[pos + 1 :]]
    assert block_hash(None, changed) != block_hash(None, tokens)


@given(
    st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=64),
    st.integers(1, 8),
    st.data(),
)
def test_hash_chain_changes_from_changed_block_on(
    tokens: list[int], block_size: int, data: st.DataObject
) -> None:
    pos = data.draw(st.integers(0, len(tokens) - 1))
    new = data.draw(st.integers(0, 2**32 - 1).filter(lambda v: v != tokens[pos]))
    changed = [*tokens[:pos], new, *tokens[pos + 1 :]]
    before, after = hash_chain(tokens, block_size), hash_chain(changed, block_size)
    changed_block = pos // block_size
    assert before[:changed_block] == after[:changed_block]
    # Every full block from the changed one on gets a new hash (the chain propagates it).
    for b in range(changed_block, len(before)):
        assert before[b] != after[b]


@given(token_lists, st.integers(1, 20))
def test_hash_chain_hashes_only_full_blocks(tokens: list[int], block_size: int) -> None:
    assert len(hash_chain(tokens, block_size)) == len(tokens) // block_size


def test_hash_chain_parent_continues_chain() -> None:
    tokens = np.arange(48)
    chain = hash_chain(tokens, 16)
    assert hash_chain(tokens[16:], 16, parent=chain[0]) == chain[1:]


@pytest.mark.parametrize("block_size", [0, -1])
def test_hash_chain_rejects_non_positive_block_size(block_size: int) -> None:
    with pytest.raises(ValueError, match="block_size must be positive"):
        hash_chain([1, 2, 3], block_size)


def test_block_hash_rejects_token_out_of_range() -> None:
    with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
        block_hash(None, [-1])


def test_block_hash_rejects_parent_out_of_range() -> None:
    with pytest.raises(ValueError, match="parent hash"):
        block_hash(2**64, [1])


@given(prefills())
@settings(max_examples=60)
def test_summaries_sum_to_request_counts(case: tuple[np.ndarray, np.ndarray, int, int]) -> None:
    tokens, ids, block_size, n_experts = case
    full, partial = summarize_blocks(tokens, ids, block_size, n_experts)
    blocks = [*full, *([partial] if partial else [])]
    total = sum_summaries(blocks, shape=(ids.shape[1], n_experts))
    assert np.array_equal(total, expert_counts(ids, n_experts))


@given(prefills())
@settings(max_examples=60)
def test_partial_block_never_has_a_hash(case: tuple[np.ndarray, np.ndarray, int, int]) -> None:
    tokens, ids, block_size, n_experts = case
    full, partial = summarize_blocks(tokens, ids, block_size, n_experts)
    assert len(full) == len(tokens) // block_size
    assert all(b.block_hash is not None and b.n_tokens == block_size for b in full)
    if len(tokens) % block_size:
        assert partial is not None
        assert partial.block_hash is None
        assert not partial.is_full
        assert partial.n_tokens == len(tokens) % block_size
    else:
        assert partial is None


@given(prefills())
@settings(max_examples=40)
def test_summary_hashes_follow_the_chain(case: tuple[np.ndarray, np.ndarray, int, int]) -> None:
    tokens, ids, block_size, n_experts = case
    full, partial = summarize_blocks(tokens, ids, block_size, n_experts)
    assert [b.block_hash for b in full] == hash_chain(tokens, block_size)
    parents = [None, *[b.block_hash for b in full]]
    assert [b.parent_hash for b in full] == parents[: len(full)]
    assert [b.index for b in full] == list(range(len(full)))
    if partial is not None:
        assert partial.parent_hash == parents[len(full)]
        assert partial.index == len(full)


def test_summary_counts_are_uint16_layers_by_experts() -> None:
    ids = np.zeros((16, 3, 1), dtype=np.int16)
    full, _ = summarize_blocks(np.arange(16), ids, 16, 5)
    assert full[0].counts.dtype == np.uint16
    assert full[0].counts.shape == (3, 5)
    assert full[0].counts[:, 0].tolist() == [16, 16, 16]


def test_summarize_rejects_length_mismatch() -> None:
    with pytest.raises(ValueError, match="token_ids has 3 tokens but prefill_ids has 4"):
        summarize_blocks(np.arange(3), np.zeros((4, 1, 1), dtype=np.int16), 2, 2)


def test_summarize_rejects_out_of_range_expert() -> None:
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        summarize_blocks(np.arange(2), np.full((2, 1, 1), 2, dtype=np.int16), 2, 2)


def test_summarize_rejects_non_positive_block_size() -> None:
    with pytest.raises(ValueError, match="block_size must be positive"):
        summarize_blocks(np.arange(2), np.zeros((2, 1, 1), dtype=np.int16), 0, 2)


def test_summarize_empty_prompt() -> None:
    full, partial = summarize_blocks(np.arange(0), np.zeros((0, 2, 1), dtype=np.int16), 16, 4)
    assert full == []
    assert partial is None


def test_sum_summaries_of_nothing_needs_shape() -> None:
    with pytest.raises(ValueError, match="explicit shape"):
        sum_summaries([])
    assert sum_summaries([], shape=(2, 3)).tolist() == [[0, 0, 0], [0, 0, 0]]


def test_sum_summaries_rejects_mismatched_shapes() -> None:
    a = BlockSummary(0, 1, None, 1, np.ones((2, 3), dtype=np.uint16))
    with pytest.raises(ValueError, match="expected"):
        sum_summaries([a, np.ones((3, 3), dtype=np.uint16)])


@given(
    st.tuples(st.integers(1, 5), st.integers(1, 9)).flatmap(
        lambda shape: st.lists(
            st.integers(0, 2**16 - 1), min_size=shape[0] * shape[1], max_size=shape[0] * shape[1]
        ).map(lambda vals: np.array(vals, dtype=np.uint16).reshape(shape))
    )
)
def test_sparse_round_trip(counts: np.ndarray) -> None:
    row = SparseRow.from_dense(counts)
    assert row.idx.dtype == np.uint32
    assert row.val.dtype == np.uint16
    assert np.all(row.val > 0)
    assert np.all(np.diff(row.idx.astype(np.int64)) > 0)
    out = np.zeros(counts.size, dtype=np.uint32)
    row.add_to(out)
    assert np.array_equal(out.reshape(counts.shape), counts)


def test_sparse_rows_refuse_negative_counts() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        SparseRow.from_dense(np.array([[-1, 0]], dtype=np.int32))


def test_stand_in_token_ids_deterministic_and_in_range() -> None:
    ids = stand_in_token_ids("anatomy/100", 40, vocab_size=1000)
    assert ids.dtype == np.uint32
    assert ids.shape == (40,)
    assert int(ids.max()) < 1000
    assert np.array_equal(ids, stand_in_token_ids("anatomy/100", 40, vocab_size=1000))


def test_stand_in_token_ids_golden() -> None:
    expected = [60696, 28956, 78864, 57103, 96058, 112423, 81859, 96348]
    assert stand_in_token_ids("anatomy/100", 8).tolist() == expected


@given(st.text(max_size=20), st.integers(0, 50), st.integers(0, 50))
def test_stand_in_token_ids_prefix_consistent(request_id: str, n: int, m: int) -> None:
    short, long = sorted((n, m))
    assert np.array_equal(
        stand_in_token_ids(request_id, short), stand_in_token_ids(request_id, long)[:short]
    )


def test_stand_in_token_ids_differ_between_requests() -> None:
    assert not np.array_equal(stand_in_token_ids("a/1", 16), stand_in_token_ids("a/2", 16))


def test_trace_token_ids_prefers_real_ids() -> None:
    prefill = np.zeros((3, 1, 1), dtype=np.int16)
    decode = np.zeros((0, 1, 1), dtype=np.int16)
    real = RequestTrace("r", "x", prefill, decode, token_ids=np.array([7, 8, 9], dtype=np.uint32))
    bare = RequestTrace("r", "x", prefill, decode)
    assert trace_token_ids(real).tolist() == [7, 8, 9]
    assert np.array_equal(trace_token_ids(bare), stand_in_token_ids("r", 3))


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 3), st.integers(1, 40), st.integers(0, 2**31))
def test_every_summarised_block_is_consistent(top_k: int, n_tokens: int, seed: int) -> None:
    # What the signature service's consistency check accepts: every real block.
    rng = np.random.default_rng(seed)
    layers, experts = 3, 8
    prefill = np.stack(
        [
            np.stack([rng.choice(experts, top_k, replace=False) for _ in range(layers)])
            for _ in range(n_tokens)
        ]
    ).astype(np.int16)
    full, partial = summarize_blocks(np.arange(n_tokens), prefill, 4, experts)
    for block in [*full, *([partial] if partial is not None else [])]:
        row = SparseRow.from_dense(block.counts)
        idx, val = row.idx, row.val
        assert block_top_k(idx, val, layers, experts, block.n_tokens) == (top_k, "")


def test_block_top_k_names_what_is_wrong() -> None:
    idx, val = np.array([0, 8], dtype=np.uint32), np.array([4, 3], dtype=np.uint16)
    top_k, why = block_top_k(idx, val, 2, 8, 4)
    assert top_k is None
    assert "layer totals differ (3 to 4)" in why
    assert block_top_k(idx, np.array([5, 5], dtype=np.uint16), 2, 8, 4)[1].startswith(
        "a cell counts 5"
    )


def test_a_keyed_hash_differs_and_the_empty_key_is_the_unkeyed_hash() -> None:
    tokens = np.arange(32)
    key = hash_key_from_secret(b"deployment secret")
    assert len(key) == 32
    assert hash_chain(tokens, 16, key=b"") == hash_chain(tokens, 16)
    keyed = hash_chain(tokens, 16, key=key)
    assert keyed != hash_chain(tokens, 16)
    assert keyed != hash_chain(tokens, 16, key=hash_key_from_secret(b"another secret"))
    assert keyed == hash_chain(tokens, 16, key=hash_key_from_secret(b"deployment secret"))
    full, _ = summarize_blocks(tokens, np.zeros((32, 1, 1), np.int16), 16, 4, key=key)
    assert [b.block_hash for b in full] == keyed
    with pytest.raises(ValueError, match="at most 64 bytes"):
        block_hash(None, tokens[:16], b"k" * 65)


def test_the_block_hash_key_comes_from_a_secret_or_a_file(tmp_path: Path) -> None:
    from eldr.settings import BlockHashSettings

    assert BlockHashSettings().block_hash_key_bytes() == b""
    (tmp_path / "key").write_text("s3cret\n")
    from_file = BlockHashSettings(block_hash_key_file=tmp_path / "key")
    from_env = BlockHashSettings(block_hash_key="s3cret")
    assert from_file.block_hash_key_bytes() == from_env.block_hash_key_bytes()
    assert from_env.block_hash_key_bytes() == hash_key_from_secret(b"s3cret")
    assert "s3cret" not in repr(from_env)
