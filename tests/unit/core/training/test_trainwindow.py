"""The trainer's training window (join by request id, bounds) and live-worker view."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eldr.core.signature.sparse import SparseRow
from eldr.core.training.trainwindow import LiveWorkers, TrainingWindow, pick_workers

SHAPE = (2, 4)


def row(*cells: tuple[int, int], shape: tuple[int, int] = SHAPE) -> SparseRow:
    dense = np.zeros(shape, dtype=np.uint16)
    for (layer, expert), count in zip(cells, range(1, len(cells) + 1), strict=True):
        dense[layer, expert] = count
    return SparseRow.from_dense(dense)


def test_sparse_row_round_trips_to_dense() -> None:
    dense = np.array([[0, 3, 0, 1], [2, 0, 0, 0]], dtype=np.uint32)
    out = np.zeros(8, dtype=np.float32)
    SparseRow.from_dense(dense).add_to(out)
    np.testing.assert_array_equal(out.reshape(SHAPE), dense)


def test_sparse_row_takes_whole_float_counts_and_refuses_fractions() -> None:
    """The bench's float32 count matrices become the same unsigned counts."""
    row_ = SparseRow.from_dense(np.array([[0.0, 3.0], [1.0, 0.0]], dtype=np.float32))
    assert (row_.idx.tolist(), row_.val.tolist(), row_.val.dtype) == ([1, 2], [3, 1], np.uint32)
    for bad in (0.5, -1.0):
        with pytest.raises(ValueError, match="whole"):
            SparseRow.from_dense(np.array([[bad, 1.0]], dtype=np.float32))


def test_sparse_row_rejects_an_index_outside_its_shape() -> None:
    with pytest.raises(ValueError, match="outside"):
        SparseRow(SHAPE, np.array([8], dtype=np.uint32), np.array([1], dtype=np.uint16))


def test_a_profile_joins_its_decision() -> None:
    w = TrainingWindow(max_samples=10, max_age_s=100)
    assert w.add_decision("r1", "m", "dw0", row((0, 1)), ts_s=1.0) == "added"
    assert w.add_summary("r1", row((1, 2)), ts_s=2.0) == "joined"
    assert (len(w), w.with_summary) == (1, 1)


def test_a_profile_before_its_decision_waits_and_joins() -> None:
    w = TrainingWindow(max_samples=10, max_age_s=100)
    assert w.add_summary("r1", row((1, 2)), ts_s=1.0) == "waiting"
    assert w.orphan_summaries == 1
    w.add_decision("r1", "m", "dw0", row((0, 1)), ts_s=1.5)
    assert (w.with_summary, w.orphan_summaries) == (1, 0)


def test_the_first_decision_for_a_request_wins() -> None:
    w = TrainingWindow(max_samples=10, max_age_s=100)
    w.add_decision("r1", "m", "dw0", row((0, 1)), ts_s=1.0)
    assert w.add_decision("r1", "m", "dw1", row((0, 2)), ts_s=2.0) == "duplicate"
    snap = w.snapshot()
    assert snap is not None
    assert snap.samples[0].worker_id == "dw0"


def test_a_second_profile_is_a_duplicate() -> None:
    w = TrainingWindow(max_samples=10, max_age_s=100)
    w.add_decision("r1", "m", "dw0", row((0, 1)), ts_s=1.0)
    w.add_summary("r1", row((1, 2)), ts_s=2.0)
    assert w.add_summary("r1", row((1, 3)), ts_s=3.0) == "duplicate"


def test_an_empty_signature_is_not_a_sample() -> None:
    w = TrainingWindow(max_samples=10, max_age_s=100)
    assert w.add_decision("r1", "m", "dw0", row(), ts_s=1.0) == "empty"
    assert len(w) == 0


def test_a_profile_of_another_geometry_is_refused() -> None:
    w = TrainingWindow(max_samples=10, max_age_s=100)
    w.add_decision("r1", "m", "dw0", row((0, 1)), ts_s=1.0)
    assert w.add_summary("r1", row((0, 1), shape=(3, 4)), ts_s=2.0) == "shape_mismatch"
    assert w.with_summary == 0


def test_the_oldest_samples_leave_when_the_window_is_full() -> None:
    w = TrainingWindow(max_samples=3, max_age_s=100)
    for i in range(5):
        w.add_decision(f"r{i}", "m", "dw0", row((0, 1)), ts_s=float(i))
    snap = w.snapshot()
    assert snap is not None
    assert [s.request_id for s in snap.samples] == ["r2", "r3", "r4"]
    assert w.stats.evicted_by_size == 2


