"""The chart's exporter RBAC for finding dcgm-exporter: exactly pods get/list/watch, cluster-wide or
in the named namespaces, and enough for every request the finder really makes (the chart's own
exporter arguments drive a finder against kmock; each request is checked against the rendered
rules with the API server's request-info rules, tests/operator/rbac.py)."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from gpulens.exporter.command import config_from_args, configure
from gpulens.exporter.dcgm_discovery import DcgmFinder

from ..helm.chart import NAMESPACE, by_kind, containers, one, render, validate
from ..operator.rbac import allowed, attributes
from .test_dcgm_discovery import OPERATOR, dcgm_pod
from .test_kube import api_factory, eventually

PODS_READ = [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]


def _exporter_args(objs) -> list[str]:
    ds = next(o for o in by_kind(objs, "DaemonSet") if o["metadata"]["name"].endswith("-node"))
    return containers(ds)["exporter"]["args"]


def _node_rbac(objs):
    cluster = [o for o in by_kind(objs, "ClusterRole") if o["metadata"]["name"].endswith("-node")]
    roles = {o["metadata"]["namespace"]: o for o in by_kind(objs, "Role") if o["metadata"]["name"].endswith("-node")}
    return cluster, roles


@pytest.mark.parametrize("values,cluster_wide,namespaces,flags", [
    ({}, True, [], []),
    ({"exporter": {"kubernetes": False}}, True, [], []),
    ({"exporter": {"kubernetes": False, "dcgmDiscovery": {"namespaces": ["gpu-operator", "monitoring"]}}},
     False, ["gpu-operator", "monitoring"], ["--dcgm-namespace=gpu-operator", "--dcgm-namespace=monitoring"]),
    ({"exporter": {"kubernetes": False, "dcgmDiscovery": {"enabled": False}}}, False, [], ["--no-dcgm-discovery"]),
    ({"exporter": {"kubernetes": False, "dcgmUrl": "http://10.0.0.1:9400/metrics"}}, False, [],
     ["--dcgm-url=http://10.0.0.1:9400/metrics"]),
])
def test_the_chart_grants_exactly_what_discovery_needs(values, cluster_wide, namespaces, flags):
    objs = render(values)
    cluster, roles = _node_rbac(objs)
    assert bool(cluster) == cluster_wide
    if cluster:
        assert cluster[0]["rules"] == PODS_READ
    assert sorted(roles) == namespaces
    for ns, role in roles.items():
        assert role["rules"] == PODS_READ
        binding = one([o for o in objs if o["metadata"].get("namespace") == ns], "RoleBinding", "-node")
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                      "name": role["metadata"]["name"]}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "gl-gpulens-node", "namespace": NAMESPACE}]
        validate(role), validate(binding)
    args = _exporter_args(objs)
    assert [a for a in args if "dcgm" in a] == [f for f in flags if "dcgm" in f]
    assert ("--no-kubernetes" in args) == (values.get("exporter", {}).get("kubernetes") is False)


@pytest.mark.parametrize("values", [{}, {"exporter": {"kubernetes": False,
                                                      "dcgmDiscovery": {"namespaces": ["gpu-operator"]}}}])
async def test_every_request_the_finder_makes_is_allowed_by_the_chart(kmock, values, monkeypatch):
    objs = render(values)
    cluster, roles = _node_rbac(objs)
    cluster_rules = cluster[0]["rules"] if cluster else []
    ns_rules = {ns: r["rules"] for ns, r in roles.items()}
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")   # in a pod, as the DaemonSet runs it
    parser = argparse.ArgumentParser()
    configure(parser)
    args = [a.replace("$(GPULENS_NODE_NAME)", "node-a") for a in _exporter_args(objs)[1:]]   # [0] is the subcommand
    cfg = config_from_args(parser.parse_args(args))
    assert cfg.dcgm_discovery
    kmock.resources["v1/pods"] = {}
    kmock.objects["v1/pods", "gpu-operator", "nvidia-dcgm-exporter-x"] = dcgm_pod("nvidia-dcgm-exporter-x",
                                                                                 labels=OPERATOR, ip="10.0.0.5")
    finder = DcgmFinder(api_factory(kmock), cfg.node, namespaces=cfg.dcgm_namespaces, watch_timeout_s=2,
                        read_timeout_s=3, backoff_s=(0.1,))
    finder.start()
    try:
        await eventually(lambda: finder.find().url == "http://10.0.0.5:9400/metrics")
        await eventually(lambda: sum(r.params.get("watch") in ("true", "True", "1") for r in kmock["get"]) >= 2)
    finally:
        await asyncio.to_thread(finder.stop)
    requests = [r for r in kmock["get"] if "/pods" in str(r.url)]     # the finder only reads
    verbs = set()
    for r in requests:
        # the Python client sends watch=True, which the API server (Go's ParseBool) reads as true
        a = attributes("GET", r.url.path, r.url.query_string.replace("watch=True", "watch=true"))
        assert a is not None and allowed(a, cluster_rules, ns_rules), str(r.url)
        verbs.add(a.verb)
    assert verbs == {"list", "watch"}
