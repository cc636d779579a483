"""Which metric names a PromQL expression reads, and the names gpulens may read.

Parsing itself is left to the real Prometheus (promtool / the query API): an expression that it
rejects never gets here. What remains is lexical: after string literals, label-matcher braces and
grouping-label lists are removed, every identifier that is not a function, aggregation or keyword
is a metric name. Prometheus has no offline "list the selectors" command, hence this helper.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from gpulens.exporter.catalogue import CATALOGUE_PATH  # the exporter's metric catalogue (package data)

__all__ = ["metric_names", "catalogue_metrics", "capture_plane_metrics", "SCRAPE_METRICS", "CATALOGUE_PATH", "FUNCTIONS",
           "KEYWORDS"]

#: series Prometheus itself writes for every scrape target
SCRAPE_METRICS = frozenset({"up"})


AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
                "bottomk", "topk", "quantile", "limitk", "limit_ratio"}
FUNCTIONS = AGGREGATIONS | {
    "abs", "absent", "absent_over_time", "ceil", "changes", "clamp", "clamp_max", "clamp_min",
    "day_of_month", "day_of_week", "day_of_year", "days_in_month", "delta", "deriv", "exp", "floor",
    "histogram_count", "histogram_sum", "histogram_fraction", "histogram_quantile", "holt_winters",
    "double_exponential_smoothing", "hour", "idelta", "increase", "irate", "label_join",
    "label_replace", "ln", "log2", "log10", "minute", "month", "predict_linear", "rate", "resets",
    "round", "scalar", "sgn", "sort", "sort_desc", "sort_by_label", "sort_by_label_desc", "sqrt",
    "time", "timestamp", "vector", "year", "avg_over_time", "min_over_time", "max_over_time",
    "sum_over_time", "count_over_time", "quantile_over_time", "stddev_over_time",
    "stdvar_over_time", "last_over_time", "present_over_time", "mad_over_time", "acos", "acosh",
    "asin", "asinh", "atan", "atanh", "cos", "cosh", "sin", "sinh", "tan", "tanh", "deg", "rad", "pi",
}
KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
            "offset", "bool", "atan2", "inf", "nan", "start", "end"}

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_COMMENT = re.compile(r"#[^\n]*")
_NAME_MATCHER = re.compile(r'\{[^{}]*?__name__\s*=\s*(STR\d+)[^{}]*\}')
_BRACES = re.compile(r"\{[^{}]*\}")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_IDENT = re.compile(r"(?<![\w:.])([a-zA-Z_:][a-zA-Z0-9_:]*)")
_NUMBER_SUFFIX = re.compile(r"\b\d[\d.eE+-]*[a-zA-Z]+\b")


def metric_names(expr: str) -> set[str]:
    """Metric names selected by `expr` (including `{__name__="x"}`); empty for pure arithmetic."""
    strings: list[str] = []

    def keep(m: re.Match) -> str:
        strings.append(m.group(0)[1:-1])
        return f"STR{len(strings) - 1}"

    text = _STRING.sub(keep, expr)
    text = _COMMENT.sub(" ", text)
    names = {strings[int(m.group(1)[3:])] for m in _NAME_MATCHER.finditer(text)}
    text = _BRACES.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _NUMBER_SUFFIX.sub(" ", text)  # durations outside brackets (offset 5m), 1e6
    for m in _IDENT.finditer(text):
        ident = m.group(1)
        if re.fullmatch(r"STR\d+", ident):
            continue
        rest = text[m.end():].lstrip()
        if ident in KEYWORDS:
            continue
        if ident in FUNCTIONS and (rest.startswith("(") or ident in AGGREGATIONS and
                                   re.match(r"(by|without)\b", rest)):
            continue
        names.add(ident)
    return names


def catalogue_metrics(path: Path = CATALOGUE_PATH) -> set[str]:
    """Every metric name in the exporter's catalogue (exporter/metrics.yaml)."""
    doc = yaml.safe_load(path.read_text())
    return {m["name"] for m in doc["metrics"]}


def capture_plane_metrics() -> set[str]:
    """Every sample name the agent and the coordinator serve (docs/metrics.md), read from their
    metric modules, so a rule cannot name a capture-plane metric that does not exist."""
    from gpulens.capture.agent.metrics import AgentMetrics
    from gpulens.capture.coordinator.metrics import CoordinatorMetrics
    names: set[str] = set()
    for metrics in (AgentMetrics(), CoordinatorMetrics()):
        for family in metrics.registry.collect():  # families without children have no samples yet
            if family.type == "counter":
                names.add(family.name + "_total")
            elif family.type == "histogram":
                names |= {family.name + suffix for suffix in ("_bucket", "_count", "_sum")}
            else:
                names.add(family.name)
    return names
