"""`eldr bench-decide`: the in-process decision timing is reproducible in what it decides."""

from __future__ import annotations

import numpy as np

from eldr.bench.decide_bench import DecideBenchConfig, format_table, run
from eldr.core.workload.synthetic import SyntheticSpec, generate

TRACES = generate(SyntheticSpec(), 60, np.random.default_rng(0))
CONFIG = DecideBenchConfig(
    policies=("jsq", "eldr", "eldr_cost"), workers=4, in_flight=3, decisions=80, warmup=10
)


def test_the_same_inputs_route_the_same_and_every_policy_is_timed() -> None:
    first, second = run(TRACES, CONFIG), run(TRACES, CONFIG)
    assert [r["policy"] for r in first["results"]] == ["jsq", "eldr", "eldr_cost"]
    for a, b in zip(first["results"], second["results"], strict=True):
        assert a["decisions_sha256"] == b["decisions_sha256"]
        assert a["decisions"] == 80
        assert 0 < a["decide"]["p50_us"] <= a["decide"]["p99_us"]
        assert a["upkeep"]["mean_us"] > 0
    # Policies that weigh different things route differently on the same requests.
    assert len({r["decisions_sha256"] for r in first["results"]}) > 1
    assert first["input"]["nonzero_cells_p50"] > 0
    assert "eldr_cost" in format_table(first)
