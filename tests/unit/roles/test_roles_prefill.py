"""The prefill producer's role (`eldr.roles.prefill`): the local summary store, numbered
block batches, and the PrefillDone with or without the whole signature, as the capture
plugin and the simulated prefill worker play it."""

from __future__ import annotations

import numpy as np
import pytest

from eldr.roles.prefill import (
    MAX_DECISION_BUDGET_S,
    LocalSummaries,
    LocalSummary,
    PendingBlock,
    PrefillProducer,
    deadline_of,
    unavailable_prefill_done,
)
from eldr.wire import PrefillDone, decode, encode
from eldr.wire.base import MAX_BLOCKS_PER_BATCH

L, E = 3, 8


def block(h: int, value: int = 1) -> PendingBlock:
    return PendingBlock(h, h - 1 if h > 1 else None, 4, np.full((L, E), value, np.uint16))


def producer(local: LocalSummaries | None = None) -> PrefillProducer:
    return PrefillProducer("p0", "m", 4, L, E, local)


# --- the local summary store --------------------------------------------------------------


@pytest.mark.parametrize("form", ["sparse", "dense8", "dense16"])
def test_a_local_summary_sums_exactly_in_every_form(form: str) -> None:
    rng = np.random.default_rng(1)
    counts = np.zeros((6, 40), np.uint16)
    if form == "sparse":
        counts[rng.integers(0, 6, 5), rng.integers(0, 40, 5)] = 7
    else:
        counts[:] = rng.integers(1, 250, counts.shape)
        if form == "dense16":
            counts[2, 3] = 4000
    summary = LocalSummary.of(counts)
    assert (summary.dense is None) == (form == "sparse")
    if summary.dense is not None:
        assert summary.dense.dtype == (np.uint16 if form == "dense16" else np.uint8)
    total = np.full(counts.size, 3, np.uint32)
    summary.add_to(total)
    np.testing.assert_array_equal(total, counts.reshape(-1).astype(np.uint32) + 3)


def test_the_store_is_a_byte_bounded_lru_whose_lookup_is_all_or_nothing() -> None:
    one = np.ones((L, E), np.uint16)
    size = LocalSummary.of(one).nbytes
    store = LocalSummaries(3 * size)
    for h in (1, 2, 3):
        store.put(h, one * h)
    assert store.lookup([1]) is not None  # 1 is now the most recent
    store.put(4, one)  # evicts 2, the least recently used
    assert 2 not in store
    assert all(h in store for h in (1, 3, 4))
    assert store.lookup([1, 2]) is None
    assert store.lookup([]) == []
    store.put(5, one)  # the failed lookup refreshed nothing: 3 goes
    assert 3 not in store
    assert store.bytes_used == 3 * size
    got = store.lookup([4, 1])
    assert got is not None
    assert len(got) == 2
    assert store.evictions == 2


def test_the_store_can_be_bounded_in_blocks_or_not_at_all() -> None:
    one = np.ones((L, E), np.uint16)
    store = LocalSummaries(max_blocks=2)
    for h in (1, 2, 3):
        store.put(h, one)
    assert (1 not in store, len(store), store.evictions) == (True, 2, 1)
    unbounded = LocalSummaries()
    for h in range(100):
        unbounded.put(h, one)
    assert (len(unbounded), unbounded.evictions) == (100, 0)
    with pytest.raises(ValueError, match="max_blocks"):
        LocalSummaries(max_blocks=0)


# --- block batches ------------------------------------------------------------------------


