"""The fleet-wide load table: reports, pending assignments, staleness."""

from __future__ import annotations

import pytest

from eldr.core.routing.loadtable import LoadTable, Report


def report(
    w: str,
    seq: int,
    running: int = 0,
    waiting: int = 0,
    kv: int = 0,
    admitted: tuple[str, ...] = (),
    inc: str = "i1",
    draining: bool = False,
) -> Report:
    return Report(
        worker_id=w,
        incarnation=inc,
        seq=seq,
        running=running,
        waiting=waiting,
        kv_tokens=kv,
        admitted=admitted,
        draining=draining,
    )


def test_load_is_report_plus_pending_assignments_from_any_replica() -> None:
    t = LoadTable()
    t.on_report(report("a", 1, running=3, waiting=1, kv=300), now_s=0.0)
    t.on_assignment("a", "r1", kv_tokens=50, now_s=0.1)
    t.on_assignment("a", "r2", kv_tokens=20, now_s=0.1)
    t.on_assignment("a", "r2", kv_tokens=20, now_s=0.2)  # seen twice (own + stream): once
    in_flight, kv = t.loads(["a"])
    assert in_flight.tolist() == [6]
    assert kv.tolist() == [370]


def test_admitted_requests_stop_being_pending() -> None:
    t = LoadTable()
    t.on_report(report("a", 1), now_s=0.0)
    t.on_assignment("a", "r1", 10, now_s=0.1)
    t.on_report(report("a", 2, running=1, kv=10, admitted=("r1",)), now_s=0.2)
    assert t.loads(["a"])[0].tolist() == [1]


def test_an_assignment_seen_after_its_admission_is_not_counted_twice() -> None:
    t = LoadTable()
    t.on_report(report("a", 1, running=1, admitted=("r1",)), now_s=0.0)
    t.on_assignment("a", "r1", 10, now_s=0.1)
    assert t.loads(["a"])[0].tolist() == [1]


def test_out_of_order_reports_are_ignored() -> None:
    t = LoadTable()
    assert t.on_report(report("a", 5, running=5), now_s=0.0)
    assert not t.on_report(report("a", 4, running=1), now_s=0.1)
    assert t.loads(["a"])[0].tolist() == [5]


def test_a_restarted_worker_starts_fresh() -> None:
    t = LoadTable()
    t.on_report(report("a", 9, running=5), now_s=0.0)
    t.on_assignment("a", "r1", 10, now_s=0.0)
    assert t.on_report(report("a", 1, running=0, inc="i2"), now_s=0.1)
    assert t.loads(["a"])[0].tolist() == [0]


def test_stale_workers_leave_and_pending_expires() -> None:
    t = LoadTable(stale_after_s=1.0, pending_ttl_s=2.0)
    t.on_report(report("a", 1), now_s=0.0)
    t.on_report(report("b", 1), now_s=0.0)
    t.on_assignment("b", "r1", 10, now_s=0.0)
    t.on_report(report("b", 2), now_s=0.9)
    assert t.live_workers(0.9) == ("a", "b")
    assert t.expire(1.5) == ["a"]
    assert t.live_workers(1.5) == ("b",)
    t.on_report(report("b", 3), now_s=2.4)
    t.expire(2.5)
    assert t.loads(["b"])[0].tolist() == [0]  # r1 never admitted: expired after 2 s


def test_draining_workers_get_nothing_new() -> None:
    t = LoadTable()
    t.on_report(report("a", 1), now_s=0.0)
    t.on_report(report("b", 1, draining=True), now_s=0.0)
    assert t.live_workers(0.0) == ("a",)


def test_assignments_to_unknown_workers_are_ignored() -> None:
    t = LoadTable()
    t.on_assignment("ghost", "r1", 10, now_s=0.0)
    assert "ghost" not in t


def test_bad_settings_are_rejected() -> None:
    with pytest.raises(ValueError, match="positive"):
        LoadTable(stale_after_s=0)


def test_a_finish_retires_a_pending_assignment_and_outlives_a_late_decision() -> None:
    t = LoadTable()
    t.on_report(report("a", 1, running=2), now_s=0.0)
    t.on_assignment("a", "r1", kv_tokens=50, now_s=0.1)
    assert t.in_flight("a") == 3
    assert t.on_finished("r1", 0.2)
    assert t.in_flight("a") == 2
    assert t.was_finished("r1")
    t.on_assignment("a", "r1", kv_tokens=50, now_s=0.2)  # another replica's, seen late
    assert t.in_flight("a") == 2
    assert not t.on_finished("never-assigned", 0.2)
    assert t.in_flight("nobody") is None


def test_a_moved_request_is_pending_on_its_new_worker_with_its_kv() -> None:
    t = LoadTable()
    t.on_report(report("a", 1), now_s=0.0)
    t.on_report(report("b", 1), now_s=0.0)
    t.on_assignment("a", "r1", kv_tokens=50, now_s=0.1)
    t.on_moved("r1", "b", now_s=0.2)
    in_flight, kv = t.loads(["a", "b"])
    assert in_flight.tolist() == [0, 1]
    assert kv.tolist() == [0, 50]
    # The first worker's report admitting it later must not resurrect anything.
    t.on_report(report("a", 2, admitted=("r1",)), now_s=0.3)
    assert t.loads(["a", "b"])[0].tolist() == [0, 1]
    assert t.on_finished("r1", 0.2)
    assert t.loads(["a", "b"])[0].tolist() == [0, 0]


def test_a_restarted_worker_forgets_what_was_pending_on_its_old_process() -> None:
    t = LoadTable()
    t.on_report(report("a", 1), now_s=0.0)
    t.on_assignment("a", "r1", kv_tokens=5, now_s=0.1)
    t.on_report(report("a", 1, inc="i2"), now_s=0.2)
    assert not t.on_finished("r1", 0.2)  # not pending any more: nothing to retire


def test_finished_ids_are_remembered_for_the_pending_ttl_only() -> None:
    t = LoadTable(pending_ttl_s=10.0)
    t.on_report(report("a", 1), now_s=0.0)
    t.on_finished("r1", now_s=1.0)
    t.expire(now_s=10.5)
    assert t.was_finished("r1")
    t.on_report(report("a", 2), now_s=11.0)
    t.expire(now_s=11.5)
    assert not t.was_finished("r1")


def test_the_table_holds_at_most_max_workers() -> None:
    t = LoadTable(stale_after_s=1.0, max_workers=2)
    assert t.on_report(report("a", 1), now_s=0.0)
    assert t.on_report(report("b", 1), now_s=0.0)
    assert not t.admits("c")
    assert not t.on_report(report("c", 1), now_s=0.0)
    assert t.refused_workers == 1
    assert t.live_workers(0.0) == ("a", "b")
    assert t.on_report(report("a", 2, running=3), now_s=0.5)  # a known worker still reports
    t.on_report(report("a", 3), now_s=1.2)
    t.expire(now_s=1.6)  # b went stale: its place is free
    assert t.on_report(report("c", 1), now_s=1.6)
    assert t.live_workers(1.6) == ("a", "c")
