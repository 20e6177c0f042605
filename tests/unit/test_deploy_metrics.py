"""Dashboards, alert rules and prometheus-adapter rules reference only metrics the services
export (read statically from the code) or, named explicitly, the NATS exporter's and
Prometheus's own series. The e2e test compares the same references with a live scrape."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import generate_latest

from eldr.dev.metricrefs import (
    NATS_EXPORTER_METRICS,
    PROMETHEUS_SERIES,
    MetricDef,
    adapter_metric_names,
    dashboard_metric_names,
    exported_metrics,
    exported_series,
    grafana_query_metric_names,
    promql_metric_names,
    rules,
    rules_metric_names,
)

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "eldr-overview.json"
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yaml"
ADAPTER = REPO / "deploy" / "prometheus" / "adapter-values.yaml"


@pytest.fixture(scope="module")
def definitions() -> dict[str, MetricDef]:
    return exported_metrics()


@pytest.fixture(scope="module")
def exported(definitions: dict[str, MetricDef]) -> frozenset[str]:
    return frozenset(s for m in definitions.values() for s in m.series())


def unknown(names: set[str], exported: frozenset[str]) -> list[str]:
    return sorted(names - exported - NATS_EXPORTER_METRICS - PROMETHEUS_SERIES)


def test_the_dashboard_uses_only_exported_metrics(exported: frozenset[str]) -> None:
    names = dashboard_metric_names(DASHBOARD)
    assert names
    assert unknown(names, exported) == []


def test_the_alert_rules_use_only_exported_metrics(exported: frozenset[str]) -> None:
    names = rules_metric_names(ALERTS)
    assert names
    assert unknown(names, exported) == []


def test_the_adapter_reads_an_exported_counter(exported: frozenset[str]) -> None:
    names = adapter_metric_names(ADAPTER)
    assert names == {"eldr_router_decisions_total"}
    assert names <= exported


def test_the_dashboard_covers_what_operators_look_at() -> None:
    names = dashboard_metric_names(DASHBOARD)
    for needed in (
        "eldr_router_decision_latency_seconds_bucket",
        "eldr_router_decisions_total",
        "eldr_router_worker_requests",
        "eldr_simdecode_step_union_experts_sum",
        "eldr_signature_cache_hits_total",
        "eldr_signature_cache_bytes",
        "eldr_router_partition_version",
        "eldr_trainer_last_fit_mean_inertia",
    ):
        assert needed in names, needed


def test_the_alerts_cover_fallbacks_stale_workers_lag_and_refit_failures() -> None:
    by_name = {r["alert"]: r for r in rules(ALERTS) if "alert" in r}
    covered = {
        "eldr_router_decisions_total": "fallback",
        "eldr_router_live_workers": "stale workers",
        "nats_consumer_num_pending": "consumer lag",
        "eldr_trainer_refit_errors_total": "refit failures",
    }
    used = set().union(*(promql_metric_names(r["expr"]) for r in by_name.values()))
    for metric, what in covered.items():
        assert metric in used, what
    for name, rule in by_name.items():
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert rule["annotations"]["summary"], name
        if "for" in rule:
            assert re.fullmatch(r"\d+[smh]", rule["for"]), name


def test_dashboard_panels_have_unique_ids_and_datasource_variables() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${datasource}"


# --- the static scan and the series it expects ----------------------------------------------


def test_the_scan_finds_metrics_of_every_kind(definitions: dict[str, MetricDef]) -> None:
    found = definitions
    assert found["eldr_router_decisions_total"].kind == "counter"
    assert found["eldr_router_decision_latency_seconds"].kind == "histogram"
    assert found["eldr_signature_cache_bytes"].kind == "gauge"
    assert found["eldr_signature_cache_hits"].created is False  # a CounterMetricFamily
    assert found["eldr_service_info"].kind == "gauge"
    assert found["eldr_router_worker_requests"].kind == "gauge"


class _Families:
    def collect(self) -> list[object]:
        return [
            CounterMetricFamily("fam_hits", "h", value=1),
            GaugeMetricFamily("fam_bytes", "b", value=1),
        ]


def test_series_expansion_matches_prometheus_client(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    Counter("c_things_total", "c", registry=registry).inc()
    Gauge("g_level", "g", registry=registry).set(1)
    Histogram("h_seconds", "h", registry=registry).observe(0.1)
    registry.register(_Families())  # type: ignore[arg-type]
    written = {
        line.split("{")[0].split(" ")[0]
        for line in generate_latest(registry).decode().splitlines()
        if line and not line.startswith("#")
    }
    source = tmp_path / "m.py"
    source.write_text(
        "Counter('c_things_total', 'c')\nGauge('g_level', 'g')\nHistogram('h_seconds', 'h')\n"
        "CounterMetricFamily('fam_hits', 'h')\nGaugeMetricFamily('fam_bytes', 'b')\n"
    )
    assert exported_series([tmp_path]) == written


def test_names_that_are_not_literals_are_not_guessed(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text("Counter(NAME, 'c')\nGauge(f'x_{y}', 'g')\n")
    assert exported_metrics([tmp_path]) == {}


def test_metric_def_series() -> None:
    assert MetricDef("a_total", "counter", True, REPO).series() == ("a_total", "a_created")
    assert MetricDef("b", "histogram", False, REPO).series() == ("b_bucket", "b_sum", "b_count")


# --- PromQL ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("up", {"up"}),
        ('rate(a_total{x="y", z=~"b_total|c"}[5m])', {"a_total"}),
        ("sum by (le, pod) (rate(h_bucket[$__rate_interval]))", {"h_bucket"}),
        ("histogram_quantile(0.99, sum without (pod) (rate(h_bucket[1m])))", {"h_bucket"}),
        ("a / on(pod) group_left(node) b", {"a", "b"}),
        ("a > bool 0.5 and b offset 5m unless c", {"a", "b", "c"}),
        ("max_over_time(a[30m:1m]) - max(a)", {"a"}),
        ('label_replace(a, "dst", "$1", "src", "(.*)")', {"a"}),
        ('topk(5, count by (x) (a{l="sum(b)"}))', {"a"}),
        ("1e3 * a + 0.5", {"a"}),
        ('a{namespace=~"$namespace", pod="${pod}"}', {"a"}),
        ("scalar(max(a)) - b", {"a", "b"}),
    ],
)
def test_promql_metric_names(expr: str, names: set[str]) -> None:
    assert promql_metric_names(expr) == names


def test_unbalanced_expressions_are_refused() -> None:
    with pytest.raises(ValueError, match="unbalanced"):
        promql_metric_names('a{x="y"')


def test_grafana_variable_queries() -> None:
    assert grafana_query_metric_names("label_values(a{x='1'}, namespace)") == {"a"}
    assert grafana_query_metric_names("label_values(namespace)") == set()
    assert grafana_query_metric_names("sum(rate(b_total[5m]))") == {"b_total"}
