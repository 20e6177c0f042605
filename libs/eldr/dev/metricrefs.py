"""Which Prometheus series the services write, and which ones dashboards and rules read.

`series_names(registry)` lists the series a registry writes, as `prometheus_client` names
them (a counter `x` -> `x_total` and `x_created`; a histogram -> `_bucket`, `_sum`,
`_count`, `_created`): the tests build each service's registry with the shipped metrics
code (tests/support/service_metrics.py) and compare. `promql_metric_names` lists the
metric names a PromQL expression selects, from the expression's syntax tree
(`promql_parser`, a port of Prometheus's own parser); the `*_metric_names` functions apply
it to a Grafana dashboard, a Prometheus rules file and prometheus-adapter values. The e2e
test compares the same references with a live `/metrics` scrape. `promtool` (Debian's
`prometheus` package) checks the expressions and the alerts themselves
(tests/unit/deploy/test_deploy_promtool.py).

Hand-written, for want of a library: reading the queries out of a dashboard (Grafana's
JSON model) and out of prometheus-adapter's values, Grafana's `label_values(...)` variable
queries, and the time-range variables (`$__rate_interval`, ...) that Grafana substitutes
before Prometheus sees a query.

Names that are not ELDR's are listed with their source: `NATS_EXPORTER_METRICS` (the
prometheus-nats-exporter sidecar of the NATS chart, `-jsz=all -prefix=nats`) and
`PROMETHEUS_SERIES` (written by Prometheus itself for every target).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import promql_parser
from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, Info, Summary

NATS_EXPORTER_METRICS = frozenset(
    {
        # jsz collector, consumer level: labels stream_name, consumer_name, is_consumer_leader
        "nats_consumer_num_pending",
        "nats_consumer_num_ack_pending",
        "nats_consumer_num_redelivered",
        # jsz collector, stream level: label stream_name
        "nats_stream_total_messages",
        "nats_stream_total_bytes",
        "nats_stream_last_seq",
    }
)
PROMETHEUS_SERIES = frozenset({"up", "scrape_duration_seconds", "scrape_samples_scraped"})

_METRIC_OF_TYPE: dict[str, Any] = {
    "counter": Counter,
    "gauge": Gauge,
    "histogram": Histogram,
    "summary": Summary,
    "info": Info,
    "stateset": Enum,
}


def series_names(registry: CollectorRegistry) -> frozenset[str]:
    """The series names `registry` writes on /metrics.

    A family with samples names them itself. A labelled metric with no child yet has
    none: its names are those of an unlabelled metric of the same type and name, which
    `prometheus_client` writes on a scratch registry."""
    names: set[str] = set()
    for family in registry.collect():
        if family.samples:
            names.update(sample.name for sample in family.samples)
            continue
        scratch = CollectorRegistry()
        metric_type = _METRIC_OF_TYPE[family.type]
        extra = {"states": ["a"]} if family.type == "stateset" else {}
        metric_type(family.name, family.documentation or "-", registry=scratch, **extra)
        names.update(s.name for f in scratch.collect() for s in f.samples)
    return frozenset(names)


# --- PromQL ---------------------------------------------------------------------------------

_GRAFANA_RANGE = re.compile(
    r"\$(?:__rate_interval|__interval|__range)\b|\$\{__(?:rate_interval|interval|range)\}"
)
"""Grafana's time-range variables, which it replaces by a duration before the query goes to
Prometheus (any other `$variable` must stand inside a label matcher's string)."""


def grafana_promql(query: str) -> str:
    """A dashboard query as Prometheus gets it (with 5m for Grafana's range variables)."""
    return _GRAFANA_RANGE.sub("5m", query)


def promql_metric_names(expr: str) -> set[str]:
    """The metric names an expression selects: each vector selector's name, or its
    `__name__="..."` matcher. Raises ValueError if the expression does not parse."""
    names: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            if node.name:
                names.add(node.name)
            for matcher in node.matchers.matchers:
                if matcher.name == "__name__" and matcher.op == promql_parser.MatchOp.Equal:
                    names.add(matcher.value)

    promql_parser.walk(promql_parser.parse(grafana_promql(expr)), visit)
    return names


_LABEL_VALUES_RE = re.compile(r"^\s*label_values\((?P<args>.*)\)\s*$", re.DOTALL)


def grafana_query_metric_names(query: str) -> set[str]:
    """A Grafana Prometheus query: PromQL, or a variable query such as
    `label_values(selector, label)` / `label_values(label)` (Grafana's own syntax)."""
    m = _LABEL_VALUES_RE.match(query)
    if m is None:
        return promql_metric_names(query)
    selector, sep, _label = m.group("args").rpartition(",")
    return promql_metric_names(selector) if sep else set()


def grafana_query_promql(query: str) -> str | None:
    """The PromQL a Grafana query sends (None for `label_values(label)`)."""
    m = _LABEL_VALUES_RE.match(query)
    if m is None:
        return grafana_promql(query)
    selector, sep, _label = m.group("args").rpartition(",")
    return grafana_promql(selector) if sep else None


# --- files ----------------------------------------------------------------------------------


def dashboard_queries(path: Path) -> list[str]:
    """Every panel target and variable query of a Grafana dashboard."""
    return list(_dashboard_queries(json.loads(path.read_text(encoding="utf-8"))))


def dashboard_metric_names(path: Path) -> set[str]:
    """Metric names of every panel target and variable query of a Grafana dashboard."""
    names: set[str] = set()
    for query in dashboard_queries(path):
        names |= grafana_query_metric_names(query)
    return names


def _dashboard_queries(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        if isinstance(node.get("expr"), str):
            yield node["expr"]
        if node.get("type") == "query" and "query" in node:
            query = node["query"]
            yield query["query"] if isinstance(query, dict) else str(query)
        for value in node.values():
            yield from _dashboard_queries(value)
    elif isinstance(node, list):
        for value in node:
            yield from _dashboard_queries(value)


def _load_yaml(path: Path) -> Any:
    import yaml  # type: ignore[import-untyped]  # dev dependency, imported when used

    return yaml.safe_load(path.read_text(encoding="utf-8"))


def rules(path: Path) -> list[dict[str, Any]]:
    """The rules of a Prometheus rules file (`groups: [{name, rules: [...]}]`)."""
    data = _load_yaml(path)
    return [rule for group in data["groups"] for rule in group["rules"]]


def rules_metric_names(path: Path) -> set[str]:
    """Metric names the rules' expressions select, less the series the file records."""
    all_rules = rules(path)
    recorded = {r["record"] for r in all_rules if "record" in r}
    names: set[str] = set()
    for rule in all_rules:
        names |= promql_metric_names(rule["expr"])
    return names - recorded


def adapter_rules(path: Path) -> list[dict[str, Any]]:
    """prometheus-adapter rules (custom and external) of its Helm values."""
    data = _load_yaml(path)["rules"]
    return [*data.get("custom", []), *data.get("external", [])]


def adapter_metric_names(path: Path) -> set[str]:
    """Series the prometheus-adapter rules read (their `seriesQuery` selectors)."""
    names: set[str] = set()
    for rule in adapter_rules(path):
        names |= promql_metric_names(rule["seriesQuery"])
    return names
