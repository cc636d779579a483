"""The chart renders with the real Helm library, with default values and several value sets, and
every rendered object is valid for its kind."""

from __future__ import annotations

import pytest
from helm_python import chart as helm_chart

from .chart import CHART_DIR, by_kind, loaded, one, render, validate
from .value_sets import VALUE_SETS


@pytest.mark.parametrize("set_name", sorted(VALUE_SETS))
def test_every_rendered_object_is_valid(set_name):
    objs = render(VALUE_SETS[set_name])
    assert objs, "nothing rendered"
    how = {}
    for obj in objs:
        how[f"{obj['kind']}/{obj['metadata']['name']}"] = validate(obj)
    # Each validator really ran on something: no kind slipped through unchecked.
    assert set(how.values()) <= {"kubernetes-validate", "embedded-schema", "crd-schema"}
    names = [f"{o['kind']}/{o['metadata'].get('namespace', '')}/{o['metadata']['name']}" for o in objs]
    assert len(names) == len(set(names)), "two objects with the same kind, namespace and name"


def test_defaults_render_the_whole_system():
    kinds = {(o["kind"], o["metadata"]["name"]) for o in render()}
    for want in [("DaemonSet", "gl-gpulens-node"), ("Deployment", "gl-gpulens-operator"),
                 ("Deployment", "gl-gpulens-gateway"), ("Service", "gl-gpulens-gateway"),
                 ("MutatingWebhookConfiguration", "gl-gpulens-operator"), ("Secret", "gl-gpulens-tokens"),
                 ("ClusterRole", "gl-gpulens-coordinator"), ("ConfigMap", "gl-gpulens-operator")]:
        assert want in kinds
    # Off by default: things that need other operators or an image we cannot ship.
    assert not {k for k, _ in kinds} & {"PrometheusRule", "ServiceMonitor", "PodMonitor", "NetworkPolicy"}
    assert not [n for k, n in kinds if "dynolog" in n]


def test_everything_renders_monitors_rules_dashboards_and_dynolog():
    objs = render(VALUE_SETS["everything"])
    kinds = {o["kind"] for o in objs}
    assert {"PrometheusRule", "ServiceMonitor", "PodMonitor", "NetworkPolicy"} <= kinds
    assert [o for o in by_kind(objs, "DaemonSet") if o["metadata"]["name"].endswith("-dynolog")]
    for kind in ("PrometheusRule", "ServiceMonitor", "PodMonitor"):
        for o in by_kind(objs, kind):
            assert o["metadata"]["labels"]["release"] == "kps", kind   # kube-prometheus-stack discovery


def test_minimal_renders_only_the_node_daemonset():
    objs = render(VALUE_SETS["minimal"])
    assert {o["kind"] for o in objs} == {"DaemonSet", "ServiceAccount", "Secret"}
    assert not by_kind(objs, "ClusterRole")


def test_chart_lints_strict_with_only_the_icon_note():
    result = helm_chart.lint(str(CHART_DIR), strict=True)
    assert result["errors"] == []
    assert [m for m in result["messages"] if m["severity"] > 1] == []


def test_crd_is_shipped_in_crds_and_is_a_valid_crd():
    crds = loaded().crds
    assert [c["filename"] for c in crds] == ["gpulens/crds/capturecoordinators.gpulens.dev.yaml"]
    import yaml
    doc = yaml.safe_load(crds[0]["data"])
    validate(doc)   # apiextensions.k8s.io/v1 CustomResourceDefinition, via kubernetes-validate
    version = doc["spec"]["versions"][0]
    assert doc["spec"]["group"] == "gpulens.dev" and version["name"] == "v1alpha1"
    assert version["subresources"] == {"status": {}}
    props = version["schema"]["openAPIV3Schema"]["properties"]
    assert {"jobId", "attempt", "selector", "worldSize", "localWorldSize", "archive", "grafana",
            "captureDefaults"} <= set(props["spec"]["properties"])
    assert {"phase", "endpoint", "lastCaptures", "conditions"} <= set(props["status"]["properties"])


def test_release_names_that_contain_the_chart_name_are_not_doubled():
    objs = render({}, name="gpulens")
    assert {o["metadata"]["name"] for o in by_kind(objs, "DaemonSet")} == {"gpulens-node"}


