"""Expected faults of a clustered bus (`eldr.bus.transient`): which errors are retried,
the jittered backoff, and a log that says a fault once per interval with its count."""

from __future__ import annotations

import logging
import random

import pytest

from eldr.bus import (
    AlreadyExists,
    BusError,
    BusTimeoutError,
    DisconnectedError,
    NoRespondersError,
    NotFoundError,
    RemoteError,
    UnavailableError,
)
from eldr.bus.transient import TRANSIENT_KINDS, Backoff, FaultLog, pull_status_kind, transient_kind


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (BusTimeoutError("x"), "timeout"),
        (NoRespondersError("x"), "no_responders"),
        (UnavailableError("x"), "unavailable"),
        (DisconnectedError("x"), "disconnected"),
        (AlreadyExists("x"), None),
        (NotFoundError("x"), None),
        (RemoteError(500, "x"), None),
        (BusError("permissions violation"), None),
        (ValueError("a bug"), None),
    ],
)
def test_only_a_clusters_expected_faults_are_transient(error: Exception, kind: str | None) -> None:
    assert transient_kind(error) == kind
    assert kind is None or kind in TRANSIENT_KINDS


def test_pull_statuses_map_to_bounded_kinds() -> None:
    assert [pull_status_kind(s) for s in ("503", "409", "400", "999")] == [
        "status_503",
        "status_409",
        "status_other",
        "status_other",
    ]
    assert all(pull_status_kind(s) in TRANSIENT_KINDS for s in ("503", "409", "1"))


def test_backoff_doubles_to_its_cap_with_jitter_between_half_and_all() -> None:
    backoff = Backoff(first_s=0.1, max_s=1.0, rng=random.Random(1))
    for attempt, cap in [(1, 0.1), (2, 0.2), (3, 0.4), (4, 0.8), (5, 1.0), (30, 1.0)]:
        delays = [backoff.delay_s(attempt) for _ in range(200)]
        assert all(cap / 2 <= d <= cap for d in delays)
        assert max(delays) - min(delays) > cap / 4  # jittered, not one value


def test_backoff_refuses_a_cap_below_its_first_delay() -> None:
    with pytest.raises(ValueError, match="first_s"):
        Backoff(first_s=2.0, max_s=1.0)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_fault_is_said_once_per_interval_with_the_count_left_unsaid(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    faults = FaultLog(logging.getLogger("t.faults"), interval_s=10.0, clock=clock)
    caplog.set_level(logging.INFO, logger="t.faults")
    logged = []
    for _ in range(300):  # 300 timeouts in 3 s: one line
        logged.append(faults.failed("commit", "timeout", "publish timed out"))
        clock.now += 0.01
    assert logged.count(True) == 1
    assert faults.failed("commit", "no_responders", "no responders")  # another kind: said
    clock.now += 10.0
    assert faults.failed("commit", "timeout", "publish timed out")  # next interval
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3
    assert "299 more since the last report" in lines[2]
    assert all(r.exc_info is None for r in caplog.records)


def test_recovery_is_said_once_with_what_failed_and_for_how_long(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    faults = FaultLog(logging.getLogger("t.faults"), clock=clock)
    caplog.set_level(logging.INFO, logger="t.faults")
    assert not faults.recovered("pull")  # nothing failed: nothing said
    for _ in range(5):
        faults.failed("pull", "status_503", "pull status 503")
    clock.now += 4.0
    faults.failed("pull", "status_409", "pull status 409")
    assert faults.failing("pull")
    assert faults.recovered("pull")
    assert not faults.failing("pull")
    assert not faults.recovered("pull")
    last = caplog.records[-1].getMessage()
    assert last == "pull works again after 4.0 s (1 status_409, 5 status_503)"


def test_a_flapping_operation_says_one_recovery_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # 60 events retried at once through an election recover one by one, some failing once
    # more meanwhile: one failure line and one recovery line, not one of each per event.
    clock = Clock()
    faults = FaultLog(logging.getLogger("t.faults"), interval_s=10.0, clock=clock)
    caplog.set_level(logging.INFO, logger="t.faults")
    for _ in range(60):
        faults.failed("commit", "timeout", "timed out")
    clock.now += 4.0
    for _ in range(60):
        faults.recovered("commit")
        faults.failed("commit", "timeout", "timed out")
        clock.now += 0.05
    assert len(caplog.records) == 2
    clock.now += 10.0
    assert faults.recovered("commit")  # the failures after the first recovery, said now
    assert caplog.records[-1].getMessage().endswith("(60 timeout)")
