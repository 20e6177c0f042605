"""The local stack: NATS, the database and every service as its own process (`eldr dev up`).

`Stack` starts an embedded `nats-server` with JetStream on a free port (unless a NATS URL
is given), applies the database migrations, then starts the services of `SERVICES` in
order, each replica as `eldr serve <name>` with its own metrics port and instance id, and
waits for every replica's `/readyz` before starting the next service. Their output lines
are prefixed with the instance id. `stop()` stops them in reverse order: SIGTERM, wait,
SIGKILL after a timeout; then NATS.

`supervise()` (what `eldr dev up` runs until Ctrl-C) heals the stack: a service that exits
is restarted with the same instance id and settings after a backoff (`Backoff`; logged
with its exit status and last lines, then again when it is ready), giving up and stopping
the stack after `max_restarts` consecutive crashes; an embedded nats-server that dies is
restarted on the same port and JetStream store (the services reconnect), and the stack
stops when it cannot be. The stack holds a lock on its state directory (a second stack on
the same directory is refused), and every child is started so that it dies with the
supervisor, `kill -9` included (`eldr.dev.supervision`).

The service list is data (`ServiceSpec`), shared with the Tiltfile test, so a service that
is not installed (no `eldr.services` entry point, see `eldr.serve`) is easy to spot:
`missing_services` names it, and `StackConfig.skip_missing` starts the rest without it.

Use from Python as a context manager (the demo and the e2e tests do):

    with Stack(StackConfig(namespace="demo", decoders=4)) as stack:
        settings = stack.bus_settings()
        ...
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TextIO

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from eldr.dev.natsserver import EmbeddedNats, NatsServerError, free_port
from eldr.dev.supervision import (
    Backoff,
    ChildSpawner,
    StateDirLock,
    StateDirLockedError,
    describe_exit,
)
from eldr.serve import service_names as service_names_installed
from eldr.settings import NAMESPACE_PATTERN, BusSettings

log = logging.getLogger(__name__)

_LOG_TAIL_LINES = 60


@dataclass(frozen=True)
class ServiceSpec:
    """One service of the local stack."""

    name: str
    """`eldr serve <name>`: the `eldr.services` entry point of that name."""
    replicas: int = 1
    """Default number of processes; 0 = known but not started unless asked for."""
    after: tuple[str, ...] = ()
    """Services that must be ready before this one starts (Tilt's resource_deps)."""
    uses_database: bool = False
    """Gets ELDR_DATABASE_URL; the stack migrates the database first."""
    description: str = ""


SERVICES: tuple[ServiceSpec, ...] = (
    ServiceSpec(
        "signature",
        replicas=2,
        description="block-summary cache; assembles request signatures",
    ),
    ServiceSpec(
        "trainer",
        uses_database=True,
        description="fits partitions, stores versions in the database, announces them",
    ),
    ServiceSpec(
        "simdecode",
        description="simulated decode workers (cost model in scaled real time)",
    ),
    ServiceSpec(
        "router",
        replicas=2,
        after=("signature", "trainer", "simdecode"),
        description="routes prefill-done events to decode workers",
    ),
    ServiceSpec(
        "simprefill",
        replicas=0,
        after=("router",),
        description="simulated prefill worker replaying traces (started on request)",
    ),
)
"""Every service, in start order (each after the ones it depends on)."""


def service_names(services: Sequence[ServiceSpec] = SERVICES) -> tuple[str, ...]:
    return tuple(s.name for s in services)


def missing_services(services: Sequence[ServiceSpec] = SERVICES) -> list[str]:
    """Services of the list with no `eldr.services` entry point (not installed)."""
    installed = set(service_names_installed())
    return [spec.name for spec in services if spec.name not in installed]


def eldr_command() -> list[str]:
    """How to run the `eldr` CLI with this interpreter: the venv's console script if it
    exists, else `python -m eldr.cli`."""
    script = Path(sys.executable).parent / "eldr"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-m", "eldr.cli"]


def serve_command(name: str) -> list[str]:
    return [*eldr_command(), "serve", name]


class StackError(RuntimeError):
    """A service did not start, did not become ready, or a service is missing."""


class DevStackSettings(BaseSettings):
    """What `eldr dev up` reads from the environment (`ELDR_*`)."""

    model_config = SettingsConfigDict(env_prefix="ELDR_", extra="ignore")

    nats_url: str | None = Field(
        default=None, description="Use this NATS server instead of starting one."
    )
    namespace: str = Field(
        default="eldr", pattern=NAMESPACE_PATTERN, description="Namespace of the stack."
    )
    database_url: str | None = Field(
        default=None,
        description="Partition database; default: SQLite eldr.db in the state directory.",
    )


@dataclass
class Recovery:
    """One crash that `supervise()` repaired (or is repairing); times are monotonic."""

    instance_id: str
    """A service's instance id, or `nats-server`."""
    exit: str
    """How it ended (`killed by SIGKILL`, `status 1`)."""
    noticed_s: float
    restarted_s: float | None = None
    ready_s: float | None = None

    @property
    def recovery_s(self) -> float | None:
        """From noticing the exit to the replacement being ready."""
        return None if self.ready_s is None else self.ready_s - self.noticed_s


@dataclass
class _Watch:
    """`supervise()`'s bookkeeping for one instance."""

    consecutive: int = 0
    restart_due_s: float | None = None
    ready: bool = True
    recovery: Recovery | None = None


@dataclass(frozen=True)
class StackConfig:
    namespace: str = "eldr"
    nats_url: str | None = None
    """An existing NATS server; None = start an embedded one on a free port."""
    nats_store_dir: Path | None = None
    """JetStream store of the embedded server; None = a temporary directory."""
    database_url: str | None = None
    """None = SQLite `eldr.db` in `state_dir`."""
    state_dir: Path = Path(".eldr")
    decoders: int = 4
    """Simulated decode workers hosted by the simdecode process."""
    replicas: Mapping[str, int] = field(default_factory=dict)
    """Per-service replica counts overriding `ServiceSpec.replicas`."""
    services: tuple[ServiceSpec, ...] = SERVICES
    skip_missing: bool = False
    """Start the services that exist and log the missing ones (else: StackError)."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment of every service (e.g. ELDR_SIMDECODE_TIME_SCALE)."""
    service_env: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    """Extra environment per service name."""
    log_level: str = "INFO"
    ready_timeout_s: float = 60.0
    stop_timeout_s: float = 15.0
    echo: bool = True
    """Write the services' prefixed output lines to the output stream."""
    log_dir: Path | None = None
    """Also append each instance's output to `<log_dir>/<instance>.log`."""
    restart_backoff: Backoff = field(default_factory=Backoff)
    """`supervise()`: delay before restarting a crashed service or nats-server."""
    max_restarts: int = 10
    """`supervise()`: consecutive crashes of one service (or failed nats-server starts)
    after which the stack stops instead."""

    def replicas_of(self, spec: ServiceSpec) -> int:
        return int(self.replicas.get(spec.name, spec.replicas))


class ServiceProcess:
    """One running service replica."""

    def __init__(
        self,
        spec: ServiceSpec,
        index: int,
        command: list[str],
        env: dict[str, str],
        metrics_port: int,
        *,
        sink: _OutputSink,
        log_file: Path | None,
        popen: Callable[..., subprocess.Popen[bytes]],
    ) -> None:
        self.spec = spec
        self.index = index
        self.instance_id = f"{spec.name}-{index}"
        self.metrics_port = metrics_port
        self.command = command
        self.tail: deque[str] = deque(maxlen=_LOG_TAIL_LINES)
        self._sink = sink
        self._log_file = log_file
        self.started_s = time.monotonic()
        # A session of its own: Ctrl-C reaches only the supervisor, which stops services
        # in order instead of all of them at once.
        self.popen = popen(
            command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self._reader = threading.Thread(
            target=self._read_output, name=f"{self.instance_id} output", daemon=True
        )
        self._reader.start()

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}"

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def _read_output(self) -> None:
        stream = self.popen.stdout
        assert stream is not None
        log_out = self._log_file.open("a", encoding="utf-8") if self._log_file else None
        try:
            for raw in stream:
                line = raw.decode("utf-8", errors="replace").rstrip("\n")
                self.tail.append(line)
                self._sink.write(self.instance_id, line)
                if log_out is not None:
                    log_out.write(line + "\n")
                    log_out.flush()
        finally:
            if log_out is not None:
                log_out.close()

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(list(self.tail)[-lines:]) or "(no output)"

    def is_ready(self, timeout_s: float = 1.0) -> bool:
        """GET /readyz answered 200."""
        try:
            with urllib.request.urlopen(f"{self.url}/readyz", timeout=timeout_s) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def terminate(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)

    def wait(self, timeout_s: float) -> int | None:
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> int:
        if self.popen.poll() is None:
            self.popen.kill()
        return self.popen.wait()

    def join_output(self, timeout_s: float = 2.0) -> None:
        self._reader.join(timeout=timeout_s)


class _OutputSink:
    """Prefixes service lines with their instance id; one lock so lines never interleave."""

    def __init__(self, out: TextIO | None, width: int) -> None:
        self._out = out
        self._width = width
        self._lock = threading.Lock()

    def write(self, instance_id: str, line: str) -> None:
        if self._out is None:
            return
        with self._lock:
            self._out.write(f"{instance_id:<{self._width}} | {line}\n")
            self._out.flush()


class Stack:
    """NATS + database + every service as processes (see the module docstring)."""

    def __init__(self, config: StackConfig | None = None, *, output: TextIO | None = None) -> None:
        self.config = config or StackConfig()
        self.processes: list[ServiceProcess] = []
        self.nats: EmbeddedNats | None = None
        self.nats_url: str | None = None
        self.database_url: str | None = None
        self.exit_codes: dict[str, int] = {}
        """instance id -> exit code, filled by `stop()`."""
        self.skipped: list[str] = []
        """Services of the list that were not started because they do not exist."""
        self.recoveries: list[Recovery] = []
        """Crashes `supervise()` noticed, in order, with their recovery times."""
        self._lock: StateDirLock | None = None
        self._spawner: ChildSpawner | None = None
        out = (output or sys.stdout) if self.config.echo else None
        width = max((len(s.name) for s in self.config.services), default=8) + 3
        self._sink = _OutputSink(out, width)
        self._validate()

    @property
    def namespace(self) -> str:
        return self.config.namespace

    def _validate(self) -> None:
        names = service_names(self.config.services)
        if len(set(names)) != len(names):
            raise StackError(f"service names repeat: {names}")
        seen: set[str] = set()
        for spec in self.config.services:
            unknown = [d for d in spec.after if d not in names]
            if unknown:
                raise StackError(f"{spec.name} depends on unknown services {unknown}")
            late = [d for d in spec.after if d not in seen]
            if late:
                raise StackError(f"{spec.name} is listed before its dependencies {late}")
            seen.add(spec.name)
        unknown_replicas = sorted(set(self.config.replicas) - set(names))
        if unknown_replicas:
            raise StackError(f"replicas given for unknown services {unknown_replicas}")
        if self.config.decoders <= 0:
            raise StackError("decoders must be positive")

    def planned(self) -> list[tuple[ServiceSpec, int]]:
        """(service, replicas) to start, in order; missing services raise or are skipped."""
        wanted = [(s, self.config.replicas_of(s)) for s in self.config.services]
        wanted = [(s, n) for s, n in wanted if n > 0]
        missing = set(missing_services([s for s, _ in wanted]))
        if missing and not self.config.skip_missing:
            raise StackError(
                f"services not installed (no eldr.services entry point): "
                f"{sorted(missing)}; start without them with skip_missing / --skip-missing"
            )
        self.skipped = sorted(missing)
        for name in self.skipped:
            log.warning("service %s does not exist yet: not started", name)
        return [(s, n) for s, n in wanted if s.name not in missing]

    # --- lifecycle --------------------------------------------------------------------

    def start(self) -> Stack:
        plan = self.planned()
        try:
            self._hold_state_dir()
            self._start_nats()
            if any(spec.uses_database for spec, _ in plan):
                self._migrate()
            for spec, replicas in plan:
                group = [self._spawn(spec, i) for i in range(replicas)]
                self.processes.extend(group)
                self._wait_ready(group)
        except BaseException:
            self.stop()
            raise
        return self

    def _state_dir(self) -> Path:
        path = self.config.state_dir.resolve()
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _hold_state_dir(self) -> None:
        """Lock the state directory (SQLite database, JetStream store, logs) for this stack
        and its children; every child is started by the spawner, which passes them the lock
        and makes them die with this process."""
        lock = StateDirLock(self._state_dir())
        try:
            lock.acquire()
        except StateDirLockedError as exc:
            raise StackError(str(exc)) from None
        self._lock = lock
        self._spawner = ChildSpawner(pass_fds=(lock.fd,))

    def _popen(self, args: Sequence[str], **kwargs: object) -> subprocess.Popen[bytes]:
        if self._spawner is None:
            raise StackError("the stack is not started")
        return self._spawner.popen(args, **kwargs)

    def _start_nats(self) -> None:
        if self.config.nats_url is not None:
            self.nats_url = self.config.nats_url
            log.info("using NATS at %s", self.nats_url)
            return
        self.nats = EmbeddedNats(store_dir=self.config.nats_store_dir, popen=self._popen)
        self.nats.start()
        self.nats_url = self.nats.url

    def _migrate(self) -> None:
        from eldr.store.migrate import upgrade  # SQLAlchemy/Alembic only when needed

        url = self.config.database_url
        if url is None:
            url = f"sqlite:///{self._state_dir() / 'eldr.db'}"
        self.database_url = url
        upgrade(url)

    def service_env(self, spec: ServiceSpec, index: int, metrics_port: int) -> dict[str, str]:
        """The environment of one replica (what the Tiltfile sets as well)."""
        assert self.nats_url is not None
        env = {
            "ELDR_NATS_URL": self.nats_url,
            "ELDR_NAMESPACE": self.config.namespace,
            "ELDR_METRICS_PORT": str(metrics_port),
            "ELDR_METRICS_HOST": "127.0.0.1",  # the local stack: loopback only
            "ELDR_INSTANCE_ID": f"{spec.name}-{index}",
            "ELDR_LOG_LEVEL": self.config.log_level,
            "PYTHONUNBUFFERED": "1",
        }
        if spec.name == "simdecode":
            env["ELDR_SIMDECODE_WORKERS"] = str(self.config.decoders)
        if spec.uses_database and self.database_url is not None:
            env["ELDR_DATABASE_URL"] = self.database_url
        env.update(self.config.env)
        env.update(self.config.service_env.get(spec.name, {}))
        return env

    def _spawn(self, spec: ServiceSpec, index: int) -> ServiceProcess:
        port = free_port()
        # The child inherits this process's environment (PATH, HOME, the venv) plus its own.
        env = {**os.environ, **self.service_env(spec, index, port)}
        log_file = None
        if self.config.log_dir is not None:
            self.config.log_dir.mkdir(parents=True, exist_ok=True)
            log_file = self.config.log_dir / f"{spec.name}-{index}.log"
        process = ServiceProcess(
            spec,
            index,
            serve_command(spec.name),
            env,
            port,
            sink=self._sink,
            log_file=log_file,
            popen=self._popen,
        )
        log.info("started %s (pid %d, metrics %s)", process.instance_id, process.pid, process.url)
        return process

    def _wait_ready(self, group: list[ServiceProcess]) -> None:
        deadline = time.monotonic() + self.config.ready_timeout_s
        pending = list(group)
        while pending:
            for process in list(pending):
                code = process.returncode
                if code is not None:
                    process.join_output()
                    raise StackError(
                        f"{process.instance_id} exited with status {code} before it was ready; "
                        f"its last lines:\n{process.log_tail()}"
                    )
                if process.is_ready():
                    log.info("%s is ready", process.instance_id)
                    pending.remove(process)
            if pending and time.monotonic() > deadline:
                names = ", ".join(p.instance_id for p in pending)
                raise StackError(
                    f"{names} not ready after {self.config.ready_timeout_s:g} s; last lines of "
                    f"{pending[0].instance_id}:\n{pending[0].log_tail()}"
                )
            if pending:
                time.sleep(0.1)

    def stop(self) -> dict[str, int]:
        """Stop the services in reverse start order (SIGTERM, then SIGKILL after
        `stop_timeout_s`), then NATS. Returns instance id -> exit code. Idempotent."""
        groups: dict[str, list[ServiceProcess]] = {}
        for process in self.processes:
            groups.setdefault(process.name, []).append(process)
        for name in reversed(list(groups)):
            group = groups[name]
            for process in group:
                process.terminate()
            deadline = time.monotonic() + self.config.stop_timeout_s
            for process in group:
                code = process.wait(max(0.0, deadline - time.monotonic()))
                if code is None:
                    log.warning(
                        "%s did not stop within %.0f s: killing it",
                        process.instance_id,
                        self.config.stop_timeout_s,
                    )
                    code = process.kill()
                process.join_output()
                self.exit_codes[process.instance_id] = code
                if code != 0:
                    log.warning("%s exited with status %d", process.instance_id, code)
        self.processes = []
        if self.nats is not None:
            self.nats.stop()
            self.nats = None
        # Only now: the spawner thread's end is what would signal the children.
        if self._spawner is not None:
            self._spawner.close()
            self._spawner = None
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        return dict(self.exit_codes)

    # --- supervision ------------------------------------------------------------------

    def supervise(self, stop: threading.Event, poll_s: float = 0.25) -> int:
        """Keep the started stack running until `stop` is set (returns 0), restarting
        services that exit and an embedded nats-server that dies (module docstring).
        Returns 1 when it gives up: a service crashed `max_restarts` times in a row, or
        nats-server could not be started again. The caller then calls `stop()`."""
        watches: dict[str, _Watch] = {p.instance_id: _Watch() for p in self.processes}
        while not stop.wait(poll_s):
            if not self._supervise_nats(stop):
                return 1
            for index, process in enumerate(list(self.processes)):
                watch = watches.setdefault(process.instance_id, _Watch())
                if watch.consecutive > self.config.max_restarts:
                    return 1
                replacement = self._supervise_one(process, watch)
                if replacement is not None:
                    self.processes[index] = replacement
        return 0

    def _supervise_one(self, process: ServiceProcess, watch: _Watch) -> ServiceProcess | None:
        """One look at one replica: its replacement when it was restarted, else None
        (`watch.consecutive` past `max_restarts`: the stack gives up on it)."""
        now = time.monotonic()
        code = process.returncode
        backoff = self.config.restart_backoff
        if code is None:
            if not watch.ready and process.is_ready(timeout_s=0.5):
                watch.ready = True
                if watch.recovery is not None:
                    watch.recovery.ready_s = time.monotonic()
                    log.info(
                        "%s is ready again, %.1f s after it exited (%s)",
                        process.instance_id,
                        watch.recovery.recovery_s,
                        watch.recovery.exit,
                    )
            if (
                watch.ready
                and watch.consecutive
                and now - process.started_s >= backoff.reset_after_s
            ):
                watch.consecutive = 0
            return None
        if watch.restart_due_s is None:
            process.join_output(timeout_s=0.5)
            watch.consecutive += 1
            exit_text = describe_exit(code)
            if watch.consecutive > self.config.max_restarts:
                log.error(
                    "%s exited (%s) after %d restarts in a row: giving up, stopping the "
                    "stack. Its last lines:\n%s",
                    process.instance_id,
                    exit_text,
                    self.config.max_restarts,
                    process.log_tail(),
                )
                return None
            delay_s = backoff.delay_s(watch.consecutive)
            watch.restart_due_s = now + delay_s
            watch.ready = False
            watch.recovery = Recovery(process.instance_id, exit_text, noticed_s=now)
            self.recoveries.append(watch.recovery)
            log.error(
                "%s exited (%s); restarting it in %.1f s (restart %d in a row). Its last "
                "lines:\n%s",
                process.instance_id,
                exit_text,
                delay_s,
                watch.consecutive,
                process.log_tail(),
            )
            return None
        if now < watch.restart_due_s:
            return None
        watch.restart_due_s = None
        new = self._spawn(process.spec, process.index)
        if watch.recovery is not None:
            watch.recovery.restarted_s = time.monotonic()
        return new

    def _supervise_nats(self, stop: threading.Event) -> bool:
        """Restart a dead embedded nats-server on its port and store; False when it
        cannot be started within `max_restarts` attempts."""
        nats = self.nats
        if nats is None or nats.running:
            return True
        code = nats.exit_code
        recovery = Recovery(
            "nats-server", describe_exit(code) if code is not None else "gone", time.monotonic()
        )
        self.recoveries.append(recovery)
        log.error(
            "nats-server exited (%s); restarting it on %s with the same JetStream store "
            "(the services reconnect)",
            recovery.exit,
            nats.url,
        )
        for attempt in range(1, self.config.max_restarts + 1):
            try:
                recovery.restarted_s = time.monotonic()
                nats.start()
            except NatsServerError as exc:
                delay_s = self.config.restart_backoff.delay_s(attempt)
                log.error(
                    "nats-server did not start again (attempt %d): %s; next try in %.1f s",
                    attempt,
                    exc,
                    delay_s,
                )
                if stop.wait(delay_s):
                    return True
                continue
            recovery.ready_s = time.monotonic()
            log.info("nats-server is up again, %.1f s after it exited", recovery.recovery_s)
            return True
        log.error("nats-server could not be started again: stopping the stack")
        return False

    # --- conveniences -----------------------------------------------------------------

    def bus_settings(self, **overrides: object) -> BusSettings:
        """Settings to connect to this stack's NATS and namespace."""
        if self.nats_url is None:
            raise StackError("the stack is not started")
        fields: dict[str, object] = {"nats_url": self.nats_url, "namespace": self.namespace}
        fields.update(overrides)
        return BusSettings(**fields)  # type: ignore[arg-type]

    def process(self, instance_id: str) -> ServiceProcess:
        for process in self.processes:
            if process.instance_id == instance_id:
                return process
        raise KeyError(instance_id)

    def restart(self, instance_id: str, *, kill: bool = True, wait_ready: bool = True) -> float:
        """Replace a replica by a new process with the same instance id and settings (fault
        tests): SIGKILL it first when `kill` (else it must have exited), start the new one
        and, with `wait_ready`, wait for its /readyz. Returns the seconds from the kill to
        ready (or to the start)."""
        old = self.process(instance_id)
        started = time.monotonic()
        if kill:
            old.kill()
        elif old.returncode is None:
            raise StackError(f"{instance_id} is still running; pass kill=True")
        old.join_output()
        new = self._spawn(old.spec, old.index)
        self.processes[self.processes.index(old)] = new
        if wait_ready:
            self._wait_ready([new])
        return time.monotonic() - started

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
