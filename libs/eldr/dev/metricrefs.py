"""Which Prometheus metrics the services export, and which ones dashboards and rules use.

`exported_metrics` reads the source (libs/eldr and services, statically: every
`Counter(...)`, `Gauge(...)`, `Histogram(...)`, `*MetricFamily(...)` with a literal name) and
`exported_series` expands each metric into the series `prometheus_client` writes (a counter
`x` -> `x_total` and `x_created`; a histogram -> `_bucket`, `_sum`, `_count`, `_created`).
`promql_metric_names` lists the metric names a PromQL expression selects; the `*_metric_names`
functions apply it to a Grafana dashboard, a Prometheus rules file and prometheus-adapter
values. Tests compare the two sets; the e2e test compares the references with a live
`/metrics` scrape.

Names that are not ELDR's are listed with their source: `NATS_EXPORTER_METRICS` (the
prometheus-nats-exporter sidecar of the NATS chart, `-jsz=all -prefix=nats`) and
`PROMETHEUS_SERIES` (written by Prometheus itself for every target).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

REPO_ROOT = Path(__file__).resolve().parents[3]
SOURCE_ROOTS = (REPO_ROOT / "libs" / "eldr", REPO_ROOT / "services")

MetricKind = Literal["counter", "gauge", "histogram", "summary", "info", "enum"]
_CONSTRUCTORS: dict[str, tuple[MetricKind, bool]] = {
    # class name -> (kind, exports _created)
    "Counter": ("counter", True),
    "Gauge": ("gauge", False),
    "Histogram": ("histogram", True),
    "Summary": ("summary", True),
    "Info": ("info", False),
    "Enum": ("enum", False),
    "CounterMetricFamily": ("counter", False),
    "GaugeMetricFamily": ("gauge", False),
    "HistogramMetricFamily": ("histogram", False),
    "SummaryMetricFamily": ("summary", False),
    "InfoMetricFamily": ("info", False),
}
_METRIC_NAME_RE = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")

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


@dataclass(frozen=True)
class MetricDef:
    name: str
    """The family name as written in the code (a counter's may end in _total)."""
    kind: MetricKind
    created: bool
    """Whether `prometheus_client` also writes a `_created` series."""
    path: Path

    def series(self) -> tuple[str, ...]:
        base = self.name
        if self.kind == "counter":
            base = base.removesuffix("_total")
            names = [base + "_total"]
        elif self.kind == "histogram":
            names = [base + "_bucket", base + "_sum", base + "_count"]
        elif self.kind == "summary":
            names = [base, base + "_sum", base + "_count"]
        elif self.kind == "info":
            names = [base.removesuffix("_info") + "_info"]
        else:
            names = [base]
        if self.created:
            names.append(base + "_created")
        return tuple(names)


def exported_metrics(roots: Iterable[Path] = SOURCE_ROOTS) -> dict[str, MetricDef]:
    """Every metric defined with a literal name under `roots`, by name."""
    found: dict[str, MetricDef] = {}
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for node in ast.walk(tree):
                metric = _metric_of(node, path)
                if metric is not None:
                    found[metric.name] = metric
    return found


def _metric_of(node: ast.AST, path: Path) -> MetricDef | None:
    if not isinstance(node, ast.Call):
        return None
    func = node.func
    name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
    if name not in _CONSTRUCTORS:
        return None
    arg: ast.expr | None = node.args[0] if node.args else None
    for keyword in node.keywords:
        if keyword.arg == "name":
            arg = keyword.value
    if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
        return None
    if not _METRIC_NAME_RE.match(arg.value):
        return None
    kind, created = _CONSTRUCTORS[name]
    return MetricDef(arg.value, kind, created, path)


def exported_series(roots: Iterable[Path] = SOURCE_ROOTS) -> frozenset[str]:
    """Every series name the services can write on /metrics."""
    return frozenset(s for m in exported_metrics(roots).values() for s in m.series())


# --- PromQL ---------------------------------------------------------------------------------

_KEYWORDS = frozenset(
    {
        "and",
        "or",
        "unless",
        "bool",
        "offset",
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "inf",
        "nan",
        "atan2",
        "start",
        "end",
        # aggregation operators: `sum by (x) (...)` puts a keyword between name and "("
        "sum",
        "min",
        "max",
        "avg",
        "group",
        "stddev",
        "stdvar",
        "count",
        "count_values",
        "bottomk",
        "topk",
        "quantile",
        "limitk",
        "limit_ratio",
    }
)
_LABEL_LIST_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
_IDENT_START = re.compile(r"[A-Za-z_:]")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_GRAFANA_VAR = re.compile(r"\$(\{[^}]*\}|[A-Za-z_][A-Za-z0-9_]*)")


def promql_metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (functions, keywords, labels and grouping
    lists excluded). Grafana variables (`$var`, `${var}`) are treated as opaque."""
    text = _GRAFANA_VAR.sub(" ", expr)
    names: set[str] = set()
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in "\"'`":
            i = _skip_string(text, i)
        elif c == "{":
            i = _skip_balanced(text, i, "{", "}")
        elif c == "[":
            i = _skip_balanced(text, i, "[", "]")
        elif c.isdigit() or (c == "." and i + 1 < n and text[i + 1].isdigit()):
            while i < n and (text[i].isalnum() or text[i] in "._"):
                i += 1
        elif _IDENT_START.match(c):
            m = _IDENT.match(text, i)
            assert m is not None
            word = m.group(0)
            i = m.end()
            j = i
            while j < n and text[j].isspace():
                j += 1
            followed_by_paren = j < n and text[j] == "("
            if word in _LABEL_LIST_KEYWORDS and followed_by_paren:
                i = _skip_balanced(text, j, "(", ")")
            elif followed_by_paren or word in _KEYWORDS:
                continue
            else:
                names.add(word)
        else:
            i += 1
    return names


def _skip_string(text: str, i: int) -> int:
    quote = text[i]
    i += 1
    while i < len(text) and text[i] != quote:
        i += 2 if text[i] == "\\" and quote != "`" else 1
    return i + 1


def _skip_balanced(text: str, i: int, open_: str, close: str) -> int:
    depth = 0
    while i < len(text):
        c = text[i]
        if c in "\"'`":
            i = _skip_string(text, i)
            continue
        if c == open_:
            depth += 1
        elif c == close:
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise ValueError(f"unbalanced {open_}{close} in {text!r}")


_LABEL_VALUES_RE = re.compile(r"^\s*label_values\((?P<args>.*)\)\s*$", re.DOTALL)


def grafana_query_metric_names(query: str) -> set[str]:
    """A Grafana Prometheus query: PromQL, or a variable query such as
    `label_values(selector, label)` / `label_values(label)`."""
    m = _LABEL_VALUES_RE.match(query)
    if m is None:
        return promql_metric_names(query)
    selector, sep, _label = m.group("args").rpartition(",")
    return promql_metric_names(selector) if sep else set()


# --- files ----------------------------------------------------------------------------------


def dashboard_metric_names(path: Path) -> set[str]:
    """Metric names of every panel target and variable query of a Grafana dashboard."""
    dashboard = json.loads(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for query in _dashboard_queries(dashboard):
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
