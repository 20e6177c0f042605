"""The `eldr` command line.

Each subcommand lives next to the code it drives and registers itself through a
`register(subparsers)` function that adds an argparse parser and sets `func`; this module
only collects them, so `eldr --help` lists everything the project can do.

Bad input ends in one line on stderr naming the file and the problem, and exit status 1,
never a traceback (`eldr.errors`; `--log-level DEBUG` shows the traceback); Ctrl-C ends a
command with status 130.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from eldr.errors import one_line

# Long-running services and the local stack: only input errors become one line there; any
# other exception is a crash whose traceback belongs in the log.
LONG_RUNNING_COMMANDS = frozenset({"serve", "dev"})

# Modules exposing `register(subparsers)`. Imported lazily by name so that a command's
# heavy imports (matplotlib, nats, sqlalchemy) are paid only when it runs.
COMMAND_MODULES: tuple[str, ...] = (
    "eldr.bench.cli",
    "eldr.store.cli",
    "eldr.serve",
    "eldr.dev.cli",
    "eldr.training.cli",
    "eldr.dev.demo",
    "eldr.dev.compare",
    "eldr.dev.fit_synthetic",
    "eldr.dev.soak",
    "eldr.partitions.cli",
    "eldr.deploy.cli",
    "eldr.replay.cli",
)


SOLE_OWNER: dict[str, str] = {"serve": "eldr.serve"}
"""Commands whose module is known without importing the others: `eldr serve` starts every
service process, so its parser is built from its own module alone (the bench modules
import scipy and the simulator: about 0.5 s and 40 MiB a process otherwise)."""


def _command_of(argv: Sequence[str]) -> str | None:
    """The subcommand named in `argv` (after the global `--log-level`), if any."""
    rest = list(argv)
    while rest:
        head = rest.pop(0)
        if head == "--log-level":
            if rest:
                rest.pop(0)
            continue
        if head.startswith("--log-level="):
            continue
        return None if head.startswith("-") else head
    return None


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with a `command` of `SOLE_OWNER`, only that command's."""
    parser = argparse.ArgumentParser(
        prog="eldr",
        description="Expert-locality-aware decode routing for PD-disaggregated MoE serving.",
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    owner = SOLE_OWNER.get(command or "")
    for name in COMMAND_MODULES if owner is None else (owner,):
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue  # a command module that is not written yet
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(_command_of(argv))
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    command = str(args.command)
    try:
        return int(func(args) or 0)
    except KeyboardInterrupt:
        print(f"eldr {command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        line = one_line(exc, any_value_error=command not in LONG_RUNNING_COMMANDS)
        if line is None or logging.getLogger().isEnabledFor(logging.DEBUG):
            raise
        print(f"eldr {command}: {line}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
