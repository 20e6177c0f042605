"""Dashboards, alert rules and prometheus-adapter rules reference only series the services
write (each service's registry as its shipped code builds it) or, named explicitly, the NATS
exporter's and Prometheus's own series. The e2e test compares the same references with a
live scrape."""

from __future__ import annotations

import json
import re
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import generate_latest

from eldr.dev.metricrefs import (
    NATS_EXPORTER_METRICS,
    PROMETHEUS_SERIES,
    adapter_metric_names,
    dashboard_metric_names,
    grafana_query_metric_names,
    promql_metric_names,
    rules,
    rules_metric_names,
    series_names,
)
from support.service_metrics import SERVICES, service_registries

REPO = Path(__file__).resolve().parents[3]
DASHBOARD = REPO / "deploy" / "grafana" / "eldr-overview.json"
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yaml"
ADAPTER = REPO / "deploy" / "prometheus" / "adapter-values.yaml"


@pytest.fixture(scope="module")
def registries() -> dict[str, CollectorRegistry]:
    return service_registries()


@pytest.fixture(scope="module")
def exported(registries: dict[str, CollectorRegistry]) -> frozenset[str]:
    return frozenset().union(*(series_names(r) for r in registries.values()))


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


# --- the services' registries and the series they write ------------------------------------


def test_every_service_has_its_registry() -> None:
    assert set(SERVICES) == {e.name for e in entry_points(group="eldr.services")}


def test_the_registries_hold_metrics_of_every_kind(
    registries: dict[str, CollectorRegistry],
) -> None:
    kinds = {f.name: f.type for r in registries.values() for f in r.collect()}
    assert kinds["eldr_router_decisions"] == "counter"
    assert kinds["eldr_router_decision_latency_seconds"] == "histogram"
    assert kinds["eldr_signature_cache_bytes"] == "gauge"
    assert kinds["eldr_signature_cache_hits"] == "counter"  # a CounterMetricFamily
    assert kinds["eldr_service_info"] == "gauge"
    assert kinds["eldr_router_worker_requests"] == "gauge"


def test_every_service_writes_the_bus_and_info_series(
    registries: dict[str, CollectorRegistry],
) -> None:
    for name, registry in registries.items():
        written = series_names(registry)
        assert "eldr_service_info" in written, name
        assert "eldr_bus_messages_received_total" in written, name
        assert "eldr_bus_handler_duration_seconds_bucket" in written, name


class _Families:
    def collect(self) -> list[object]:
        return [
            CounterMetricFamily("fam_hits", "h", value=1),
            GaugeMetricFamily("fam_bytes", "b", value=1),
            GaugeMetricFamily("fam_by_worker", "w", labels=["worker"]),  # no worker yet
        ]


def test_series_names_are_what_prometheus_client_writes() -> None:
    def build() -> tuple[CollectorRegistry, list[Counter | Gauge | Histogram]]:
        registry = CollectorRegistry()
        labelled = [
            Counter("c_things_total", "c", ["kind"], registry=registry),
            Gauge("g_level", "g", ["kind"], registry=registry),
            Histogram("h_seconds", "h", ["kind"], registry=registry),
        ]
        Info("i_build", "i", registry=registry).info({"version": "1"})
        registry.register(_Families())  # type: ignore[arg-type]
        return registry, labelled

    registry, _ = build()
    names = series_names(registry)  # the labelled metrics have no child yet
    filled, labelled = build()
    for metric in labelled:
        metric.labels("x")
    written = {
        line.split("{")[0].split(" ")[0]
        for line in generate_latest(filled).decode().splitlines()
        if line and not line.startswith("#")
    }
    assert names == written | {"fam_by_worker"}
    assert {"c_things_total", "c_things_created", "h_seconds_bucket", "i_build_info"} <= names


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


def test_expressions_that_do_not_parse_are_refused() -> None:
    with pytest.raises(ValueError, match="braces"):
        promql_metric_names('a{x="y"')
    with pytest.raises(ValueError, match="brackets"):
        promql_metric_names("rate(a[$window])")  # not a Grafana range variable


def test_grafana_variable_queries() -> None:
    assert grafana_query_metric_names("label_values(a{x='1'}, namespace)") == {"a"}
    assert grafana_query_metric_names("label_values(namespace)") == set()
    assert grafana_query_metric_names("sum(rate(b_total[5m]))") == {"b_total"}