def test_batches_are_numbered_per_producer_and_fill_the_store() -> None:
    p = producer(LocalSummaries())
    blocks = [block(h) for h in range(1, MAX_BLOCKS_PER_BATCH + 3)]
    first = p.reserve(len(blocks))
    assert (first, p.reserve(1)) == (0, 2)
    batches = p.batches(first, 9.0, blocks)
    assert [(b.seq, len(b.blocks), b.ts_s) for b in batches] == [
        (0, MAX_BLOCKS_PER_BATCH, 9.0),
        (1, 2, 9.0),
    ]
    sent = batches[1].blocks[1]
    assert (sent.block_hash, sent.parent_hash, sent.n_tokens) == (blocks[-1].block_hash, 1025, 4)
    np.testing.assert_array_equal(sent.counts.to_dense(np.int32), blocks[-1].counts)
    assert (batches[0].worker_id, batches[0].model, batches[0].num_experts) == ("p0", "m", E)
    assert len(p.local or ()) == len(blocks)
    assert p.reserve(0) == 3
    assert p.batches(3, 9.0, []) == []


# --- the PrefillDone ----------------------------------------------------------------------


def done_of(p: PrefillProducer, cached: int, computed: np.ndarray | None) -> PrefillDone:
    return p.done(
        p.pending_done(
            request_id="r",
            wall_s=100.0,
            block_hashes=[1, 2, 3],
            n_prompt_tokens=14,
            cached_blocks=cached,
            computed=computed,
            partial=np.full((L, E), 2, np.uint16),
            reply_to="_INBOX.x",
            attrs={"label": "a"},
            decision_budget_s=5.0,
        )
    )


def test_a_hit_on_held_blocks_carries_the_whole_signature() -> None:
    p = producer(LocalSummaries())
    p.batches(p.reserve(2), 1.0, [block(1, 1), block(2, 3)])
    computed = np.full((L, E), 5, np.uint32)  # block 3 and the partial one
    event = done_of(p, 2, computed)
    assert (event.signature_source, event.cached_prefix_blocks) == ("event", 2)
    assert event.computed is None
    assert event.signature is not None
    np.testing.assert_array_equal(event.signature.to_dense(np.int32), np.full((L, E), 9))
    assert event.partial is not None
    assert (event.deadline_s, event.reply_to, event.attrs) == (105.0, "_INBOX.x", {"label": "a"})
    assert (p.local_hits, p.local_misses) == (1, 0)


def test_a_hit_on_a_block_not_held_sends_what_was_computed() -> None:
    p = producer(LocalSummaries())
    p.batches(p.reserve(1), 1.0, [block(1)])
    event = done_of(p, 2, np.full((L, E), 5, np.uint32))
    assert (event.signature_source, event.signature) == ("service", None)
    assert event.computed is not None
    np.testing.assert_array_equal(event.computed.to_dense(np.int32), np.full((L, E), 5))
    assert (p.local_hits, p.local_misses) == (0, 1)
    no_store = producer()
    assert done_of(no_store, 2, np.zeros((L, E), np.uint32)).signature_source == "service"
    assert (no_store.local_hits, no_store.local_misses) == (0, 1)


def test_without_a_hit_or_without_counts_nothing_is_looked_up() -> None:
    p = producer(LocalSummaries())
    assert done_of(p, 0, np.zeros((L, E), np.uint32)).signature_source == "computed"
    bare = done_of(p, 2, None)
    assert (bare.computed, bare.signature, bare.signature_source) == (None, None, "service")
    assert (p.local_hits, p.local_misses) == (0, 0)


def test_the_deadline_is_the_publish_time_plus_the_clamped_budget() -> None:
    assert deadline_of(10.0, None) is None
    assert deadline_of(10.0, -1.0) == 10.0
    assert deadline_of(10.0, 1e9) == 10.0 + MAX_DECISION_BUDGET_S


def test_the_load_only_prefill_done_carries_no_signature() -> None:
    event = unavailable_prefill_done(
        request_id="r",
        model="m",
        prefill_worker="p0",
        n_prompt_tokens=40,
        reply_to="_INBOX.x",
        max_tokens=5,
        block_size=16,
        geometry=None,
        problem="capture_off",
        wall_s=1.0,
    )
    assert (event.capture, event.block_hashes, event.computed, event.partial) == (
        "unavailable",
        [],
        None,
        None,
    )
    assert decode(encode(event), PrefillDone) == event
