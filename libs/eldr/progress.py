"""Progress of long commands on a terminal, and nothing where no one is watching.

Library code that runs for a long time (`eldr bench`, `bench-kmeans`, `bench-pipeline`,
replaying a large export) takes a `Progress` argument and reports units of work to it;
`NO_PROGRESS`, the default, does nothing, so a library call never draws by itself. A
command hands in `terminal_progress(...)`: a tqdm bar on stderr when stderr is a terminal,
silent when it is a pipe, a file or a test's capture (tqdm's own `disable=None` rule), so
logs and JSON on stdout stay clean.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from tqdm import tqdm


class Progress(Protocol):
    """Where long-running code reports what it has done."""

    def advance(self, units: float = 1) -> None:
        """`units` more of the work are done."""

    def describe(self, text: str) -> None:
        """What is being done now (a short phrase)."""


class _NoProgress:
    def advance(self, units: float = 1) -> None:
        pass

    def describe(self, text: str) -> None:
        pass


NO_PROGRESS: Progress = _NoProgress()


class _Bar:
    def __init__(self, bar: tqdm[Any]) -> None:
        self._bar = bar

    def advance(self, units: float = 1) -> None:
        self._bar.update(units)

    def describe(self, text: str) -> None:
        self._bar.set_postfix_str(text, refresh=False)


@contextmanager
def terminal_progress(total: float | None, what: str, unit: str = "it") -> Iterator[Progress]:
    """A progress bar of `total` units (None: unknown) on stderr if it is a terminal."""
    from tqdm import tqdm

    bar: tqdm[Any] = tqdm(
        total=total,
        desc=what,
        unit=unit,
        file=sys.stderr,
        disable=None,  # off unless stderr is a terminal
        leave=False,
        dynamic_ncols=True,
        # Whole units even when they are counted in fractions (seconds of a run).
        bar_format=None
        if total is None
        else "{l_bar}{bar}| {n:.0f}/{total:.0f} {unit} [{elapsed}<{remaining}{postfix}]",
    )
    try:
        yield _Bar(bar)
    finally:
        bar.close()