def test_samples_and_waiting_profiles_age_out() -> None:
    w = TrainingWindow(max_samples=10, max_age_s=10)
    w.add_decision("old", "m", "dw0", row((0, 1)), ts_s=0.0)
    w.add_summary("old", row((1, 1)), ts_s=1.0)
    w.add_summary("orphan", row((1, 1)), ts_s=1.0)
    w.add_decision("new", "m", "dw0", row((0, 1)), ts_s=15.0)
    assert w.expire(now_s=20.0) == 1
    assert "old" not in w
    assert "new" in w
    assert (w.with_summary, w.orphan_summaries) == (0, 0)


def test_waiting_profiles_are_bounded() -> None:
    w = TrainingWindow(max_samples=10, max_age_s=100, max_orphans=2)
    for i in range(4):
        w.add_summary(f"r{i}", row((0, 1)), ts_s=float(i))
    assert w.orphan_summaries == 2
    assert w.stats.orphans_dropped == 2


def test_snapshot_takes_the_model_with_most_samples() -> None:
    w = TrainingWindow(max_samples=10, max_age_s=100)
    w.add_decision("a1", "a", "dw0", row((0, 1)), ts_s=1.0)
    for i in range(2):
        w.add_decision(f"b{i}", "b", "dw0", row((0, 1)), ts_s=1.0)
    snap = w.snapshot()
    assert snap is not None
    assert (snap.model, len(snap)) == ("b", 2)
    only_a = w.snapshot("a")
    assert only_a is not None
    assert len(only_a) == 1
    assert w.snapshot("c") is None


def test_snapshot_keeps_one_geometry() -> None:
    w = TrainingWindow(max_samples=10, max_age_s=100)
    w.add_decision("r1", "m", "dw0", row((0, 1), shape=(3, 4)), ts_s=1.0)
    for i in range(2):
        w.add_decision(f"s{i}", "m", "dw0", row((0, 1)), ts_s=1.0)
    snap = w.snapshot()
    assert snap is not None
    assert (snap.shape, len(snap)) == (SHAPE, 2)


def test_training_set_is_dense_with_zero_rows_for_missing_profiles() -> None:
    w = TrainingWindow(max_samples=10, max_age_s=100)
    w.add_decision("r1", "m", "dw0", row((0, 1)), ts_s=1.0)
    w.add_decision("r2", "m", "dw0", row((1, 3)), ts_s=1.0)
    w.add_summary("r2", row((1, 0)), ts_s=2.0)
    snap = w.snapshot()
    assert snap is not None
    ts = snap.training_set()
    assert ts.prefill.shape == (2, 8)
    assert ts.prefill[0, 1] == 1
    assert ts.prefill[1, 7] == 1
    assert ts.decode is not None
    np.testing.assert_array_equal(ts.decode[0], 0)
    assert ts.decode[1, 4] == 1
    assert ts.has_summary.tolist() == [False, True]


def test_training_set_without_any_profile_has_no_decode_matrix() -> None:
    w = TrainingWindow(max_samples=10, max_age_s=100)
    w.add_decision("r1", "m", "dw0", row((0, 1)), ts_s=1.0)
    snap = w.snapshot()
    assert snap is not None
    assert snap.training_set().decode is None


def test_a_snapshot_does_not_change_when_the_window_does() -> None:
    w = TrainingWindow(max_samples=10, max_age_s=100)
    w.add_decision("r1", "m", "dw0", row((0, 1)), ts_s=1.0)
    snap = w.snapshot()
    w.add_summary("r1", row((1, 1)), ts_s=2.0)
    w.add_decision("r2", "m", "dw0", row((0, 1)), ts_s=2.0)
    assert snap is not None
    assert len(snap) == 1
    assert snap.training_set().decode is None


@settings(max_examples=60, deadline=None)
@given(
    events=st.lists(
        st.tuples(st.sampled_from(["decision", "profile"]), st.integers(0, 15)), max_size=80
    ),
    max_samples=st.integers(1, 8),
)
def test_window_counts_stay_consistent(events: list[tuple[str, int]], max_samples: int) -> None:
    w = TrainingWindow(max_samples=max_samples, max_age_s=1e9)
    for t, (kind, rid) in enumerate(events):
        if kind == "decision":
            w.add_decision(f"r{rid}", "m", "dw0", row((0, 1)), ts_s=float(t))
        else:
            w.add_summary(f"r{rid}", row((1, 1)), ts_s=float(t))
        snap = w.snapshot()
        n = 0 if snap is None else len(snap)
        assert len(w) == n <= max_samples
        profiled = 0 if snap is None else sum(s.decode is not None for s in snap.samples)
        assert w.with_summary == profiled


