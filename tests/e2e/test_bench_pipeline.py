"""`eldr bench-pipeline` end to end, at a small rate: it starts its stack, every request it
sends is decided exactly once (checked on the DECISIONS stream), and what it reports is
consistent (the router's share of a decision's latency is part of the whole).

The numbers themselves are docs/BENCHMARKS.md's business, not a test's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from eldr.bench.pipeline_bench import PipelineConfig, format_table, run

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.mark.parametrize("policy", ["eldr_cost", "eldr"])
def test_every_request_is_decided_once_and_the_router_share_is_part_of_the_latency(
    tmp_path: Path, policy: str
) -> None:
    result = run(
        PipelineConfig(
            rates=(40.0,),
            duration_s=1.5,
            decoders=3,
            state_dir=tmp_path,
            rss_every_s=0.5,
            policy=policy,
        )
    )
    assert result["input"]["policy"] == policy
    (row,) = result["results"]
    assert row["sent"] == 60
    assert row["decided"] == 60
    assert row["lost"] == 0
    assert row["stream_decisions"] == 60
    assert row["stream_lost"] == 0
    assert row["stream_doubled"] == 0
    assert 0 < row["router_p50_ms"] < row["latency_p50_ms"]
    assert row["latency_p50_ms"] <= row["latency_p99_ms"] <= row["latency_max_ms"]
    assert set(row["rss"]) >= {"nats-server", "router-0", "signature-0", "bench (replayer)"}
    table = format_table(result)
    assert f"policy {policy}" in table
    assert "0 lost, 0 doubled" in table


def test_the_command_rejects_an_unknown_policy() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "eldr.cli", "bench-pipeline", "--policy", "nearest"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "invalid choice: 'nearest'" in done.stderr


def test_the_command_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "eldr.cli",
            "--log-level",
            "WARNING",
            "bench-pipeline",
            "--rates",
            "30",
            "--duration",
            "1",
            "--decoders",
            "2",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "0 lost, 0 doubled" in done.stdout
    data = json.loads(out.read_text())
    assert data["input"]["synthetic"] is True
    assert data["results"][0]["sent"] == 30
