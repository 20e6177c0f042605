"""A throwaway PostgreSQL server of our own, so fault tests can stop and start it.

The machine's shared server must never be stopped by a test; this one lives in a temporary
directory, listens on a free loopback port and goes away with `destroy()`. It needs the
Debian server binaries (`/usr/lib/postgresql/<version>/bin/initdb`, `pg_ctl`); when they are
missing `find_pg_bin` returns None and the tests skip with that reason. `initdb` refuses to
run as root, so as root every command runs as the `postgres` system user (`runuser`).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

from eldr.dev.natsserver import free_port

PG_ROOT = Path("/usr/lib/postgresql")
RUN_AS = "postgres"


def find_pg_bin() -> Path | None:
    """The newest installed server's bin directory holding initdb and pg_ctl, or None."""
    if not PG_ROOT.is_dir():
        return None
    candidates = []
    for child in PG_ROOT.iterdir():
        bin_dir = child / "bin"
        if (bin_dir / "initdb").is_file() and (bin_dir / "pg_ctl").is_file():
            try:
                candidates.append((int(child.name), bin_dir))
            except ValueError:
                continue
    return max(candidates)[1] if candidates else None


def missing_reason() -> str | None:
    """Why a throwaway server cannot be run here, or None if it can."""
    if find_pg_bin() is None:
        return f"no PostgreSQL server binaries (initdb, pg_ctl) under {PG_ROOT}"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(RUN_AS)
        except KeyError:
            return f"running as root and there is no {RUN_AS!r} user to run initdb as"
        if shutil.which("runuser") is None:
            return "running as root and `runuser` is missing"
    return None


class ThrowawayPostgres:
    """initdb + pg_ctl start/stop on a free port; trust authentication on loopback only."""

    def __init__(self, *, password: str | None = None) -> None:
        bin_dir = find_pg_bin()
        if bin_dir is None:
            raise RuntimeError(missing_reason() or "no PostgreSQL binaries")
        self.bin_dir = bin_dir
        self.port = free_port()
        self.password = password
        self.root = Path(tempfile.mkdtemp(prefix="eldr-pg-"))
        self.data_dir = self.root / "data"
        self.socket_dir = self.root / "sock"
        self.log_file = self.root / "server.log"
        self._as_root = os.geteuid() == 0
        if self._as_root:
            user = pwd.getpwnam(RUN_AS)
            os.chown(self.root, user.pw_uid, user.pw_gid)
        self.socket_dir.mkdir()
        if self._as_root:
            os.chown(self.socket_dir, user.pw_uid, user.pw_gid)

    def _run(self, *args: str, timeout_s: float = 60.0) -> None:
        command = [str(self.bin_dir / args[0]), *args[1:]]
        if self._as_root:
            command = ["runuser", "-u", RUN_AS, "--", *command]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(args[:2])} failed ({done.returncode}): {done.stderr.strip()}\n"
                f"{self.log_tail()}"
            )

    def init(self) -> ThrowawayPostgres:
        auth = ["--auth=trust"]
        if self.password is not None:
            pw_file = self.root / "pw"
            pw_file.write_text(self.password)
            if self._as_root:
                user = pwd.getpwnam(RUN_AS)
                os.chown(pw_file, user.pw_uid, user.pw_gid)
            auth = ["--auth=scram-sha-256", f"--pwfile={pw_file}"]
        self._run("initdb", "-D", str(self.data_dir), "-U", "postgres", "-E", "UTF8", *auth)
        return self

    def start(self) -> None:
        options = (
            f"-p {self.port} -k {self.socket_dir} -c listen_addresses=127.0.0.1 "
            "-c fsync=off -c full_page_writes=off -c max_connections=40"
        )
        self._run(
            "pg_ctl",
            "-D",
            str(self.data_dir),
            "-l",
            str(self.log_file),
            "-o",
            options,
            "-w",
            "start",
        )

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (`immediate` is a crash: no shutdown checkpoint)."""
        self._run("pg_ctl", "-D", str(self.data_dir), "-m", mode, "-w", "stop")

    @property
    def running(self) -> bool:
        return (self.data_dir / "postmaster.pid").exists()

    def url(self, database: str = "postgres") -> str:
        auth = "postgres" if self.password is None else f"postgres:{self.password}"
        return f"postgresql+psycopg://{auth}@127.0.0.1:{self.port}/{database}"

    def log_tail(self, max_chars: int = 2000) -> str:
        try:
            return self.log_file.read_text(errors="replace")[-max_chars:]
        except OSError:
            return "(no server log)"

    def destroy(self) -> None:
        if self.running:
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> ThrowawayPostgres:
        self.init()
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.destroy()
