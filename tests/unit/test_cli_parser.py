"""The command line collects every command's parser, except for `eldr serve`, which every
service process runs: its parser comes from its own module alone."""

from __future__ import annotations

import subprocess
import sys

import pytest

from eldr.cli import _command_of, build_parser


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (["serve", "router"], "serve"),
        (["--log-level", "WARNING", "serve", "router"], "serve"),
        (["--log-level=DEBUG", "bench", "--quick"], "bench"),
        (["--help"], None),
        ([], None),
        (["--log-level"], None),
    ],
)
def test_the_command_is_found_after_the_global_options(argv: list[str], command: str) -> None:
    assert _command_of(argv) == command


def test_the_whole_parser_lists_every_command_and_serve_alone_its_own() -> None:
    whole = build_parser()
    commands = whole._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert {"serve", "bench", "demo", "replay"} <= set(commands)
    sole = build_parser("serve")
    assert set(sole._subparsers._group_actions[0].choices) == {"serve"}  # type: ignore[union-attr]


def test_a_service_process_does_not_import_the_bench_modules() -> None:
    code = (
        "import sys; from eldr.cli import build_parser; "
        "build_parser('serve').parse_args(['serve', 'router']); "
        "print(sorted(m for m in sys.modules if m.startswith(('eldr.bench', 'eldr.dev'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]"
