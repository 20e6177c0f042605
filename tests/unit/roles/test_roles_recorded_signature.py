"""The signature a decision records is the request's counts, taken from the event's own
sparse form where the event holds all of it."""

from __future__ import annotations

import numpy as np

from eldr.roles.signature import recorded_signature
from eldr.wire import SparseCounts
from support.messages import prefill_done

L, E = 2, 4


event = prefill_done
"""A PrefillDone of L x E counts (`support.messages.prefill_done`)."""


def dense(*cells: tuple[int, int, int]) -> np.ndarray:
    out = np.zeros((L, E), dtype=np.uint32)
    for layer, expert, n in cells:
        out[layer, expert] = n
    return out


def test_the_events_whole_signature_is_recorded_as_it_came() -> None:
    counts = dense((0, 1, 3), (1, 2, 2))
    whole = SparseCounts.from_dense(counts)
    msg = event(signature=whole, cached_prefix_blocks=1)
    assert recorded_signature(msg, counts) is whole


def test_computed_counts_with_no_prefix_hit_are_recorded_as_they_came() -> None:
    counts = dense((0, 0, 5))
    computed = SparseCounts.from_dense(counts)
    assert recorded_signature(event(computed=computed), counts) is computed


def test_a_sum_with_the_services_blocks_is_encoded() -> None:
    computed = SparseCounts.from_dense(dense((0, 0, 1)))
    total = dense((0, 0, 1), (1, 3, 4))
    recorded = recorded_signature(event(computed=computed, cached_prefix_blocks=1), total)
    assert recorded is not None
    assert np.array_equal(recorded.to_dense(np.uint32), total)


def test_no_counts_record_no_signature() -> None:
    assert recorded_signature(event(signature=SparseCounts.from_dense(dense())), None) is None
