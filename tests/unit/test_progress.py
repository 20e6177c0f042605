"""Progress bars: drawn on a terminal, silent on a pipe or a capture."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import sys
import termios

import pytest

from eldr.progress import NO_PROGRESS, terminal_progress


def test_no_bar_when_stderr_is_not_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    with terminal_progress(10, "quiet", unit="x") as progress:
        for _ in range(10):
            progress.advance()
        progress.describe("done")
    NO_PROGRESS.advance(3)
    out = capsys.readouterr()
    assert out.err == ""
    assert out.out == ""


def test_a_bar_when_stderr_is_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    try:
        with os.fdopen(follower, "w", closefd=False) as tty:
            monkeypatch.setattr(sys, "stderr", tty)
            with terminal_progress(4, "loud", unit="x") as progress:
                for _ in range(4):
                    progress.advance(1.5)
            tty.flush()
        os.set_blocking(leader, False)
        drawn = os.read(leader, 65536).decode(errors="replace")
    finally:
        os.close(leader)
        os.close(follower)
    assert "loud" in drawn
