"""Prerequisites a test needs from the machine, each with a switch that makes its absence
a failure instead of a skip.

A test that cannot run here (no PostgreSQL server, no `initdb`, no `openssl` command, no
`nkeys` package, no promtool, no kubectl, no shared data set) skips with the reason, so a
developer's machine without them still runs the rest. CI must not hide a missing install step that
way: `.ci/run` sets every switch of `SWITCHES`, and then `missing` fails the test with the
same reason. `tests/unit/test_prerequisites.py` checks that every skip on a missing
prerequisite goes through here and that `.ci/run` sets every switch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NoReturn

import pytest

SWITCHES: dict[str, str] = {
    "ELDR_TEST_REQUIRE_PG": "a PostgreSQL server to connect to (ELDR_TEST_PG_URL)",
    "ELDR_TEST_REQUIRE_PROMTOOL": "Prometheus's promtool (scripts/bootstrap-tools)",
    "ELDR_TEST_REQUIRE_INITDB": "PostgreSQL's server binaries, initdb and pg_ctl, for the "
    "fault suite's throwaway server (scripts/bootstrap-tools)",
    "ELDR_TEST_REQUIRE_OPENSSL": "the openssl command line, for the security tests' "
    "certificates (scripts/bootstrap-tools)",
    "ELDR_TEST_REQUIRE_NKEYS": "the nkeys package (a dependency in pyproject.toml)",
    "ELDR_TEST_REQUIRE_KUBECTL": "kubectl (kustomize v5 inside), to render the deploy/ "
    "overlays with the real kustomize (the machine image brings it)",
    "ELDR_TEST_REQUIRE_DATA": "the shared data set, ../shared/data beside the repository "
    "(real expert traces, OLMoE routing counts)",
}
"""Each switch and what it requires."""

REPO = Path(__file__).resolve().parents[2]
SHARED_DATA = (REPO / ".." / "shared" / "data").resolve()
"""The shared data set (see its README.md); never part of the repository."""


def required(switch: str) -> bool:
    """Whether `switch` is set (to anything but empty or 0)."""
    if switch not in SWITCHES:
        raise ValueError(f"unknown prerequisite switch {switch!r}")
    return os.environ.get(switch, "") not in ("", "0")


def missing(switch: str, reason: str) -> NoReturn:
    """A prerequisite is missing: skip with `reason`, or fail when `switch` is set."""
    if required(switch):
        pytest.fail(f"{reason} ({switch} is set: CI requires it)")
    pytest.skip(reason)


def shared_data(*parts: str) -> Path:
    """A path in the shared data set; skips (or fails, with ELDR_TEST_REQUIRE_DATA) when it
    is not there."""
    path = SHARED_DATA.joinpath(*parts)
    if not path.exists():
        missing(
            "ELDR_TEST_REQUIRE_DATA",
            f"shared data not found at {path} (see ../shared/data/README.md)",
        )
    return path
