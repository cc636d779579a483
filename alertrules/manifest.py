"""Turn the plain rule files into their other forms: a PrometheusRule manifest, re-based links,
time-compressed copies for demos.

All transformations are pure functions over the parsed groups, so the plain files stay the one
source of truth and every form is reproducible (a test regenerates and compares).
"""

from __future__ import annotations

import copy
import re
from typing import Any, Iterable

__all__ = ["DEFAULT_RUNBOOK_BASE_URL", "DEFAULT_GRAFANA_URL", "rebase_links", "scale_durations",
           "prometheus_rule", "parse_duration", "format_duration"]

#: The link bases written in the source rule files; re-based at generation time. The runbook base
#: is the repository's alertrules/runbooks on its default branch (pyproject.toml [project.urls] Runbooks),
#: so every alert's runbook link opens a real page unless an installation re-bases it.
DEFAULT_RUNBOOK_BASE_URL = "https://gpulens.dev/source/blob/main/alertrules/runbooks"
DEFAULT_GRAFANA_URL = "http://localhost:3000"

Groups = list[dict[str, Any]]

_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
_DURATION = re.compile(r"^(?:(\d+)y)?(?:(\d+)w)?(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?(?:(\d+)ms)?$")
# a duration inside PromQL: a range `[5m]`, a subquery `[30m:1m]`, or `offset 10m`
_IN_EXPR = re.compile(r"(\[|:|offset\s+)(\d+(?:ms|[smhdwy])(?:\d+(?:ms|[smhdwy]))*)(?=[\]:\s)]|$)")


def parse_duration(text: str) -> float:
    """Prometheus duration -> seconds (`1h30m` -> 5400)."""
    text = text.strip()
    if text == "0":
        return 0.0
    m = _DURATION.match(text)
    if not text or not m:
        raise ValueError(f"not a Prometheus duration: {text!r}")
    parts = m.groups()
    units = ["y", "w", "d", "h", "m", "s", "ms"]
    return float(sum(int(p) * _UNITS[u] for p, u in zip(parts, units) if p))


def format_duration(seconds: float) -> str:
    """Seconds -> the shortest Prometheus duration, at least 1s (`5400` -> `1h30m`)."""
    total = max(1, round(seconds))
    out = ""
    for unit in ("h", "m", "s"):
        size = _UNITS[unit]
        if total >= size:
            out += f"{total // size}{unit}"
            total %= size
    return out


def _map_annotations(groups: Groups, fn) -> Groups:
    groups = copy.deepcopy(groups)
    for g in groups:
        for r in g["rules"]:
            if "annotations" in r:
                r["annotations"] = {k: fn(k, v) for k, v in r["annotations"].items()}
    return groups


def rebase_links(groups: Groups, *, runbook_base_url: str = DEFAULT_RUNBOOK_BASE_URL,
                 grafana_url: str = DEFAULT_GRAFANA_URL) -> Groups:
    """Point `runbook_url` and `dashboard_url` at this installation's docs and Grafana; an empty
    `grafana_url` (no Grafana) drops `dashboard_url`, so no alert carries a link that cannot open."""
    def fix(key: str, value: str) -> str:
        if key == "runbook_url" and value.startswith(DEFAULT_RUNBOOK_BASE_URL + "/"):
            return runbook_base_url.rstrip("/") + value[len(DEFAULT_RUNBOOK_BASE_URL):]
        if key == "dashboard_url" and value.startswith(DEFAULT_GRAFANA_URL + "/"):
            return grafana_url.rstrip("/") + value[len(DEFAULT_GRAFANA_URL):]
        return value
    groups = _map_annotations(groups, fix)
    if not grafana_url:
        for r in (r for g in groups for r in g["rules"]):
            r.get("annotations", {}).pop("dashboard_url", None)
    return groups


def scale_durations(groups: Groups, factor: float) -> Groups:
    """Multiply every duration (rate windows, offsets, `for:`) by `factor`.

    For the embedded demo (`gpulens up`), which scrapes every few seconds and must show an alert
    within minutes: factor 1/30 turns 5m windows into 10s and the 35m history into 70s. The
    relations between windows, and so the behaviour the promtool tests prove, are unchanged.
    """
    if factor <= 0:
        raise ValueError("time scale must be positive")
    if factor == 1:
        return copy.deepcopy(groups)

    def scaled(text: str) -> str:
        return format_duration(parse_duration(text) * factor)

    groups = copy.deepcopy(groups)
    for g in groups:
        if "interval" in g:
            g["interval"] = scaled(g["interval"])
        for r in g["rules"]:
            r["expr"] = _IN_EXPR.sub(lambda m: m.group(1) + scaled(m.group(2)), r["expr"])
            for key in ("for", "keep_firing_for"):
                if key in r:
                    r[key] = scaled(r[key])
    return groups


def prometheus_rule(groups: Iterable[dict[str, Any]], *, name: str = "gpulens",
                    namespace: str | None = None, labels: dict[str, str] | None = None) -> dict[str, Any]:
    """A monitoring.coreos.com/v1 PrometheusRule holding `groups` unchanged.

    `labels` is where kube-prometheus-stack's rule selector goes (e.g. `release: <name>`).
    """
    metadata: dict[str, Any] = {"name": name}
    if namespace:
        metadata["namespace"] = namespace
    metadata["labels"] = {"app.kubernetes.io/name": "gpulens", "app.kubernetes.io/component": "alertrules",
                          **(labels or {})}
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule", "metadata": metadata,
            "spec": {"groups": copy.deepcopy(list(groups))}}