@pytest.mark.parametrize("breakage", ["port-as-text", "unknown-field", "bad-rule-duration", "cr-negative-attempt"])
def test_the_validators_catch_broken_objects(breakage):
    """Guard for the tests above: a broken object of each validated family is refused."""
    import copy

    import jsonschema
    import kubernetes_validate

    objs = render(VALUE_SETS["everything"])
    if breakage == "port-as-text":
        obj = copy.deepcopy(next(o for o in objs if o["kind"] == "DaemonSet"))
        obj["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "nine"
    elif breakage == "unknown-field":
        obj = copy.deepcopy(next(o for o in objs if o["kind"] == "Deployment"))
        obj["spec"]["template"]["spec"]["hostNetwrok"] = True
    elif breakage == "bad-rule-duration":
        obj = copy.deepcopy(next(o for o in objs if o["kind"] == "PrometheusRule"))
        obj["spec"]["groups"][0]["rules"][0]["for"] = "five minutes"
    else:
        obj = {"apiVersion": "gpulens.dev/v1alpha1", "kind": "CaptureCoordinator", "metadata": {"name": "x"},
               "spec": {"jobId": "j", "attempt": -1, "selector": {"matchLabels": {"a": "b"}}, "localWorldSize": 1,
                        "archive": {"root": "s3://b/p"}}}
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
        validate(obj)


def test_pod_monitors_scrape_the_agent_and_every_coordinator_off_by_default():
    """The agent PodMonitor selects the node pods and their agent port; the coordinator one selects
    the Pods the operator really creates (gpulens.capture.operator.manifests), in any namespace, on their
    port; both only with monitoring.podMonitor.enabled. The agent's job label (<ns>/<name>) is what
    GPULensAgentDown selects."""
    import re

    from gpulens.alertrules import ruleset
    from gpulens.capture.operator.manifests import coordinator_pod
    from tests.operator.conftest import operator_config
    from tests.operator.test_contracts import _sample_cc

    assert not [o for o in by_kind(render(), "PodMonitor")]
    objs = render(VALUE_SETS["everything"])
    monitors = {o["metadata"]["name"]: o for o in by_kind(objs, "PodMonitor")}
    agent_pm, coord_pm = monitors["gl-gpulens-agent"], monitors["gl-gpulens-coordinator"]
    assert agent_pm["metadata"]["labels"]["release"] == "kps" and coord_pm["metadata"]["labels"]["release"] == "kps"

    node = one(objs, "DaemonSet", "-node")
    template = node["spec"]["template"]
    assert agent_pm["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    agent = next(c for c in template["spec"]["containers"] if c["name"] == "agent")
    [endpoint] = agent_pm["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics" and endpoint["port"] in {p["name"] for p in agent["ports"]}
    job = f"{agent_pm['metadata']['namespace']}/{agent_pm['metadata']['name']}"
    selector = re.search(r'job=~"([^"]+)"', ruleset.load().alert("GPULensAgentDown")["expr"]).group(1)
    assert re.fullmatch(selector, job)
    exporter_job = f"{agent_pm['metadata']['namespace']}/gl-gpulens-exporter"
    assert not re.fullmatch(selector, exporter_job), "the exporter's scrape is not an agent's"

    config = operator_config()
    pod = coordinator_pod(_sample_cc(config), config)
    assert coord_pm["spec"]["namespaceSelector"] == {"any": True}
    assert coord_pm["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    [endpoint] = coord_pm["spec"]["podMetricsEndpoints"]
    ports = {p["name"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
    assert endpoint["path"] == "/metrics" and endpoint["port"] in ports


def test_the_exporters_monitors_keep_its_namespace_pod_and_container_labels():
    """The exporter labels its series with the trainer's namespace/pod/container; the Operator adds
    the target's own under the same names, and without honorLabels the exporter's become
    exported_namespace, ... and every rule (by namespace, pod) sees the DaemonSet's pod instead.
    The agent's own metrics have no such labels: its monitor keeps the default."""
    objs = render(VALUE_SETS["everything"])
    (sm,) = by_kind(objs, "ServiceMonitor")
    assert [e.get("honorLabels") for e in sm["spec"]["endpoints"]] == [True]
    monitors = {o["metadata"]["name"]: o for o in by_kind(objs, "PodMonitor")}
    assert [e.get("honorLabels") for e in monitors["gl-gpulens-exporter"]["spec"]["podMetricsEndpoints"]] == [True]
    assert [e.get("honorLabels") for e in monitors["gl-gpulens-agent"]["spec"]["podMetricsEndpoints"]] == [None]
