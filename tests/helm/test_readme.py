"""The install instructions (chart README, and the repository README once its deployment section
is pasted from it) render: the values they show are valid and produce what they promise."""

from __future__ import annotations

import re
import shlex

import pytest
import yaml

from .chart import CHART_DIR, REPO, by_kind, one, render, validate


def _block(text: str, marker: str, lang: str) -> str:
    m = re.search(rf"<!-- {marker} -->\s*```{lang}\n(.*?)```", text, re.S)
    assert m, f"no ```{lang} block after <!-- {marker} -->"
    return m.group(1)


def _install(text: str) -> tuple[dict, dict]:
    values = yaml.safe_load(_block(text, "gpulens-install:values", "yaml"))
    commands = [shlex.split(line.split("#", 1)[0]) for line in _block(text, "gpulens-install:commands", "bash").splitlines()
                if line.strip()]
    helm = next(c for c in commands if c[:2] == ["helm", "install"])
    opts = {"release": helm[2], "chart": helm[3], "namespace": helm[helm.index("--namespace") + 1]}
    for c in commands:
        if c[:2] == ["kubectl", "label"] and "gpulens.dev/arming=enabled" in c:
            opts["armed_namespace"] = c[3]
    return values, opts


def test_chart_readme_install_renders_valid_objects():
    values, opts = _install((CHART_DIR / "README.md").read_text())
    assert (REPO / opts["chart"]).resolve() == CHART_DIR
    objs = render(values, name=opts["release"], namespace=opts["namespace"])
    for obj in objs:
        validate(obj)
    # What the README promises: a gateway at that address, monitors and rules for kube-prometheus-stack.
    svc = one(objs, "Service", "-gateway")
    assert svc["metadata"]["name"] == "gpulens-gateway" and svc["spec"]["ports"][0]["port"] == 9453
    assert f"http://{svc['metadata']['name']}.{opts['namespace']}.svc:9453" in (CHART_DIR / "README.md").read_text()
    assert one(objs, "PrometheusRule", "")["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    monitors = by_kind(objs, "PodMonitor")  # exporter, agent, coordinator: each found by this Prometheus
    assert {m["metadata"]["name"] for m in monitors} == {"gpulens-exporter", "gpulens-agent", "gpulens-coordinator"}
    assert all(m["metadata"]["labels"]["release"] == "kube-prometheus-stack" for m in monitors)
    assert [o for o in by_kind(objs, "ConfigMap") if "grafana_dashboard" in o["metadata"]["labels"]]
    wh = one(objs, "MutatingWebhookConfiguration", "")["webhooks"][0]
    assert wh["namespaceSelector"]["matchLabels"] == {"gpulens.dev/arming": "enabled"}
    assert opts["armed_namespace"]


def test_repository_readme_matches_the_chart_readme():
    text = (REPO / "README.md").read_text()
    assert "<!-- gpulens-install:values -->" in text, "README.md lost its deployment section marker"
    assert _install(text) == _install((CHART_DIR / "README.md").read_text())
