"""Bad input to a command ends in one line on stderr naming the file and a non-zero exit.

Each case runs the real `eldr` entry point as a process (stderr is a pipe, so no progress
bar either) and checks that stderr is exactly one line, `eldr COMMAND: ...`, with no
traceback.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def run_eldr(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "eldr.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        check=False,
    )


def assert_one_line(proc: subprocess.CompletedProcess[str], command: str, *needles: str) -> None:
    lines = proc.stderr.splitlines()
    assert proc.returncode != 0
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"eldr {command}: ")
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0]


@pytest.fixture
def bad(tmp_path: Path) -> Path:
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken" / "label").mkdir(parents=True)
    (tmp_path / "broken" / "label" / "1.json").write_text("{not json")
    (tmp_path / "table.json").write_text('{"rows": []}')
    return tmp_path


@pytest.mark.parametrize(
    ("args", "command", "needles"),
    [
        (("bench", "--traces", "{d}/missing"), "bench", ("{d}/missing", "not a directory")),
        (("bench", "--traces", "{d}/empty"), "bench", ("{d}/empty", "no trace files")),
        (("bench", "--traces", "{d}/broken"), "bench", ("{d}/broken/label/1.json", "JSON")),
        (("bench", "--deployment", "no-such-deployment"), "bench", ("no-such-deployment",)),
        (
            ("bench", "--scenario", "drift", "--traces", "{d}/missing"),
            "bench",
            ("{d}/missing",),
        ),
        (
            ("bench", "--json", "{d}/table.json/out.json"),
            "bench",
            ("{d}/table.json",),
        ),
        (("bench-moe-step", "fit", "{d}/missing.json"), "bench-moe-step", ("{d}/missing.json",)),
        (
            ("bench-moe-step", "fit", "{d}/table.json"),
            "bench-moe-step",
            ("{d}/table.json", "not a moe-step table"),
        ),
        (
            ("bench-moe-step", "fit", "{d}/broken/label/1.json"),
            "bench-moe-step",
            ("{d}/broken/label/1.json", "not valid JSON"),
        ),
        (("demo", "--traces", "{d}/missing"), "demo", ("{d}/missing", "not a directory")),
        (("replay", "--file", "{d}/missing.eldr"), "replay", ("{d}/missing.eldr",)),
        (("import", "{d}/table.json"), "import", ("{d}/table.json",)),
        (
            ("--log-level", "WARNING", "bench-kmeans", "--n", "10", "--dim", "8", "--k", "40"),
            "bench-kmeans",
            ("k must be in",),
        ),
    ],
)
def test_bad_input_ends_in_one_line_and_a_nonzero_exit(
    bad: Path, args: tuple[str, ...], command: str, needles: tuple[str, ...]
) -> None:
    proc = run_eldr(*(a.format(d=bad) for a in args), cwd=bad)
    assert_one_line(proc, command, *(n.format(d=bad) for n in needles))


def test_debug_logging_shows_the_traceback_instead(bad: Path) -> None:
    proc = run_eldr("--log-level", "DEBUG", "bench", "--traces", str(bad / "missing"), cwd=bad)
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr
    assert "TraceFormatError" in proc.stderr
