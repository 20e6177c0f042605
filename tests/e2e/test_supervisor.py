"""`eldr dev up` as a supervisor that heals (issue 15, finding 11), run as a real process
with every service and an embedded nats-server:

- a second `eldr dev up` on the same state directory is refused (no second nats-server
  on the same JetStream store);
- `kill -9` of one router replica restarts that replica; the rest of the stack stays up;
- `kill -9` of nats-server restarts it on the same port and store, and every service
  reconnects and is ready again;
- `kill -9` of `eldr dev up` itself takes every child with it, and frees the state
  directory.

The tests share one stack and run in file order (the last one kills it). Recovery times
are printed (`-s`) for docs/RELIABILITY.md.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from eldr.dev.stack import eldr_command
from eldr.dev.supervision import StateDirLock

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

START_TIMEOUT_S = 180.0
RECOVERY_TIMEOUT_S = 90.0
_STARTED = re.compile(r"started (\S+) \(pid (\d+), metrics (http://\S+)\)")


@dataclass
class DevUp:
    """A running `eldr dev up` and what it printed."""

    process: subprocess.Popen[bytes]
    state_dir: Path
    lines: list[str] = field(default_factory=list)
    changed: threading.Condition = field(default_factory=threading.Condition)

    def read(self) -> None:
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            with self.changed:
                self.lines.append(raw.decode("utf-8", errors="replace").rstrip("\n"))
                self.changed.notify_all()

    def wait_line(self, pattern: str, *, after: int = 0, timeout_s: float) -> int:
        """Index of the first line from `after` on that matches `pattern`."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout_s
        with self.changed:
            while True:
                for index in range(after, len(self.lines)):
                    if regex.search(self.lines[index]):
                        return index
                left = deadline - time.monotonic()
                if left <= 0 or self.process.poll() is not None:
                    tail = "\n".join(self.lines[-40:])
                    raise AssertionError(f"no line matching {pattern!r}; last lines:\n{tail}")
                self.changed.wait(min(left, 0.5))

    def services(self) -> dict[str, tuple[int, str]]:
        """instance id -> (pid, metrics URL) of its latest start."""
        found: dict[str, tuple[int, str]] = {}
        with self.changed:
            for line in self.lines:
                match = _STARTED.search(line)
                if match:
                    found[match[1]] = (int(match[2]), match[3])
        return found


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[1])


