"""The labels, annotations and names that Alertmanager, the gateway, Grafana and people rely on
(docs/alerts.md), checked on the source rule files."""

from __future__ import annotations

import re

import pytest

from gpulens.alertrules import promql, ruleset

from .conftest import REPO

RULES = ruleset.load()
WORKLOAD_DIAGNOSES = {"host_sync", "noisy_neighbor", "input_starvation", "device_slowdown",
                      "stalled", "unclassified"}
DIAGNOSES = WORKLOAD_DIAGNOSES | {"exporter_degraded", "capture_degraded"}
RECORD_NAME = re.compile(r"^[a-z][a-z0-9_]*:[a-z][a-z0-9_]*:[a-z][a-z0-9_]*$")


@pytest.mark.parametrize("alert", RULES.alerts, ids=lambda a: a["alert"])
def test_alert_labels_and_annotations(alert):
    labels = alert["labels"]
    assert labels["diagnosis"] in DIAGNOSES
    assert labels["severity"] in {"info", "warning", "critical"}
    assert labels["gpulens_capture"] in {"auto", "hang", "none"}
    assert (labels["gpulens_capture"] == "hang") == (labels["diagnosis"] == "stalled"), \
        "a hang capture is for a stalled job, and a stalled job gets one (its Kineto trace would be empty)"
    assert re.fullmatch(r"[A-Z][A-Za-z0-9]+", alert["alert"]), "CamelCase alert names"
    assert alert.get("for"), "every alert needs a for: against flapping"
    assert set(alert["annotations"]) == {"summary", "description", "runbook_url", "dashboard_url"}
    diagnosis = labels["diagnosis"]
    assert alert["annotations"]["runbook_url"].endswith(f"/runbooks/{diagnosis}.md")
    assert (REPO / "alertrules" / "runbooks" / f"{diagnosis}.md").is_file(), f"no runbook for {diagnosis}"
    for text in alert["annotations"].values():
        ruleset.render_template(text, {"namespace": "ns", "pod": "p", "node": "n"})


def test_workload_alerts_cover_the_diagnoses_and_name_the_pod():
    workload = [a for a in RULES.alerts if a["labels"]["diagnosis"] in WORKLOAD_DIAGNOSES]
    assert {a["labels"]["diagnosis"] for a in workload} == WORKLOAD_DIAGNOSES
    for alert in workload:
        assert "{{ $labels.namespace }}/{{ $labels.pod }}" in alert["annotations"]["summary"]
        assert "{{ $labels.gpulens_workload }}" in alert["annotations"]["summary"], "names the workload too"
        assert "var-namespace={{ $labels.namespace }}&var-pod={{ $labels.pod }}" in alert["annotations"]["dashboard_url"]
        # the gate that carries the minimum baseline, history and liveness guards
        assert alert["expr"].lstrip().startswith("namespace_pod:gpulens_launches_per_baseline:ratio_rate5m")


def test_only_exporter_health_and_stalls_skip_auto_capture():
    no_capture = {a["alert"] for a in RULES.alerts if a["labels"]["gpulens_capture"] != "auto"}
    assert no_capture == {"GPUWorkloadStalled", "GPULensExporterSourceLost", "GPULensExporterMapNearlyFull",
                          "GPULensAgentDown", "GPULensCapturesFailing"}


def test_render_template_refuses_go_template_logic():
    with pytest.raises(ruleset.TemplateError):
        ruleset.render_template("{{ $value | humanize }}", {})
    assert ruleset.render_template("{{ $labels.pod }}/{{$labels.missing}}", {"pod": "p"}) == "p/"


def test_record_names_follow_level_metric_operations():
    for name in RULES.record_names:
        assert RECORD_NAME.match(name), name
        assert not name.split(":")[1].endswith("_total"), f"{name}: strip _total after rate()"


def test_rules_reference_only_catalogue_metrics_and_own_records():
    allowed = promql.catalogue_metrics() | set(RULES.record_names) | promql.capture_plane_metrics() | promql.SCRAPE_METRICS
    for name, expr in RULES.expressions():
        used = promql.metric_names(expr)
        assert used, f"{name} reads no metric"
        assert used <= allowed, f"{name} reads unknown metrics {used - allowed}"


def test_every_recording_rule_is_used():
    """A record nobody reads is dead weight on every Prometheus that loads the rules."""
    from gpulens.dashboards import build  # the dashboards read records too
    used: set[str] = set()
    for _, expr in RULES.expressions():
        used |= promql.metric_names(expr)
    for _, expr in build.all_queries():
        used |= promql.metric_names(expr)
    assert set(RULES.record_names) <= used, set(RULES.record_names) - used


def test_a_rule_file_without_groups_is_refused(tmp_path):
    (tmp_path / "x.rules.yml").write_text("rules: []\n")
    with pytest.raises(ValueError, match="not a Prometheus rule file"):
        ruleset.load(tmp_path)
    with pytest.raises(FileNotFoundError):
        ruleset.load(tmp_path / "missing")


def test_capture_plane_metrics_are_in_their_catalogue():
    """docs/metrics.md names every family the agent and coordinator serve, and no other."""
    text = (REPO / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"`(gpulens_(?:agent|coordinator)_[a-z_]+)`", text))
    served = {re.sub(r"_(bucket|count|sum)$", "", n) for n in promql.capture_plane_metrics()}
    assert documented == served
    assert "gpulens_coordinator_targets_total" in promql.capture_plane_metrics()
