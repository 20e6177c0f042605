"""The signature replica's state: batch validation, publisher sequences, waiters, assembly."""

from __future__ import annotations

import numpy as np
import pytest

from eldr.core.limits import GeometryLimits
from eldr.core.signature.blocks import summarize_blocks
from eldr.core.workload.synthetic import SyntheticSpec, generate
from eldr.core.workload.trace import expert_counts
from eldr.signature.state import (
    BlockWaiters,
    Outcome,
    PublisherSeqs,
    RejectReason,
    SeqEvent,
    SignatureState,
)
from eldr.wire import AssembleRequest, BlockSummaryBatch, BlockSummaryMsg, SparseCounts
from eldr.wire.base import MAX_MISSING_LISTED

L, E = 3, 4


def counts(cells: dict[tuple[int, int], int], shape: tuple[int, int] = (L, E)) -> SparseCounts:
    dense = np.zeros(shape, dtype=np.uint32)
    for (layer, expert), value in cells.items():
        dense[layer, expert] = value
    return SparseCounts.from_dense(dense)


def batch(
    hashes: list[int],
    *,
    model: str = "m",
    shape: tuple[int, int] = (L, E),
    seq: int = 0,
    worker: str = "p0",
    value: int = 1,
) -> BlockSummaryBatch:
    return BlockSummaryBatch(
        worker_id=worker,
        seq=seq,
        ts_s=1.0,
        model=model,
        num_moe_layers=shape[0],
        num_experts=shape[1],
        block_size=4,
        blocks=[
            # `value` tokens, top-1, all routed to expert 0: a consistent block.
            BlockSummaryMsg(
                block_hash=h,
                parent_hash=None,
                n_tokens=min(value, 4),
                counts=counts({(layer, 0): value for layer in range(shape[0])}, shape),
            )
            for h in hashes
        ],
    )


def request(
    hashes: list[int], partial: SparseCounts | None = None, model: str = "m"
) -> AssembleRequest:
    return AssembleRequest(
        request_id="r1", model=model, block_hashes=hashes, partial=partial, wait_ms=0
    )


# --- publisher sequences -----------------------------------------------------------------


def test_seq_in_order_is_next() -> None:
    seqs = PublisherSeqs()
    assert seqs.observe("p", 0).event is SeqEvent.FIRST
    assert seqs.observe("p", 1).event is SeqEvent.NEXT


def test_seq_gap_counts_the_skipped_batches() -> None:
    seqs = PublisherSeqs()
    seqs.observe("p", 3)
    check = seqs.observe("p", 7)
    assert (check.event, check.missed) == (SeqEvent.GAP, 3)


def test_seq_repeat_is_a_duplicate_and_keeps_the_highest() -> None:
    seqs = PublisherSeqs()
    seqs.observe("p", 4)
    assert seqs.observe("p", 4).event is SeqEvent.DUPLICATE
    assert seqs.observe("p", 2).event is SeqEvent.DUPLICATE
    assert seqs.observe("p", 5).event is SeqEvent.NEXT


def test_seq_zero_after_higher_is_a_restart() -> None:
    seqs = PublisherSeqs()
    seqs.observe("p", 9)
    assert seqs.observe("p", 0).event is SeqEvent.RESTART
    assert seqs.observe("p", 1).event is SeqEvent.NEXT


def test_publishers_are_tracked_separately_and_bounded() -> None:
    seqs = PublisherSeqs(max_publishers=2)
    seqs.observe("a", 5)
    seqs.observe("b", 0)
    assert seqs.observe("a", 6).event is SeqEvent.NEXT
    seqs.observe("c", 0)  # evicts b, the least recently heard
    assert len(seqs) == 2
    assert seqs.observe("b", 1).event is SeqEvent.FIRST


# --- waiters -----------------------------------------------------------------------------


def test_waiter_is_done_when_its_last_block_arrives() -> None:
    waiters = BlockWaiters()
    waiter = waiters.register({("m", 1), ("m", 2)})
    waiters.arrived(("m", 1))
    assert not waiter.done.is_set()
    waiters.arrived(("m", 2))
    assert waiter.done.is_set()
    waiters.remove(waiter)
    assert len(waiters) == 0
    assert waiters.keys_waited == 0


def test_removed_waiter_leaves_no_index_entries() -> None:
    waiters = BlockWaiters()
    first = waiters.register({("m", 1), ("m", 2)})
    second = waiters.register({("m", 2)})
    waiters.remove(first)
    assert waiters.keys_waited == 1
    waiters.arrived(("m", 2))
    assert second.done.is_set()
    waiters.remove(second)
    assert waiters.keys_waited == 0


def test_register_hook_sees_each_waiter() -> None:
    waiters = BlockWaiters()
    seen = []
    waiters.on_register = seen.append
    waiter = waiters.register({("m", 1)})
    assert seen == [waiter]


# --- ingest ------------------------------------------------------------------------------


