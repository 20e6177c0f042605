"""Errors a person at the command line can fix, and the one line `eldr` prints for them.

`InputError` is raised for input a user supplied and can correct: a file that does not
parse, a directory without traces, a profile name that does not exist. Its message names
the file (or the argument) and the problem. `eldr` (libs/eldr/cli.py) prints such an error
as one line on stderr, `eldr COMMAND: MESSAGE`, and exits 1; so it does for an OSError about
a file (missing, unreadable, not writable) and, for commands that run once and finish, any
other ValueError. `--log-level DEBUG` shows the traceback instead.
"""

from __future__ import annotations


class InputError(ValueError):
    """Bad user input; the message names the file or argument and what is wrong with it."""


def one_line(exc: BaseException, *, any_value_error: bool = True) -> str | None:
    """The line to print for `exc`, or None if it is not an input problem (a bug: re-raise)."""
    if isinstance(exc, InputError):
        return _single(str(exc))
    if isinstance(exc, OSError) and exc.filename is not None:
        what = exc.strerror or str(exc)
        if exc.filename2 is not None:
            return _single(f"{exc.filename} -> {exc.filename2}: {what}")
        return _single(f"{exc.filename}: {what}")
    if any_value_error and isinstance(exc, ValueError) and str(exc):
        return _single(str(exc))
    return None


def _single(text: str) -> str:
    return " ".join(text.split())
