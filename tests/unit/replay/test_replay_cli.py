"""`eldr replay / explain / import --check` on export files (no NATS), and time parsing."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import msgspec
import pytest
from test_replay import T0, counts, log_of, record, router

from eldr.core.routing.decide import RouteRequest
from eldr.replay.cli import EXIT_ERROR, EXIT_NOT_REPRODUCED, EXIT_OK, parse_time, register
from eldr.replay.eventlog import write_event_file

NOW = 1_750_000_000.0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1700000000.5", 1_700_000_000.5),
        ("2023-11-14T22:13:20Z", 1_700_000_000.0),
        ("2023-11-14T22:13:20", 1_700_000_000.0),
        ("15m", NOW - 900.0),
        ("-2h", NOW - 7200.0),
        ("1d ago", NOW - 86400.0),
    ],
)
def test_times_are_unix_seconds_iso_or_ages(text: str, expected: float) -> None:
    assert parse_time(text, now_s=NOW) == pytest.approx(expected)


def test_a_bad_time_says_what_is_accepted() -> None:
    with pytest.raises(ValueError, match="Unix seconds, ISO 8601 or an age"):
        parse_time("yesterday-ish", now_s=NOW)


def run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="eldr")
    register(parser.add_subparsers())
    args = parser.parse_args(argv)
    return int(args.func(args))


@pytest.fixture
def export_file(tmp_path: Path) -> Path:
    core = router({"d0": 0, "d1": 0, "d2": 0, "d3": 0}, "eldr", 0.3)
    decisions = []
    for i in range(30):
        d = record(core, RouteRequest(f"r{i}", "m", 10, counts(i % 4, i % 3, i)), T0 + i * 0.1)
        core.table.on_assignment(d.worker_id, d.request_id, 10, 0.0)
        decisions.append(d)
    path = tmp_path / "window.eldr"
    write_event_file(log_of(decisions), path)
    return path


def test_replay_of_a_file_reproduces_and_reports_a_what_if(
    export_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png = tmp_path / "replay.png"
    rc = run("replay", "--file", str(export_file), "--tau", "0", "--png", str(png))
    out = capsys.readouterr().out
    assert rc == EXIT_OK
    assert "30 of 30 decisions reproduced (100.00%)" in out
    assert "what-if: tau 0.3 -> 0" in out
    assert png.stat().st_size > 10_000


def test_replay_json_is_machine_readable(
    export_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run("replay", "--file", str(export_file), "--policy", "jsq", "--json", "-") == EXIT_OK
    report = json.loads(capsys.readouterr().out)
    assert report["reproduction"]["complete"] is True
    assert report["counterfactual"]["changes"] == {"policy": "eldr -> jsq"}
    assert sum(report["counterfactual"]["after"]["per_worker"].values()) == 30


def test_replay_exits_3_when_a_record_does_not_reproduce(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = record(router({"d0": 5, "d1": 0}, "jsq"), RouteRequest("x", "m", 1, counts(0)), T0)
    write_event_file(log_of([msgspec.structs.replace(d, worker_id="d0")]), tmp_path / "f.eldr")
    assert run("replay", "--file", str(tmp_path / "f.eldr")) == EXIT_NOT_REPRODUCED
    assert "mismatch x (router r1): worker d0 recorded, d1 replayed" in capsys.readouterr().out


def test_explain_from_a_file(export_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run("explain", "r7", "--file", str(export_file)) == EXIT_OK
    out = capsys.readouterr().out
    assert out.startswith("Request r7 went to decode worker d")
    assert "Band: " in out
    assert "Winner: " in out


def test_explain_of_an_unknown_request_fails_clearly(
    export_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run("explain", "nope", "--file", str(export_file)) == EXIT_ERROR
    err = capsys.readouterr().err
    assert err.strip() == (
        f"eldr explain: no decision recorded for request id 'nope' in {export_file} (30 decisions)"
    )


def test_import_check_names_the_first_bad_record(
    export_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = bytearray(export_file.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    bad = tmp_path / "bad.eldr"
    bad.write_bytes(bytes(raw))
    assert run("import", str(bad), "--check") == EXIT_ERROR
    err = capsys.readouterr().err
    assert err.startswith(f"eldr import: {bad}: record ")
    assert "checksum mismatch" in err or "implausible record length" in err


def test_import_check_accepts_a_good_file(
    export_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run("import", str(export_file), "--check") == EXIT_OK
    assert "valid event log of namespace t" in capsys.readouterr().out


def test_replay_with_another_partition_file(
    export_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from test_replay import partition

    from eldr.partitions.codec import partition_to_blob
    from eldr.wire import encode

    swapped = partition(("d1", "d0", "d3", "d2"), version=2)  # every cluster moves
    (tmp_path / "v2.blob").write_bytes(encode(partition_to_blob(swapped)))
    rc = run("replay", "--file", str(export_file), "--partition", str(tmp_path / "v2.blob"))
    out = capsys.readouterr().out
    assert rc == EXIT_OK
    assert "what-if: partition [1] -> version 2" in out
    assert "decisions changed: 0 of 30" not in out


def test_replay_with_a_partition_version_the_file_lacks_fails_clearly(
    export_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run("replay", "--file", str(export_file), "--partition", "9") == EXIT_ERROR
    assert f"partition version 9 is not in {export_file}" in capsys.readouterr().err
