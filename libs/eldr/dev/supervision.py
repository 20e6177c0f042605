"""What makes the local stack a supervisor: children that die with it, a state-directory
lock, and restart backoff.

- `ChildSpawner` starts every child of the stack (services, the embedded nats-server) from
  one thread of its own, through a tiny launcher that asks Linux to send the child SIGTERM
  when its parent dies (`prctl(PR_SET_PDEATHSIG)`) and then `exec`s the real command, so the
  child keeps its pid. Why a launcher and not `preexec_fn`: `preexec_fn` runs Python in a
  forked copy of a multi-threaded process (the stack has an output reader thread per
  child), which the `subprocess` documentation calls unsafe. Why one thread: the kernel
  sends the parent-death signal when the *thread* that forked the child exits, not the
  process; a child started from a short-lived worker thread (`asyncio.to_thread`) would be
  killed when that thread ends. The spawner thread lives until the stack has stopped its
  children, so the signal comes only when the supervisor process itself dies (`kill -9`
  included). The launcher checks that its parent is still the supervisor after the
  `prctl`, so a supervisor that died in between does not leave an orphan. Each child also
  gets a session (process group) of its own: Ctrl-C reaches only the supervisor, which
  stops the services in order. Off Linux there is no parent-death signal: children are
  started directly and only a clean stop stops them.
- `StateDirLock`: an exclusive `flock` on `<state dir>/stack.lock`, holding the
  supervisor's pid. The lock's file descriptor is passed to every child, so the lock is
  released only when the supervisor *and* all its children are gone: a second stack on the
  same directory (its SQLite database and JetStream store) is refused as long as any part
  of the first one runs.
- `Backoff`: the delay before restarting a crashed child (doubling from `initial_s` up to
  `max_s`, reset once the child stayed up for `reset_after_s`).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
"""From <linux/prctl.h>."""

LAUNCHER_STARTUP_ERROR = 125
"""Exit status of the launcher when the supervisor died before the child was armed."""

_LAUNCHER = """\
import ctypes, os, sys
parent, sig = int(sys.argv[1]), int(sys.argv[2])
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(1, sig, 0, 0, 0) != 0:
    err = ctypes.get_errno()
    sys.stderr.write("eldr launcher: prctl(PR_SET_PDEATHSIG) failed: errno %d\\n" % err)
    sys.exit(126)
if os.getppid() != parent:
    sys.exit(125)
os.execvp(sys.argv[3], sys.argv[3:])
"""
"""Arms the parent-death signal, checks the parent, execs the command (`python -I -S -c`:
isolated, no site packages, so it costs ~10-20 ms before the exec)."""


def parent_death_supported() -> bool:
    return sys.platform.startswith("linux")


def launcher_command(
    command: Sequence[str], *, parent_pid: int, death_signal: signal.Signals = signal.SIGTERM
) -> list[str]:
    """`command` run through the launcher: it gets `death_signal` when `parent_pid`'s
    forking thread dies."""
    return [
        sys.executable,
        "-I",
        "-S",
        "-c",
        _LAUNCHER,
        str(parent_pid),
        str(int(death_signal)),
        *command,
    ]


class SpawnerClosedError(RuntimeError):
    """The spawner was closed: no child can be started any more."""


class ChildSpawner:
    """Starts child processes from one long-lived thread, each through the parent-death
    launcher (see the module docstring). `popen` may be called from any thread."""

    def __init__(
        self,
        *,
        death_signal: signal.Signals = signal.SIGTERM,
        pass_fds: Sequence[int] = (),
        die_with_parent: bool | None = None,
    ) -> None:
        self.death_signal = death_signal
        self.pass_fds = tuple(pass_fds)
        self.die_with_parent = (
            parent_death_supported() if die_with_parent is None else die_with_parent
        )
        self._jobs: queue.SimpleQueue[
            tuple[Callable[[], subprocess.Popen[bytes]], Future[subprocess.Popen[bytes]]] | None
        ] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="eldr child spawner", daemon=True)
        self._thread.start()

    def command(self, args: Sequence[str]) -> list[str]:
        """The argv actually executed for `args`."""
        if not self.die_with_parent:
            return list(args)
        return launcher_command(args, parent_pid=os.getpid(), death_signal=self.death_signal)

    def popen(self, args: Sequence[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        """`subprocess.Popen(args, **kwargs)` from the spawner thread, through the launcher,
        in a new session, with the spawner's `pass_fds` added."""
        if self._closed:
            raise SpawnerClosedError("the child spawner is closed")
        argv = self.command(args)
        kwargs.setdefault("start_new_session", True)
        kwargs["pass_fds"] = tuple(sorted({*kwargs.get("pass_fds", ()), *self.pass_fds}))
        future: Future[subprocess.Popen[bytes]] = Future()
        self._jobs.put((lambda: subprocess.Popen(argv, **kwargs), future))
        return future.result()

    def close(self) -> None:
        """Stop the spawner thread. Call only once every child it started has exited: the
        thread's end is what sends them the parent-death signal."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            start, future = job
            try:
                future.set_result(start())
            except BaseException as exc:  # handed to the caller's thread
                future.set_exception(exc)


class StateDirLockedError(RuntimeError):
    """Another stack holds the state directory."""


class StateDirLock:
    """An exclusive, non-blocking `flock` on `<state_dir>/stack.lock` (see the module
    docstring). `fd` is the descriptor to pass to children so that they hold it too."""

    FILE_NAME = "stack.lock"

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / self.FILE_NAME
        self._fd: int | None = None

    @property
    def fd(self) -> int:
        if self._fd is None:
            raise RuntimeError("the state directory lock is not held")
        return self._fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._read_holder(fd)
            os.close(fd)
            raise StateDirLockedError(
                f"state directory {self.path.parent} is in use by another local stack "
                f"({holder}); stop it first (Ctrl-C), or give this one another --state-dir"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        """Drop this process's hold. Children that inherited the descriptor keep the lock
        until they exit."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
        os.close(self._fd)
        self._fd = None

    @staticmethod
    def _read_holder(fd: int) -> str:
        try:
            text = os.pread(fd, 64, 0).decode("ascii", errors="replace").strip()
            pid = int(text)
        except (OSError, ValueError):
            return "supervisor pid unknown"
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return f"supervisor pid {pid} is gone, some of its children still run"
        except PermissionError:
            pass
        return f"supervisor pid {pid}"


@dataclass(frozen=True)
class Backoff:
    """Delay before the n-th consecutive restart of a child: `initial_s * 2**(n-1)`, at
    most `max_s`; a child that stayed up `reset_after_s` starts again from `initial_s`."""

    initial_s: float = 0.5
    max_s: float = 30.0
    reset_after_s: float = 60.0

    def delay_s(self, consecutive: int) -> float:
        if consecutive <= 0:
            return 0.0
        return float(min(self.max_s, self.initial_s * 2 ** (consecutive - 1)))


def describe_exit(code: int) -> str:
    """`status 1` / `killed by SIGKILL`."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"status {code}"