def test_live_workers_forget_silent_and_draining_workers() -> None:
    live = LiveWorkers(ttl_s=5)
    live.on_report("dw1", 0.0)
    live.on_report("dw0", 3.0)
    live.on_report("dw2", 3.0, draining=True)
    assert live.live(now_s=4.0) == ("dw0", "dw1")
    assert live.live(now_s=6.0) == ("dw0",)


def test_an_older_report_does_not_undo_a_newer_one() -> None:
    live = LiveWorkers(ttl_s=5)
    live.on_report("dw0", 10.0, draining=True)
    live.on_report("dw0", 9.0)
    assert live.live(now_s=10.0) == ()


def test_pick_workers_defaults_to_all_live() -> None:
    assert pick_workers(["b", "a", "c"], None) == ("a", "b", "c")


def test_pick_workers_prefers_the_previous_partitions_workers() -> None:
    assert pick_workers(["a", "b", "c", "d"], 2, keep_first=["d", "b", "x"]) == ("b", "d")


def test_pick_workers_refuses_more_than_live() -> None:
    with pytest.raises(ValueError, match="only 2 live"):
        pick_workers(["a", "b"], 3)


def test_finished_requests_without_a_profile_are_counted_until_one_arrives() -> None:
    w = TrainingWindow(max_samples=10, max_age_s=100)
    w.add_decision("r1", "m", "dw0", row((0, 1)), ts_s=1.0)
    w.add_decision("r2", "m", "dw0", row((0, 2)), ts_s=1.0)
    assert w.finish("r1", ts_s=2.0) == "finished"
    assert w.finish("r1", ts_s=2.1) == "duplicate"
    assert w.finished_without_summary == 1
    w.add_summary("r1", row((1, 2)), ts_s=2.2)  # a profile published after the finish
    assert w.finished_without_summary == 0
    w.add_summary("r2", row((1, 3)), ts_s=2.3)
    assert w.finish("r2", ts_s=2.4) == "finished"
    assert w.finished_without_summary == 0


def test_a_finish_before_its_decision_waits_for_it_and_ages_out() -> None:
    w = TrainingWindow(max_samples=10, max_age_s=10)
    assert w.finish("r1", ts_s=1.0) == "waiting"
    w.add_decision("r1", "m", "dw0", row((0, 1)), ts_s=1.5)
    assert w.finished_without_summary == 1
    assert w.finish("late", ts_s=1.0) == "waiting"
    w.expire(now_s=20.0)
    assert w.finished_without_summary == 0  # r1 aged out with its flag
    w.add_decision("late", "m", "dw0", row((0, 1)), ts_s=20.0)
    assert w.finished_without_summary == 0  # the early finish aged out too


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5)), max_size=80))
@settings(max_examples=80, deadline=None)
def test_the_finished_without_profile_count_matches_the_samples(
    ops: list[tuple[int, int]],
) -> None:
    w = TrainingWindow(max_samples=4, max_age_s=1e9)
    for t, (kind, n) in enumerate(ops):
        rid = f"r{n}"
        if kind == 0:
            w.add_decision(rid, "m", "dw0", row((0, 1)), ts_s=float(t))
        elif kind == 1:
            w.add_summary(rid, row((1, 1)), ts_s=float(t))
        else:
            w.finish(rid, ts_s=float(t))
    samples = w.snapshot("m")
    held = samples.samples if samples is not None else ()
    assert w.finished_without_summary == sum(s.finished and s.decode is None for s in held)


def test_live_workers_hold_at_most_max_workers() -> None:
    live = LiveWorkers(ttl_s=5, max_workers=2)
    assert live.on_report("a", 0.0)
    assert live.on_report("b", 0.0)
    assert not live.on_report("c", 0.5)
    assert live.refused == 1
    assert live.live(0.5) == ("a", "b")
    assert live.on_report("a", 4.0)
    assert live.on_report("c", 6.0)  # b went silent: its place is free
    assert live.live(6.0) == ("a", "c")
