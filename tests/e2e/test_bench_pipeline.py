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


@pytest.mark.parametrize("policy", ["eldr_band_cost", "eldr"])
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
    assert set(row["rss"]) >= {"nats-server", "router-0", "signature-0", "bench (driver)"}
    # The driver's prefill worker holds every block it computed: no hit needs the service.
    assert sum(row["signature_sources"].values()) == 60
    assert row["service_share"] == 0
    # (shares are rounded to four places in the report)
    assert row["event_share"] == pytest.approx(
        row["signature_sources"].get("event", 0) / 60, abs=1e-4
    )
    table = format_table(result)
    assert f"policy {policy}" in table
    assert "0 lost, 0 doubled" in table
    assert "sig service" in table


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


def test_one_run_reports_jsq_beside_the_policy_cpu_saturation_and_replicas(
    tmp_path: Path,
) -> None:
    result = run(
        PipelineConfig(
            rates=(30.0,),
            duration_s=1.0,
            decoders=2,
            state_dir=tmp_path,
            rss_every_s=0,
            compare_policy="jsq",
            saturation_rates=(20.0, 40.0),
            replica_counts=(2,),
            throughput_rate=40.0,
            settle_s=0.2,
        )
    )
    assert set(result["policies"]) == {"eldr_band_cost", "jsq"}
    assert result["results"] == result["policies"]["eldr_band_cost"]
    for rows in result["policies"].values():
        (row,) = rows
        assert row["stream_lost"] == row["stream_doubled"] == 0
        assert row["router_cpu_us_per_decision"] > 0
        assert row["cpu"]["cpu_s"].keys() >= {"router-0", "nats-server", "bench (driver)"}
        assert len(row["load_average"]) == 3
    (versus,) = result["versus"]
    assert versus["rate"] == 30.0
    assert versus["p50_ratio"] > 0
    saturation = result["saturation"]
    assert [s["rate"] for s in saturation["steps"]] == [20.0, 40.0][: len(saturation["steps"])]
    assert saturation["saturation_rate"] in (None, 20.0, 40.0)
    (replicas,) = result["replicas"]
    assert replicas["routers"] == 2
    assert replicas["stream_lost"] == 0
    assert replicas["cpu"]["cpu_s"].keys() >= {"router-0", "router-1"}
    table = format_table(result)
    assert "eldr_band_cost / jsq" in table
    assert "throughput by router replicas" in table
