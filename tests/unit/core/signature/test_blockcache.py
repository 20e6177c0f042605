"""The block-summary cache: LRU by bytes, exact sums, missing blocks reported in order."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eldr.core.signature.blockcache import (
    ENTRY_OVERHEAD_BYTES,
    BlockCache,
    stored_nbytes,
)
from eldr.core.signature.sparse import SparseRow

DIM = 12


def block(cells: dict[int, int], dim: int = DIM) -> SparseRow:
    idx = np.array(sorted(cells), dtype=np.uint32)
    val = np.array([cells[i] for i in sorted(cells)], dtype=np.uint16)
    return SparseRow((1, dim), idx, val)


def one_cell_size() -> int:
    return stored_nbytes(block({0: 1}))


@st.composite
def dense_blocks(draw: st.DrawFn, dim: int = DIM) -> np.ndarray:
    # Zeros, small counts (dense-friendly) and counts over 255 (sparse only) in any mix.
    cell = st.one_of(st.just(0), st.integers(1, 3), st.integers(250, 300))
    values = draw(st.lists(cell, min_size=dim, max_size=dim))
    return np.array(values, dtype=np.uint16)


def sparse(dense: np.ndarray) -> SparseRow:
    return SparseRow.from_dense(dense.reshape(1, -1))


def test_nbytes_counts_payload_and_overhead() -> None:
    b = block({1: 3, 5: 2})
    assert stored_nbytes(b) == 2 * 4 + 2 * 2 + ENTRY_OVERHEAD_BYTES


def test_dense_blocks_are_stored_in_the_smaller_dense_form() -> None:
    dense = block({i: 2 for i in range(DIM)})
    assert stored_nbytes(dense) == DIM + ENTRY_OVERHEAD_BYTES < dense.nbytes + ENTRY_OVERHEAD_BYTES
    sparse_block = block({3: 1})
    assert stored_nbytes(sparse_block) == sparse_block.nbytes + ENTRY_OVERHEAD_BYTES


def test_counts_over_255_stay_sparse() -> None:
    wide = block({i: 300 for i in range(DIM)})
    assert stored_nbytes(wide) == wide.nbytes + ENTRY_OVERHEAD_BYTES


@settings(max_examples=60, deadline=None)
@given(dense=dense_blocks())
def test_get_returns_the_block_put_in_either_form(dense: np.ndarray) -> None:
    cache = BlockCache(1 << 20)
    cache.put("m", 1, sparse(dense))
    got = cache.get("m", 1)
    assert got is not None
    assert got.dim == DIM
    restored = np.zeros(DIM, dtype=np.uint32)
    restored[got.idx] = got.val
    np.testing.assert_array_equal(restored, dense)


def test_put_reports_new_then_existing() -> None:
    cache = BlockCache(10_000)
    assert cache.put("m", 1, block({0: 1}))
    assert not cache.put("m", 1, block({0: 1}))
    assert len(cache) == 1
    assert cache.bytes_used == stored_nbytes(block({0: 1}))


def test_least_recently_used_is_evicted_first() -> None:
    cache = BlockCache(3 * one_cell_size())
    for h in (1, 2, 3):
        cache.put("m", h, block({0: 1}))
    assert cache.get("m", 1) is not None  # 2 is now the least recently used
    cache.put("m", 4, block({0: 1}))
    assert ("m", 2) not in cache
    assert all(("m", h) in cache for h in (1, 3, 4))
    assert cache.evictions == 1


def test_re_put_refreshes_recency() -> None:
    cache = BlockCache(2 * one_cell_size())
    cache.put("m", 1, block({0: 1}))
    cache.put("m", 2, block({0: 1}))
    cache.put("m", 1, block({0: 1}))  # refresh: 2 becomes the oldest
    cache.put("m", 3, block({0: 1}))
    assert ("m", 1) in cache
    assert ("m", 2) not in cache


def test_contains_does_not_touch_recency_or_counters() -> None:
    cache = BlockCache(2 * one_cell_size())
    cache.put("m", 1, block({0: 1}))
    cache.put("m", 2, block({0: 1}))
    assert ("m", 1) in cache
    assert ("m", 9) not in cache
    cache.put("m", 3, block({0: 1}))
    assert ("m", 1) not in cache
    assert (cache.hits, cache.misses) == (0, 0)


def test_block_larger_than_budget_is_not_cached() -> None:
    big = block({i: 1 for i in range(DIM)})
    cache = BlockCache(stored_nbytes(big) - 1)
    cache.put("m", 1, block({0: 1}))
    assert not cache.put("m", 2, big)
    assert ("m", 2) not in cache
    assert ("m", 1) in cache  # nothing was evicted for a block that cannot fit


def test_models_are_separate_keys() -> None:
    cache = BlockCache(10_000)
    cache.put("a", 7, block({0: 1}))
    assert cache.get("b", 7) is None
    assert cache.get("a", 7) is not None
    assert (cache.hits, cache.misses) == (1, 1)


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.integers(0, 30), st.integers(1, DIM), st.booleans()),
        min_size=1,
        max_size=120,
    ),
    budget_cells=st.integers(1, 40),
)
def test_byte_budget_is_never_exceeded(ops: list[tuple[int, int, bool]], budget_cells: int) -> None:
    budget = ENTRY_OVERHEAD_BYTES + budget_cells * 6
    cache = BlockCache(budget)
    for h, n_cells, read in ops:
        if read:
            cache.get("m", h)
        else:
            cache.put("m", h, block({i: 1 for i in range(n_cells)}))
        assert cache.bytes_used <= budget
        assert cache.bytes_used == sum(e.nbytes for e in cache._entries.values())


@settings(max_examples=60, deadline=None)
@given(blocks=st.lists(dense_blocks(), min_size=0, max_size=8), partial=dense_blocks())
def test_assemble_sums_exactly(blocks: list[np.ndarray], partial: np.ndarray) -> None:
    cache = BlockCache(1 << 20)
    for h, dense in enumerate(blocks):
        cache.put("m", h, sparse(dense))
    assembly = cache.assemble("m", list(range(len(blocks))), DIM, sparse(partial))
    expected = sum((b.astype(np.uint32) for b in blocks), start=partial.astype(np.uint32))
    assert assembly.counts.dtype == np.uint32
    np.testing.assert_array_equal(assembly.counts, expected)
    assert assembly.found == len(blocks)
    assert assembly.complete


def test_assemble_counts_a_repeated_block_each_time() -> None:
    cache = BlockCache(10_000)
    cache.put("m", 1, block({2: 3}))
    assembly = cache.assemble("m", [1, 1], DIM)
    assert int(assembly.counts[2]) == 6
    assert assembly.found == 2


def test_missing_blocks_reported_in_request_order_and_not_counted() -> None:
    cache = BlockCache(10_000)
    cache.put("m", 20, block({0: 5}))
    assembly = cache.assemble("m", [30, 20, 10, 40], DIM)
    assert assembly.missing == (30, 10, 40)
    assert assembly.found == 1
    assert not assembly.complete
    assert int(assembly.counts.sum()) == 5
    assert (cache.hits, cache.misses) == (1, 3)


def test_assemble_refreshes_found_blocks() -> None:
    cache = BlockCache(2 * one_cell_size())
    cache.put("m", 1, block({0: 1}))
    cache.put("m", 2, block({0: 1}))
    cache.assemble("m", [1], DIM)
    cache.put("m", 3, block({0: 1}))
    assert ("m", 1) in cache
    assert ("m", 2) not in cache


def test_assemble_with_only_a_partial_block() -> None:
    cache = BlockCache(10_000)
    assembly = cache.assemble("m", [], DIM, block({3: 4}))
    assert int(assembly.counts[3]) == 4
    assert assembly.complete


def test_cached_block_of_another_geometry_raises() -> None:
    cache = BlockCache(10_000)
    cache.put("m", 1, block({0: 1}, dim=8))
    with pytest.raises(ValueError, match="dimension"):
        cache.assemble("m", [1], 16)
    assert (cache.hits, cache.misses) == (0, 0)


def test_partial_block_of_another_geometry_raises() -> None:
    cache = BlockCache(10_000)
    with pytest.raises(ValueError, match="partial"):
        cache.assemble("m", [], 16, block({0: 1}, dim=8))


@pytest.mark.parametrize(
    ("idx", "val", "dim", "match"),
    [
        ([3, 1], [1, 1], 8, "ascending"),
        ([1, 1], [1, 1], 8, "ascending"),
        ([8], [1], 8, "outside"),
        ([1, 2], [1], 8, "equally long"),
        ([1], [1], 0, "positive"),
    ],
)
def test_invalid_sparse_block_is_refused(
    idx: list[int], val: list[int], dim: int, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        SparseRow((1, dim), np.array(idx, dtype=np.uint32), np.array(val, dtype=np.uint16))


def test_signed_indices_are_refused() -> None:
    with pytest.raises(ValueError, match="unsigned"):
        SparseRow((1, 8), np.array([-1, 2]), np.array([1, 1], dtype=np.uint16))


def test_non_positive_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        BlockCache(0)


# --- who wrote what (issue 15, finding 7) --------------------------------------------------


def _block(cells: dict[int, int], dim: int = 8) -> SparseRow:
    idx = np.array(sorted(cells), dtype=np.uint32)
    return SparseRow((1, dim), idx, np.array([cells[i] for i in sorted(cells)], np.uint16))


def test_a_first_writer_cannot_pre_empt_another_writers_truth() -> None:
    cache = BlockCache(1 << 20)
    poison, truth = _block({0: 16}), _block({5: 16})
    assert cache.put_from("m", 1, poison, writer="evil") == "new"
    assert cache.put_from("m", 1, truth, writer="honest") == "conflict"
    assert cache.put_from("m", 1, truth, writer="honest") == "known"
    assert (cache.conflicts, cache.own_entries) == (1, 1)
    honest = cache.assemble("m", [1], 8, writer="honest").counts
    assert honest.tolist() == [0, 0, 0, 0, 0, 16, 0, 0]
    assert cache.assemble("m", [1], 8, writer="evil").counts[0] == 16  # its own, only


def test_a_later_claim_does_not_overwrite_the_first() -> None:
    cache = BlockCache(1 << 20)
    truth, poison = _block({5: 16}), _block({0: 16})
    cache.put_from("m", 1, truth, writer="honest")
    assert cache.put_from("m", 1, poison, writer="evil") == "conflict"
    assert cache.assemble("m", [1], 8).counts[5] == 16  # everyone else keeps the truth
    assert cache.assemble("m", [1], 8, writer="other").counts[5] == 16


def test_a_trusted_writer_replaces_an_untrusted_first_summary_for_everyone() -> None:
    cache = BlockCache(1 << 20)
    poison, truth = _block({0: 16}), _block({5: 16})
    cache.put_from("m", 1, poison, writer="evil")
    assert cache.put_from("m", 1, truth, writer="pw0", trusted=True) == "trusted"
    assert cache.assemble("m", [1], 8).counts[5] == 16
    assert cache.assemble("m", [1], 8, writer="evil").counts[0] == 16
    # An untrusted writer cannot take it back.
    assert cache.put_from("m", 1, _block({2: 16}), writer="evil2") == "conflict"
    assert cache.assemble("m", [1], 8).counts[5] == 16


def test_own_summaries_count_against_the_byte_budget() -> None:
    one = stored_nbytes(_block({0: 16}))
    cache = BlockCache(3 * one)
    cache.put_from("m", 1, _block({0: 16}), writer="a")
    for i, writer in enumerate(("b", "c", "d")):
        cache.put_from("m", 1, _block({i + 1: 16}), writer=writer)
    assert cache.bytes_used <= 3 * one
    assert cache.own_entries == len(cache) - ((("m", 1)) in cache)
