"""Every skip on a missing prerequisite can be forced to fail, and CI forces them all.

A skip hides a missing install step as well as it spares a developer's machine: each one
goes through `support.prereq.missing` (or `shared_data`) with a switch, and `.ci/run`
sets every switch, so in CI a missing `initdb`, `openssl`, `nkeys`, promtool, kubectl,
PostgreSQL or shared data set is a failure. The few skips that are no missing prerequisite are
listed here with why.
"""

from __future__ import annotations

import re
from pathlib import Path

from support.prereq import SWITCHES

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
SKIP_CALL = re.compile(r"pytest\.(skip\(|importorskip\(|mark\.skipif\()")

NOT_A_PREREQUISITE = {
    "support/prereq.py": "the one place that skips on a missing prerequisite",
    "unit/bench/test_moe_step_bench.py": "skips where torch IS installed: tests/vllm runs it there",
    "unit/dev/test_supervision.py": "the parent-death signal exists on Linux only (a platform)",
}
"""Files whose skips are not a missing install step, and why."""


def test_every_skip_on_a_missing_prerequisite_goes_through_a_switch() -> None:
    offenders = []
    for path in sorted(TESTS.rglob("*.py")):
        rel = path.relative_to(TESTS).as_posix()
        if rel.startswith("vllm/") or rel in NOT_A_PREREQUISITE:
            continue  # tests/vllm run in .venv-vllm, skipping without it by design
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if SKIP_CALL.search(line):
                offenders.append(f"{rel}:{number}: {line.strip()}")
    assert not offenders, (
        "skip through support.prereq.missing(SWITCH, reason) so CI can require it:\n"
        + "\n".join(offenders)
    )


def test_ci_sets_every_switch() -> None:
    ci = (REPO / ".ci" / "run").read_text()
    unset = [switch for switch in SWITCHES if f"{switch}=1" not in ci]
    assert not unset, f".ci/run does not set {unset}"