def _alive(pid: int) -> bool:
    """Running and not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            parent = _ppid(int(entry.name))
            if parent is not None:
                children.setdefault(parent, []).append(int(entry.name))
    found: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def nats_server_pid(root: int) -> int:
    for pid in descendants(root):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if name == "nats-server":
            return pid
    raise AssertionError("no nats-server among the supervisor's children")


def ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/readyz", timeout=2.0) as response:
            return bool(response.status == 200 and json.loads(response.read())["ready"])
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_all_ready(urls: list[str], timeout_s: float) -> float:
    started = time.monotonic()
    pending = list(urls)
    while pending:
        pending = [u for u in pending if not ready(u)]
        if pending and time.monotonic() - started > timeout_s:
            raise AssertionError(f"not ready after {timeout_s:g} s: {pending}")
        if pending:
            time.sleep(0.2)
    return time.monotonic() - started


def dev_up_command(state_dir: Path, namespace: str) -> list[str]:
    return [
        *eldr_command(),
        "dev",
        "up",
        "--state-dir",
        str(state_dir),
        "--namespace",
        namespace,
        "--decoders",
        "2",
        "--replicas",
        "signature=1",
        "--replicas",
        "router=2",
        "--env",
        "ELDR_SIMDECODE_TIME_SCALE=0.1",
        "--env",
        "OPENBLAS_NUM_THREADS=1",
    ]


@pytest.fixture(scope="module")
def dev_up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevUp]:
    state_dir = tmp_path_factory.mktemp("devup")
    process = subprocess.Popen(
        dev_up_command(state_dir, f"sv{uuid.uuid4().hex[:8]}"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    stack = DevUp(process, state_dir)
    reader = threading.Thread(target=stack.read, daemon=True)
    reader.start()
    started: set[int] = set()
    try:
        stack.wait_line(r"stack up:", timeout_s=START_TIMEOUT_S)
        started = descendants(process.pid)
        yield stack
    finally:
        children = started | descendants(process.pid)
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for pid in children:  # whatever a failed test left behind
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        reader.join(timeout=5)


def test_a_second_stack_on_the_same_state_dir_is_refused(dev_up: DevUp) -> None:
    started = time.monotonic()
    second = subprocess.run(
        dev_up_command(dev_up.state_dir, "other"),
        capture_output=True,
        timeout=60,
        check=False,
    )
    output = (second.stdout + second.stderr).decode()
    assert second.returncode == 1, output
    assert "is in use by another local stack" in output
    assert f"supervisor pid {dev_up.process.pid}" in output
    assert "nats-server up" not in output  # refused before starting anything
    print(f"\nsecond eldr dev up refused in {time.monotonic() - started:.2f} s")
    assert dev_up.process.poll() is None


def test_a_killed_router_replica_is_restarted_and_the_rest_stays_up(dev_up: DevUp) -> None:
    before = dev_up.services()
    pid, _ = before["router-0"]
    mark = len(dev_up.lines)
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    dev_up.wait_line(
        r"router-0 exited \(killed by SIGKILL\); restarting it", after=mark, timeout_s=10
    )
    dev_up.wait_line(r"router-0 is ready again", after=mark, timeout_s=RECOVERY_TIMEOUT_S)
    recovery_s = time.monotonic() - killed
    print(f"\nrouter-0 kill -9 -> ready again: {recovery_s:.2f} s")
    after = dev_up.services()
    assert after["router-0"][0] != pid
    # nothing else was restarted, and everything is ready
    assert {k: v for k, v in after.items() if k != "router-0"} == {
        k: v for k, v in before.items() if k != "router-0"
    }
    wait_all_ready([url for _, url in after.values()], timeout_s=10)
    assert dev_up.process.poll() is None


def test_a_killed_nats_server_is_restarted_and_every_service_reconnects(
    dev_up: DevUp,
) -> None:
    services = dev_up.services()
    old = nats_server_pid(dev_up.process.pid)
    mark = len(dev_up.lines)
    killed = time.monotonic()
    os.kill(old, signal.SIGKILL)
    dev_up.wait_line(
        r"nats-server exited \(killed by SIGKILL\); restarting it", after=mark, timeout_s=10
    )
    dev_up.wait_line(r"nats-server is up again", after=mark, timeout_s=RECOVERY_TIMEOUT_S)
    nats_s = time.monotonic() - killed
    for instance in services:
        dev_up.wait_line(
            rf"^{re.escape(instance)}\s+\|.*reconnected to",
            after=mark,
            timeout_s=RECOVERY_TIMEOUT_S,
        )
    ready_s = wait_all_ready([url for _, url in services.values()], RECOVERY_TIMEOUT_S)
    print(
        f"\nnats-server kill -9 -> up again {nats_s:.2f} s, every service reconnected and "
        f"ready {time.monotonic() - killed:.2f} s (ready check {ready_s:.2f} s)"
    )
    assert nats_server_pid(dev_up.process.pid) != old
    assert dev_up.services() == services  # reconnected, not restarted
    assert dev_up.process.poll() is None


def test_killing_the_supervisor_takes_every_child_with_it(dev_up: DevUp) -> None:
    children = descendants(dev_up.process.pid)
    assert len(children) >= 6  # nats-server, signature, trainer, simdecode, 2 routers
    killed = time.monotonic()
    os.kill(dev_up.process.pid, signal.SIGKILL)
    dev_up.process.wait(timeout=10)
    deadline = killed + 60.0
    alive = set(children)
    while alive and time.monotonic() < deadline:
        alive = {pid for pid in alive if _alive(pid)}
        time.sleep(0.1)
    gone_s = time.monotonic() - killed
    print(f"\nsupervisor kill -9 -> its {len(children)} children gone in {gone_s:.2f} s")
    assert not alive, f"still running after 60 s: {sorted(alive)}"
    lock = StateDirLock(dev_up.state_dir)
    lock.acquire()  # the state directory is free again
    lock.release()
