"""Deploy checks with the real Prometheus tool, `promtool` (Debian's `prometheus` package;
`scripts/bootstrap-tools` puts it in .venv/bin when it is missing): the alert rules pass
`promtool check rules` and their unit tests (deploy/prometheus/alerts.test.yaml) pass
`promtool test rules`; every dashboard and prometheus-adapter query is PromQL that
Prometheus's own parser accepts; the scrape job is a valid Prometheus configuration; every
service's metrics pass `promtool check metrics` (Prometheus's naming conventions).

Without promtool these tests skip with the reason, or fail when
ELDR_TEST_REQUIRE_PROMTOOL=1 (set in .ci/run, where scripts/bootstrap-tools has run). The
check that every alert has a test both ways needs no promtool."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.exposition import generate_latest

from eldr.dev.metricrefs import adapter_rules, dashboard_queries, grafana_query_promql, rules
from support.prereq import missing
from support.service_metrics import service_registries

REPO = Path(__file__).resolve().parents[3]
PROMETHEUS = REPO / "deploy" / "prometheus"
ALERTS = PROMETHEUS / "alerts.yaml"
ALERT_TESTS = PROMETHEUS / "alerts.test.yaml"
DASHBOARD = REPO / "deploy" / "grafana" / "eldr-overview.json"
REQUIRE_ENV = "ELDR_TEST_REQUIRE_PROMTOOL"


def _find_promtool() -> str | None:
    found = shutil.which("promtool")
    if found is not None:
        return found
    beside = Path(sys.executable).parent / "promtool"  # where scripts/bootstrap-tools puts it
    return str(beside) if os.access(beside, os.X_OK) else None


@pytest.fixture(scope="module")
def promtool() -> str:
    found = _find_promtool()
    if found is None:
        reason = (
            "promtool not found (on PATH or in .venv/bin): scripts/bootstrap-tools installs "
            "it from Debian's prometheus package, or apt-get install --no-install-recommends "
            "prometheus"
        )
        missing(REQUIRE_ENV, reason)
    return found


def run(promtool: str, *args: str, cwd: Path | None = None, stdin: bytes = b"") -> str:
    done = subprocess.run(
        [promtool, *args], cwd=cwd, input=stdin, capture_output=True, timeout=60, check=False
    )
    output = (done.stdout + done.stderr).decode()
    assert done.returncode == 0, f"promtool {' '.join(args)}:\n{output}"
    return output


def test_the_alert_rules_pass_promtool_check(promtool: str) -> None:
    output = run(promtool, "check", "rules", str(ALERTS))
    assert "SUCCESS" in output


def test_the_alert_rules_pass_their_unit_tests(promtool: str) -> None:
    output = run(promtool, "test", "rules", ALERT_TESTS.name, cwd=PROMETHEUS)
    assert "SUCCESS" in output


def _labels(series: str) -> dict[str, str]:
    return dict(re.findall(r'(\w+)\s*=\s*"([^"]*)"', series))


def _matches(series: dict[str, str], alert: dict[str, Any]) -> bool:
    """Whether the series agrees with every label it shares with the expected alert."""
    return all(str(alert[k]) == v for k, v in series.items() if k in alert)


def test_every_alert_has_a_test_that_fires_it_and_one_that_does_not() -> None:
    alerts = {r["alert"] for r in rules(ALERTS) if "alert" in r}
    tests = yaml.safe_load(ALERT_TESTS.read_text())["tests"]
    fires: set[str] = set()
    quiet: set[str] = set()
    spared: set[str] = set()
    """Alerts whose firing test has a series that must not fire them (another namespace,
    pod, stream, ...: one that no expected alert's labels match)."""
    for test in tests:
        series = [_labels(s["series"]) for s in test["input_series"]]
        for case in test["alert_rule_test"]:
            name = case["alertname"]
            expected = case.get("exp_alerts") or []
            if not expected:
                quiet.add(name)
                continue
            fires.add(name)
            wanted: list[dict[str, Any]] = [e["exp_labels"] for e in expected]
            if any(all(not _matches(s, e) for e in wanted) for s in series):
                spared.add(name)
    assert alerts - fires == set(), "alerts with no test that fires them"
    assert alerts - quiet == set(), "alerts with no evaluation where they must not fire"
    assert alerts - spared == set(), "alerts whose test has no series that must not fire them"
    assert (fires | quiet) - alerts == set(), "tests of alerts that do not exist"


def _adapter_promql() -> list[str]:
    exprs = []
    for rule in adapter_rules(PROMETHEUS / "adapter-values.yaml"):
        exprs.append(rule["seriesQuery"])
        series = rule["seriesQuery"].split("{")[0]
        exprs.append(
            rule["metricsQuery"]
            .replace("<<.Series>>", series)
            .replace("<<.LabelMatchers>>", 'namespace="eldr"')
            .replace("<<.GroupBy>>", "pod")
        )
    return exprs


def test_dashboard_and_adapter_queries_are_valid_promql(promtool: str, tmp_path: Path) -> None:
    queries = [q for q in map(grafana_query_promql, dashboard_queries(DASHBOARD)) if q]
    queries += _adapter_promql()
    assert len(queries) > 40
    checks = {
        "groups": [
            {
                "name": "queries",
                "rules": [{"record": f"eldr:query_{i}", "expr": q} for i, q in enumerate(queries)],
            }
        ]
    }
    path = tmp_path / "queries.yaml"
    path.write_text(yaml.safe_dump(checks))
    output = run(promtool, "check", "rules", str(path))
    assert f"SUCCESS: {len(queries)} rules found" in output


def test_the_scrape_job_is_a_valid_prometheus_config(promtool: str, tmp_path: Path) -> None:
    config = yaml.safe_load((PROMETHEUS / "scrape-config.yaml").read_text())
    (job,) = config["scrape_configs"]
    # Debian's promtool is built without Kubernetes discovery (it refuses the field): the
    # rest of the job (intervals, relabelling, regexes) is checked with a static target.
    assert job.pop("kubernetes_sd_configs") == [{"role": "pod"}]
    job["static_configs"] = [{"targets": ["pod:9100"]}]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    output = run(promtool, "check", "config", str(path))
    assert "SUCCESS" in output


def test_every_services_metrics_pass_promtool_lint(promtool: str) -> None:
    for name, registry in service_registries().items():
        output = run(promtool, "check", "metrics", stdin=generate_latest(registry))
        assert output.strip() == "", f"{name}: {output}"
