"""Faults of the add-on in the cluster that must not reach the workload. With the arming webhook
unavailable (no operator Pod serves it), pods in an opted-in namespace are still created, unarmed
(failurePolicy Ignore). With the operator leader killed, the other replica takes the Lease over and
keeps the job's coordinator (no duplicate) and brings its lost Pod back."""

from __future__ import annotations

import pytest

from .harness import NS, wait_until
from .workload import armed_namespace

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
    ns = armed_namespace(api)
    apps.patch_namespaced_deployment_scale(dep.metadata.name, NS, {"spec": {"replicas": 0}})
    try:
        wait_until("no operator pods", lambda: not api.list_namespaced_pod(
            NS, label_selector="app.kubernetes.io/component=operator").items, 120)
        _sleeping_job(api, ns, toolbox)
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


def _sleeping_job(api, ns: str, toolbox: str) -> None:
    """Job `trainer` in `ns`: one busybox pod that sleeps (a pod the webhook may arm, nothing more)."""
    from kubernetes import client
    client.BatchV1Api(api.api_client).create_namespaced_job(ns, {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "trainer"},
        "spec": {"backoffLimit": 0, "template": {"spec": {
            "restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "main", "image": toolbox, "imagePullPolicy": "Never",
                            "command": ["/bin/busybox", "sleep", "600"]}]}}}})


def _lease_holder(api) -> str | None:
    from kubernetes import client
    leases = client.CoordinationV1Api(api.api_client).list_namespaced_lease(NS).items
    return next((lease.spec.holder_identity for lease in leases if lease.spec.holder_identity), None)


def test_the_other_operator_takes_over_when_the_leader_is_killed(release, api, toolbox):
    """The new leader acts (it brings the job's lost coordinator Pod back) and duplicates nothing."""
    from kubernetes import client
    ns = armed_namespace(api)
    custom = client.CustomObjectsApi(api.api_client)

    def coordinators():
        return custom.list_namespaced_custom_object("gpulens.dev", "v1alpha1", ns, "capturecoordinators")["items"]
    try:
        _sleeping_job(api, ns, toolbox)
        (cc,) = wait_until("the job's CaptureCoordinator", coordinators, 120)
        ops = wait_until("two operators Ready", lambda: _operator_ready(api, 2), 300)
        holder = wait_until("a lease holder", lambda: _lease_holder(api), 120)
        (leader,) = [p for p in ops if p.metadata.name in holder]
        (other,) = [p for p in ops if p is not leader]
        api.delete_namespaced_pod(leader.metadata.name, NS, grace_period_seconds=0)     # killed: no release
        wait_until("the other operator holds the lease", lambda: other.metadata.name in (_lease_holder(api) or ""), 120)
        # Only a leader acts: the new one must bring a lost coordinator Pod back, and keep the
        # job's one CaptureCoordinator (a duplicate would be a second object, a new uid).
        sel = "app.kubernetes.io/component=coordinator"
        (old,) = wait_until("the coordinator pod", lambda: api.list_namespaced_pod(ns, label_selector=sel).items, 300)
        api.delete_namespaced_pod(old.metadata.name, ns, grace_period_seconds=0)
        (new,) = wait_until("the coordinator pod recreated by the new leader", lambda: [
            p for p in api.list_namespaced_pod(ns, label_selector=sel).items if p.metadata.uid != old.metadata.uid], 300)
        assert [c["metadata"]["uid"] for c in coordinators()] == [cc["metadata"]["uid"]]
        assert len(api.list_namespaced_pod(ns, label_selector=sel).items) == 1
        log = api.read_namespaced_pod_log(other.metadata.name, NS)
        assert not [line for line in log.splitlines() if "coordinator.created" in line and ns in line]
        # The lost Pod's status update was accepted (a podName of "" was refused with 422 by 1.20).
        assert not [line for line in log.splitlines() if " 422 " in line], log[-3000:]
    finally:
        api.delete_namespace(ns)
    wait_until("operators back", lambda: _operator_ready(api, 2), 300)
