"""Render the chart with the real Helm library (helm-python-sdk, Helm v4 SDK) and validate every
object it renders: core kinds with kubernetes-validate, the gpulens CRD's custom resources with
the CRD's own openAPIV3Schema, and prometheus-operator / cert-manager kinds with the minimal
schemas in tests/helm/schemas (built from the fields those CRDs define; strict on purpose)."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml
from helm_python import chart as helm_chart

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "helm" / "gpulens"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
RELEASE, NAMESPACE = "gl", "gpulens-system"
#: Schema versions checked: the oldest upstream-supported line (1.27) and the newest known. The chart also
#: installs on 1.20 (Chart.yaml kubeVersion; see helm/gpulens/README.md), proven by tests/cluster, not here.
K8S_VERSIONS = ("1.27", "1.36")

_EXTERNAL = {
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor.json",
    ("cert-manager.io/v1", "Certificate"): "certificate.json",
}


@lru_cache(maxsize=1)
def loaded() -> helm_chart.Chart:
    return helm_chart.Chart.load(str(CHART_DIR))


def render(values: dict[str, Any] | None = None, *, name: str = RELEASE, namespace: str = NAMESPACE) -> list[dict]:
    """Every object the chart renders for `values`, parsed (empty documents dropped)."""
    out: list[dict] = []
    for path, text in sorted(loaded().render(values or {}, name=name, namespace=namespace).items()):
        for doc in yaml.safe_load_all(text):
            if doc:
                doc.setdefault("__template__", path)
                out.append(doc)
    return out


def crd() -> dict[str, Any]:
    return yaml.safe_load((CHART_DIR / "crds" / "capturecoordinators.gpulens.dev.yaml").read_text())


def cr_schema() -> dict[str, Any]:
    return crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def validate(obj: dict[str, Any]) -> str:
    """Validate one object; returns how. Raises on an invalid object or an unknown kind."""
    obj = {k: v for k, v in obj.items() if k != "__template__"}
    key = (obj.get("apiVersion"), obj.get("kind"))
    if key == ("gpulens.dev/v1alpha1", "CaptureCoordinator"):
        jsonschema.Draft7Validator(cr_schema()).validate(obj)
        return "crd-schema"
    if key in _EXTERNAL:
        schema = json.loads((SCHEMAS / _EXTERNAL[key]).read_text())
        jsonschema.Draft7Validator(schema).validate(obj)
        return "embedded-schema"
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)
    return "kubernetes-validate"


def by_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict], kind: str, name_suffix: str = "") -> dict:
    found = [o for o in by_kind(objs, kind) if o["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, f"expected one {kind} *{name_suffix}, got {[o['metadata']['name'] for o in found]}"
    return found[0]


def containers(obj: dict) -> dict[str, dict]:
    spec = obj["spec"]["template"]["spec"] if "template" in obj["spec"] else obj["spec"]
    return {c["name"]: c for c in spec.get("containers", []) + spec.get("initContainers", [])}