def test_ingest_caches_blocks_and_wakes_waiters() -> None:
    state = SignatureState(1 << 20)
    waiter = state.waiters.register({("m", 5)})
    result = state.ingest(batch([5, 6]))
    assert result.rejected is None
    assert (result.blocks, result.blocks_new) == (2, 2)
    assert ("m", 5) in state.cache
    assert waiter.done.is_set()


def test_ingest_of_a_duplicate_batch_is_harmless() -> None:
    state = SignatureState(1 << 20)
    state.ingest(batch([5, 6], seq=0))
    result = state.ingest(batch([5, 6], seq=0))
    assert result.seq.event is SeqEvent.DUPLICATE
    assert result.blocks_new == 0
    assert len(state.cache) == 2


def test_geometry_mismatch_is_rejected_and_caches_nothing() -> None:
    state = SignatureState(1 << 20)
    state.ingest(batch([1]))
    result = state.ingest(batch([2], shape=(L, E + 1), seq=1))
    assert result.rejected is RejectReason.GEOMETRY_MISMATCH
    assert ("m", 2) not in state.cache
    assert state.geometries["m"] == (L, E)


def test_other_models_may_have_other_geometries() -> None:
    state = SignatureState(1 << 20)
    state.ingest(batch([1]))
    assert state.ingest(batch([1], model="other", shape=(2, 2))).rejected is None


def test_count_above_uint16_is_rejected() -> None:
    state = SignatureState(1 << 20)
    result = state.ingest(batch([1], value=70_000))
    assert result.rejected is RejectReason.COUNT_OVERFLOW
    assert "m" not in state.geometries


def test_models_beyond_the_limit_are_rejected() -> None:
    state = SignatureState(1 << 20, max_models=1)
    state.ingest(batch([1], model="a"))
    assert state.ingest(batch([1], model="b")).rejected is RejectReason.TOO_MANY_MODELS
    assert state.ingest(batch([2], model="a", seq=2)).rejected is None


# --- assemble ----------------------------------------------------------------------------


def test_assembly_equals_the_requests_prefill_counts() -> None:
    spec = SyntheticSpec(num_moe_layers=L, num_experts=E, top_k=2, prompt_len_range=(20, 60))
    traces = generate(spec, 6, np.random.default_rng(3))
    state = SignatureState(1 << 20)
    for i, trace in enumerate(traces.traces):
        assert trace.token_ids is not None
        full, partial = summarize_blocks(trace.token_ids, trace.prefill, spec.block_size, E)
        state.ingest(
            BlockSummaryBatch(
                worker_id="p0",
                seq=i,
                ts_s=1.0,
                model="m",
                num_moe_layers=L,
                num_experts=E,
                block_size=spec.block_size,
                blocks=[
                    BlockSummaryMsg(
                        block_hash=b.block_hash or 0,
                        parent_hash=b.parent_hash,
                        n_tokens=b.n_tokens,
                        counts=SparseCounts.from_dense(b.counts),
                    )
                    for b in full
                ],
            )
        )
        result = state.assemble(
            request(
                [b.block_hash or 0 for b in full],
                SparseCounts.from_dense(partial.counts) if partial else None,
            )
        )
        assert result.outcome is Outcome.COMPLETE
        assert result.reply.counts is not None
        np.testing.assert_array_equal(
            result.reply.counts.to_numpy(), expert_counts(trace.prefill, E)
        )


def test_missing_blocks_make_a_partial_assembly() -> None:
    state = SignatureState(1 << 20)
    state.ingest(batch([1, 2]))
    result = state.assemble(request([1, 99, 2, 98]))
    assert result.outcome is Outcome.PARTIAL
    assert result.reply.missing == [99, 98]
    assert (result.reply.blocks_found, result.reply.blocks_total, result.missing) == (2, 4, 2)
    assert result.reply.counts is not None
    assert int(result.reply.counts.to_numpy().sum()) == 2 * L  # one token per layer each


def test_no_block_found_is_empty_but_keeps_the_partial() -> None:
    state = SignatureState(1 << 20)
    state.ingest(batch([1]))
    result = state.assemble(request([7], counts({(1, 1): 3})))
    assert result.outcome is Outcome.EMPTY
    assert result.reply.counts is not None
    assert int(result.reply.counts.to_numpy()[1, 1]) == 3


def test_missing_list_is_truncated_but_the_count_is_exact() -> None:
    state = SignatureState(1 << 20)
    state.ingest(batch([1]))
    hashes = list(range(1000, 1000 + MAX_MISSING_LISTED + 10))
    result = state.assemble(request(hashes))
    assert len(result.reply.missing) == MAX_MISSING_LISTED
    assert result.missing == len(hashes)
    assert result.reply.missing == hashes[:MAX_MISSING_LISTED]


def test_unknown_geometry_takes_the_partials_shape() -> None:
    state = SignatureState(1 << 20)
    result = state.assemble(request([5], counts({(2, 3): 1})))
    assert result.outcome is Outcome.EMPTY
    assert result.reply.counts is not None
    assert result.reply.counts.shape == [L, E]


