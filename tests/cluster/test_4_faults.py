"""Faults of the add-on in the cluster that must not reach the workload: with the arming webhook
unavailable (no operator Pod serves it), pods in an opted-in namespace are still created, unarmed
(failurePolicy Ignore)."""

from __future__ import annotations

import uuid

import pytest

from .harness import NS, wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(1800)]


def _operator_ready(api, n: int):
    ps = api.list_namespaced_pod(NS, label_selector="app.kubernetes.io/component=operator").items
    return len(ps) == n and all(p.status.container_statuses and all(c.ready for c in p.status.container_statuses)
                                for p in ps) and ps


def test_pods_are_created_unarmed_while_the_webhook_is_down(release, api, toolbox):
    from kubernetes import client
    apps = client.AppsV1Api(api.api_client)
    (dep,) = [d for d in apps.list_namespaced_deployment(NS).items
              if (d.metadata.labels or {}).get("app.kubernetes.io/component") == "operator"]
    replicas = dep.spec.replicas
    ns = f"ml-{uuid.uuid4().hex[:6]}"
    api.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(
        name=ns, labels={"gpulens.dev/arming": "enabled"})))
    apps.patch_namespaced_deployment_scale(dep.metadata.name, NS, {"spec": {"replicas": 0}})
    try:
        wait_until("no operator pods", lambda: not api.list_namespaced_pod(
            NS, label_selector="app.kubernetes.io/component=operator").items, 120)
        client.BatchV1Api(api.api_client).create_namespaced_job(ns, {
            "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "trainer"},
            "spec": {"backoffLimit": 0, "template": {"spec": {
                "restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                "containers": [{"name": "main", "image": toolbox, "imagePullPolicy": "Never",
                                "command": ["/bin/busybox", "sleep", "600"]}]}}}})
        (pod,) = wait_until("the Job's pod created", lambda: api.list_namespaced_pod(
            ns, label_selector="job-name=trainer").items, 120)
        assert "gpulens.dev/armed" not in (pod.metadata.labels or {}), pod.metadata.labels
        assert not pod.spec.init_containers
        wait_until("the unarmed pod Running", lambda: api.read_namespaced_pod(
            pod.metadata.name, ns).status.phase == "Running", 120)
    finally:
        apps.patch_namespaced_deployment_scale(dep.metadata.name, NS, {"spec": {"replicas": replicas}})
        api.delete_namespace(ns)
    wait_until("operators back", lambda: _operator_ready(api, replicas), 300)
