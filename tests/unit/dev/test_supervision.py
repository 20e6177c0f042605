"""The local supervisor's parts (`eldr.dev.supervision`): restart backoff, the state
directory lock, and children that get the parent-death signal when the spawner thread
ends, never when the thread that asked for them does."""

from __future__ import annotations

import signal
import subprocess
import threading
from pathlib import Path

import pytest

from eldr.dev.supervision import (
    Backoff,
    ChildSpawner,
    StateDirLock,
    StateDirLockedError,
    describe_exit,
    parent_death_supported,
)


def test_backoff_doubles_up_to_its_cap() -> None:
    backoff = Backoff(initial_s=0.5, max_s=4.0)
    assert [backoff.delay_s(n) for n in range(6)] == [0.0, 0.5, 1.0, 2.0, 4.0, 4.0]


def test_a_second_lock_on_a_state_dir_is_refused_naming_the_holder(tmp_path: Path) -> None:
    first = StateDirLock(tmp_path)
    first.acquire()
    try:
        with pytest.raises(StateDirLockedError, match=r"in use by another local stack"):
            StateDirLock(tmp_path).acquire()
    finally:
        first.release()
    again = StateDirLock(tmp_path)
    again.acquire()
    again.release()


def test_exit_descriptions() -> None:
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(3) == "status 3"


@pytest.mark.skipif(not parent_death_supported(), reason="parent-death signal is Linux-only")
def test_a_child_outlives_the_thread_that_asked_and_dies_with_the_spawner() -> None:
    spawner = ChildSpawner(death_signal=signal.SIGTERM)
    started: list[subprocess.Popen[bytes]] = []
    asker = threading.Thread(target=lambda: started.append(spawner.popen(["sleep", "60"])))
    asker.start()
    asker.join()
    child = started[0]
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(timeout=0.5)  # the asking thread is gone; the child is not
        spawner.close()  # the forking thread ends: the kernel sends SIGTERM
        assert child.wait(timeout=10) == -signal.SIGTERM
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
