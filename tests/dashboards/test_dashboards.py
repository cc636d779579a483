"""Dashboards as code: the committed JSON is what the code generates, every query parses (real
promtool) and reads only catalogue metrics, recording rules or Prometheus' ALERTS, and the JSON
follows the provisioning conventions (datasource variable, no __inputs, stable uids, tag query)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from gpulens.alertrules import promql, ruleset
from gpulens.dashboards import build
from tests.conftest import missing

PROMTOOL = "/usr/bin/promtool"
PROMETHEUS_OWN = {"ALERTS"}  # written by Prometheus itself for every alerting rule
VARIABLES = {"$__rate_interval": "5m", "$namespace": ".*", "$workload": ".*", "$pod": ".*", "$node": ".*", "$gpu": ".*"}
LABEL_VALUES = re.compile(r"^label_values\((.+),\s*[a-zA-Z_][a-zA-Z0-9_]*\)$")

DASHBOARDS = {name: json.loads((build.JSON_DIR / name).read_text()) for name in build.DASHBOARDS}


def as_promql(expr: str) -> str:
    """A dashboard query as Prometheus would receive it: variables substituted, and Grafana's
    label_values(selector, label) reduced to its selector."""
    m = LABEL_VALUES.match(expr.strip())
    if m:
        expr = m.group(1)
    for var, value in VARIABLES.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"unsubstituted variable in {expr!r}"
    return expr


def promtool_parses(tmp_path: Path, exprs: list[str]) -> subprocess.CompletedProcess:
    rules = {"groups": [{"name": "dashboard-queries", "rules": [
        {"record": f"dashboard_query_{i}", "expr": e} for i, e in enumerate(exprs)]}]}
    path = tmp_path / "queries.rules.yml"
    path.write_text(yaml.safe_dump(rules))
    return subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def promtool() -> str:
    if not Path(PROMTOOL).exists():
        missing("promtool not installed")
    return PROMTOOL


def test_committed_json_is_what_the_code_generates():
    rendered = build.render()
    for name, text in rendered.items():
        assert (build.JSON_DIR / name).read_text() == text, f"dashboards/json/{name} is stale: python -m gpulens.dashboards.build"
    assert sorted(p.name for p in build.JSON_DIR.glob("*.json")) == sorted(rendered)


def test_check_reports_stale_json(tmp_path):
    assert build.main(["--out", str(tmp_path)]) == 0
    assert build.main(["--out", str(tmp_path), "--check"]) == 0
    path = tmp_path / "gpulens-workload.json"
    path.write_text(path.read_text().replace("Launches per second", "Launches", 1))
    assert build.main(["--out", str(tmp_path), "--check"]) == 1


def test_every_query_parses(tmp_path, promtool):
    queries = build.all_queries()
    assert len(queries) > 40
    result = promtool_parses(tmp_path, [as_promql(q) for _, q in queries])
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(queries)} rules found" in result.stdout


def test_the_parse_check_rejects_a_broken_query(tmp_path, promtool):
    result = promtool_parses(tmp_path, ["sum by (pod) (rate(gpulens_kernel_launches_total[5m])"])
    assert result.returncode != 0


def test_queries_read_only_catalogue_metrics_and_recording_rules():
    allowed = promql.catalogue_metrics() | set(ruleset.load().record_names) | PROMETHEUS_OWN
    for where, expr in build.all_queries():
        used = promql.metric_names(as_promql(expr))
        assert used, f"{where}: reads no metric"
        assert used <= allowed, f"{where}: unknown metrics {used - allowed}"


def test_the_name_check_would_catch_an_unknown_metric():
    allowed = promql.catalogue_metrics() | set(ruleset.load().record_names) | PROMETHEUS_OWN
    used = promql.metric_names(as_promql('rate(DCGM_FI_DEV_GPU_UTIL{pod=~"$pod"}[$__rate_interval])'))
    assert used - allowed == {"DCGM_FI_DEV_GPU_UTIL"}


def test_json_queries_are_the_declared_queries():
    """What the tests walk (build.all_queries) is what Grafana gets (the committed JSON)."""
    in_json = set()
    for d in DASHBOARDS.values():
        for p in d["panels"]:
            in_json |= {t["expr"] for t in p.get("targets", [])}
        in_json |= {v["query"] for v in d["templating"]["list"] if v["type"] == "query"}
        in_json |= {a["expr"] for a in d["annotations"]["list"] if a.get("expr")}
    assert in_json == {q for _, q in build.all_queries()}


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_provisioning_conventions(name):
    d = DASHBOARDS[name]
    text = (build.JSON_DIR / name).read_text()
    assert "__inputs" not in d and "${DS_" not in text
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for p in d["panels"]:
        if p["type"] in ("timeseries", "table"):
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
            assert all(t["refId"] for t in p["targets"])
    for v in variables.values():
        if v["type"] == "query":
            assert v["datasource"]["uid"] == "${datasource}"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)) and 0 not in ids
    for p in d["panels"]:
        pos = p["gridPos"]
        assert pos["x"] + pos["w"] <= 24
    assert re.fullmatch(r"gpulens-[a-z-]+", d["uid"])
    assert "gpulens" in d["tags"]


def _cells(d):
    """(x, y) cells each panel covers: no two panels may overlap."""
    for p in d["panels"]:
        g = p["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                yield p["id"], (x, y)


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_panels_do_not_overlap(name):
    seen: dict[tuple[int, int], int] = {}
    for pid, cell in _cells(DASHBOARDS[name]):
        assert cell not in seen, f"panels {seen[cell]} and {pid} overlap at {cell}"
        seen[cell] = pid


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_capture_annotations_come_from_the_grafana_tag_query(name):
    captures = [a for a in DASHBOARDS[name]["annotations"]["list"] if a["datasource"]["type"] == "grafana"]
    assert len(captures) == 1
    target = captures[0]["target"]
    assert target["type"] == "tags" and "gpulens" in target["tags"] and captures[0]["enable"]


def test_workload_dashboard_shows_every_signal():
    d = DASHBOARDS["gpulens-workload.json"]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert {"datasource", "namespace", "workload", "pod"} <= set(variables)
    assert "$namespace" in variables["workload"]["query"], "workload is chained to namespace"
    assert "$namespace" in variables["pod"]["query"] and "$workload" in variables["pod"]["query"], \
        "pod is chained to namespace and workload"
    rows = {p["title"] for p in d["panels"] if p["type"] == "row"}
    for word in ("Workload", "Demand", "Back-pressure", "Contention", "Transfers", "Memory", "DCGM", "captures"):
        assert any(word in r for r in rows), word
    exprs = " ".join(t["expr"] for p in d["panels"] for t in p.get("targets", []))
    for needle in ("gpulens_launches", "gpulens_sync_wait_seconds", "gpulens_gpu_pods",
                   'direction="h2d"', 'direction="d2h"', "gpulens_process_gpu_memory_bytes",
                   "gpulens_dcgm_gpu_utilization_ratio", "gpulens_dcgm_sm_active_ratio"):
        assert needle in exprs, needle
    for p in d["panels"]:
        for t in p.get("targets", []):
            if p["type"] == "timeseries":
                # per pod, or per workload (baselines belong to the workload)
                assert '$namespace' in t["expr"] and ('$pod' in t["expr"] or
                                                      (t["expr"].removeprefix("count by (namespace, gpulens_workload) (")
                                                       .startswith(("namespace_workload", "namespace_pod:gpulens_live"))
                                                       and '$workload' in t["expr"])), p["title"]
    reports = [p for p in d["panels"] if p["type"] == "annolist"]
    assert reports and reports[0]["options"]["tags"] == ["gpulens"]
    assert reports[0]["options"]["onlyFromThisDashboard"] is False


def test_workload_panels_show_now_against_baseline():
    """The workload row puts each signal of the workload next to the baseline its pods are judged by."""
    d = DASHBOARDS["gpulens-workload.json"]
    rows = [p for p in d["panels"] if p["type"] == "row"]
    first = rows[0]
    assert first["title"].startswith("Workload")
    following = [p for p in d["panels"] if p["type"] != "row" and first["gridPos"]["y"] < p["gridPos"]["y"] < rows[1]["gridPos"]["y"]]
    exprs = [t["expr"] for p in following for t in p.get("targets", [])]
    for signal in ("gpulens_launches_per_worker", "gpulens_sync_wait_seconds", "gpulens_memcpy_bytes_per_worker", "gpulens_gpu_pods"):
        now = [e for e in exprs if signal in e and ":baseline" not in e]
        baseline = [e for e in exprs if signal in e and ":baseline" in e]
        assert now and baseline, signal
    assert all("$workload" in e and "$pod" not in e for e in exprs), exprs


def test_node_dashboard_is_per_node_and_gpu():
    d = DASHBOARDS["gpulens-node-gpus.json"]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert {"datasource", "node", "gpu"} <= set(variables)
    for p in d["panels"]:
        for t in p.get("targets", []):
            assert "$node" in t["expr"], p["title"]


def test_alert_dashboard_links_point_at_these_dashboards():
    uids = {d["uid"]: d for d in DASHBOARDS.values()}
    for alert in ruleset.load().alerts:
        url = alert["annotations"]["dashboard_url"]
        m = re.search(r"/d/([^/]+)/", url)
        assert m and m.group(1) in uids, url
        variables = {v["name"] for v in uids[m.group(1)]["templating"]["list"]}
        for var in re.findall(r"var-([a-z_]+)=", url):
            assert var in variables, f"{url}: no variable {var}"


def test_the_rank_panel_names_the_rank_that_blocks_most(tmp_path, promtool):
    """Issue 29: the workload dashboard's "Which rank blocks most" query, evaluated by promtool on a
    pod with 4 ranks (rank 2 with two threads blocked at once, 1.5 s/s, shown as a share of 1;
    the others 10-30%): each rank's share, at most 1, and rank 2 on top."""
    d = DASHBOARDS["gpulens-workload.json"]
    (panel,) = [p for p in d["panels"] if p.get("title") == "Which rank blocks most"]
    (target,) = panel["targets"]
    assert target["expr"] == build.RANK_BLOCKED and panel["type"] == "table"
    expr = as_promql(target["expr"])
    rates = {"0": 0.2, "1": 0.3, "2": 1.5, "3": 0.1}
    series = [{"series": f'gpulens_sync_wait_seconds_total{{node="n", gpu="{r}", namespace="ml", pod="p-0", '
                         f'container="trainer", gpulens_workload="Pod/p-0", rank="{r}"}}',
               "values": f"0+{rate * 60:g}x10"} for r, rate in rates.items()]
    labels = 'container="trainer", gpu="{r}", namespace="ml", pod="p-0", rank="{r}"'
    test = {"rule_files": [], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": series,
        "promql_expr_test": [
            {"expr": f"round({expr}, 0.01)", "eval_time": "10m",
             "exp_samples": [{"labels": "{" + labels.format(r=r) + "}", "value": min(rate, 1.0)}
                             for r, rate in rates.items()]},
            {"expr": f"round(topk(1, {expr}), 0.01)", "eval_time": "10m",
             "exp_samples": [{"labels": "{" + labels.format(r="2") + "}", "value": 1.0}]},
        ]}]}
    path = tmp_path / "rank.test.yml"
    path.write_text(yaml.safe_dump(test, sort_keys=False))
    result = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