def test_unknown_geometry_without_partial_is_an_error_reply() -> None:
    state = SignatureState(1 << 20)
    result = state.assemble(request([5, 6]))
    assert result.outcome is Outcome.ERROR
    assert result.reply.counts is None
    assert result.reply.blocks_found == 0
    assert result.reply.missing == [5, 6]
    assert result.reply.error is not None
    assert "unknown" in result.reply.error


def test_partial_of_another_geometry_is_an_error_reply() -> None:
    state = SignatureState(1 << 20)
    state.ingest(batch([1]))
    result = state.assemble(request([1], counts({(0, 0): 1}, shape=(L + 1, E))))
    assert result.outcome is Outcome.ERROR
    assert result.reply.counts is None
    assert result.reply.error is not None
    assert "partial" in result.reply.error


def test_missing_keys_ignores_cached_blocks() -> None:
    state = SignatureState(1 << 20)
    state.ingest(batch([1]))
    assert state.missing_keys("m", [1, 2, 2]) == {("m", 2)}
    assert (state.cache.hits, state.cache.misses) == (0, 0)


def test_invalid_limits_are_refused() -> None:
    with pytest.raises(ValueError, match="max_models"):
        SignatureState(1 << 20, max_models=0)


# --- what no real block has (issue 15, findings 3 and 7) ----------------------------------


def _one_block(
    cells: np.ndarray, n_tokens: int, shape: tuple[int, int] = (L, E)
) -> BlockSummaryBatch:
    return BlockSummaryBatch(
        worker_id="p0",
        seq=0,
        ts_s=1.0,
        model="m",
        num_moe_layers=shape[0],
        num_experts=shape[1],
        block_size=16,
        blocks=[
            BlockSummaryMsg(
                block_hash=1,
                parent_hash=None,
                n_tokens=n_tokens,
                counts=SparseCounts.from_dense(cells.astype(np.uint32)),
            )
        ],
    )


def test_an_absurd_summary_is_refused() -> None:
    # Every cell 65,535 for a 16-token block: it fits uint16, nothing else.
    state = SignatureState(1 << 20)
    result = state.ingest(_one_block(np.full((L, E), 65_535), 16))
    assert result.rejected is RejectReason.INCONSISTENT
    assert "a cell counts 65535 of a 16-token block" in result.detail
    assert len(state.cache) == 0
    assert "m" not in state.geometries  # and it fixed nothing


@pytest.mark.parametrize(
    ("case", "why"),
    [
        ("layers_differ", "layer totals differ"),
        ("not_a_multiple", "not a positive multiple"),
        ("empty", "not a positive multiple"),
    ],
)
def test_counts_no_real_block_can_have_are_refused(case: str, why: str) -> None:
    cells = np.zeros((L, E))
    cells[:, 0] = 4  # 4 tokens, top-1: consistent
    if case == "layers_differ":
        cells[1, 1] = 4
    elif case == "not_a_multiple":
        cells[:, 1] = 1
    else:
        cells[:] = 0
    result = SignatureState(1 << 20).ingest(_one_block(cells, 4))
    assert result.rejected is RejectReason.INCONSISTENT
    assert why in result.detail


def test_a_consistent_top_2_block_is_cached() -> None:
    cells = np.zeros((L, E))
    cells[:, 0] = 3
    cells[:, 1] = 2
    cells[:, 2] = 1  # 3 tokens x 2 distinct experts each, in every layer
    state = SignatureState(1 << 20)
    assert state.ingest(_one_block(cells, 3)).rejected is None
    assert ("m", 1) in state.cache


def test_a_geometry_beyond_the_configured_limits_is_refused_before_it_sticks() -> None:
    limits = GeometryLimits(max_moe_layers=8, max_experts=64, max_cells=256)
    state = SignatureState(1 << 20, limits=limits)
    big = np.zeros((16, 64))
    big[:, 0] = 1
    result = state.ingest(_one_block(big, 1, shape=(16, 64)))
    assert result.rejected is RejectReason.GEOMETRY_MISMATCH
    assert "16 MoE layers, more than the 8 configured" in result.detail
    assert "m" not in state.geometries
    assert state.ingest(batch([2])).rejected is None  # the real geometry is still free


def test_a_configured_model_geometry_wins_over_the_first_batch() -> None:
    state = SignatureState(1 << 20, limits=GeometryLimits(models={"m": (L, E)}))
    forged = np.zeros((2, 2))
    forged[:, 0] = 1
    assert state.ingest(_one_block(forged, 1, shape=(2, 2))).rejected is (
        RejectReason.GEOMETRY_MISMATCH
    )
    assert state.ingest(batch([3])).rejected is None
    assert state.geometries["m"] == (L, E)


def test_an_assembly_of_an_unknown_model_with_a_huge_partial_is_refused() -> None:
    state = SignatureState(1 << 20, limits=GeometryLimits(max_cells=1024))
    partial = counts({(0, 0): 1}, shape=(64, 1024))
    result = state.assemble(request([1], partial, model="unknown"))
    assert result.outcome is Outcome.ERROR
    assert result.reply.counts is None
    assert "cells, more than the 1024 configured" in (result.reply.error or "")
