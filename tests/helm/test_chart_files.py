"""The chart's copies of the alert rules and dashboards match their sources, and survive rendering
byte for byte (Helm must not template Grafana's or Prometheus' own `{{ }}`)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess

import pytest
import yaml

from gpulens.alertrules.manifest import DEFAULT_RUNBOOK_BASE_URL

from .chart import CHART_DIR, REPO, by_kind, one, render
from .value_sets import VALUE_SETS
from tests.conftest import missing


def _sync():
    spec = importlib.util.spec_from_file_location("sync_files", CHART_DIR / "hack" / "sync_files.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_chart_copies_match_their_sources():
    sync = _sync()
    planned = sync.planned()
    assert planned, "no sources (alertrules/kubernetes/*.yaml, dashboards/**/*.json)"
    stale = [str(p.relative_to(REPO)) for p, text in planned.items() if not p.exists() or p.read_text() != text]
    assert stale == [], f"run `python helm/gpulens/hack/sync_files.py`: stale {stale}"
    assert sync.main(["--check"]) == 0


def test_sync_check_notices_a_stale_copy(tmp_path, monkeypatch):
    sync = _sync()
    assert sync.rules_text() is not None, "alertrules/kubernetes/gpulens-prometheusrule.yaml is missing"
    chart = tmp_path / "gpulens"
    shutil.copytree(CHART_DIR, chart)
    (chart / "files" / "rules.yaml").write_text("groups: []\n")
    planned = sync.planned(chart)
    assert any(p.read_text() != t for p, t in planned.items() if p.exists())


def test_rendered_rules_equal_the_alertrules_manifest_except_link_bases():
    source = REPO / "alertrules" / "kubernetes" / "gpulens-prometheusrule.yaml"
    want = yaml.safe_load(source.read_text())["spec"]
    got = one(render({"monitoring": {"prometheusRule": {"enabled": True}}}), "PrometheusRule", "")["spec"]
    assert got == want
    rebased = one(render(VALUE_SETS["everything"]), "PrometheusRule", "")["spec"]
    text = json.dumps(rebased)
    assert DEFAULT_RUNBOOK_BASE_URL not in text and "localhost:3000" not in text
    assert "https://wiki.example.com/gpulens/runbooks/" in text and "https://grafana.example.com/d/" in text
    assert "{{ $labels.namespace }}" in text   # Prometheus templating left for Prometheus


def _project_urls() -> dict[str, str]:
    import tomllib
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["urls"]


def test_default_runbook_links_open_files_in_the_repositorys_docs_runbooks():
    """Under the chart's default values every alert's runbook_url is the repository's docs base
    (pyproject's Runbooks URL, the chart's default, the source rules' base: one value) followed by
    the name of a file that exists in alertrules/runbooks/ — never a placeholder host."""
    base = _project_urls()["Runbooks"].rstrip("/")
    assert base == DEFAULT_RUNBOOK_BASE_URL
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    assert values["monitoring"]["prometheusRule"]["runbookBaseUrl"].rstrip("/") == base
    assert base.startswith(_project_urls()["Repository"].rstrip("/") + "/")
    spec = one(render({"monitoring": {"prometheusRule": {"enabled": True}}}), "PrometheusRule", "")["spec"]
    alerts = [r for g in spec["groups"] for r in g["rules"] if "alert" in r]
    assert alerts, "the default PrometheusRule has no alerts"
    existing = {p.name for p in (REPO / "alertrules" / "runbooks").glob("*.md")}
    for alert in alerts:
        url = alert["annotations"]["runbook_url"]
        assert url.startswith(base + "/"), (alert["alert"], url)
        assert url.removeprefix(base + "/") in existing, (alert["alert"], url)
    assert "example.com" not in json.dumps(spec)


def test_rendered_rules_pass_promtool(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        missing("promtool not installed")
    spec = one(render(VALUE_SETS["everything"]), "PrometheusRule", "")["spec"]
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(spec))
    done = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_dashboards_become_labelled_configmaps_with_the_json_intact():
    files = sorted((CHART_DIR / "files" / "dashboards").glob("*.json"))
    assert files, "no dashboards copied into the chart"
    cms = [o for o in by_kind(render(VALUE_SETS["everything"]), "ConfigMap") if "-dashboard-" in o["metadata"]["name"]]
    assert len(cms) == len(files)
    for cm, path in zip(sorted(cms, key=lambda c: c["metadata"]["name"]), files):
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["namespace"] == "monitoring"
        assert cm["metadata"]["annotations"] == {"grafana_folder": "GPU"}
        assert json.loads(cm["data"][path.name]) == json.loads(path.read_text())
    custom = render({"dashboards": {"enabled": True, "label": "grafana-dashboard", "labelValue": "gpulens"}})
    cm = next(o for o in by_kind(custom, "ConfigMap") if "-dashboard-" in o["metadata"]["name"])
    assert cm["metadata"]["labels"]["grafana-dashboard"] == "gpulens"
