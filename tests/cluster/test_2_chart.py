"""The chart installed for real (the README's lines, run by bash with `helm` and `kubectl`) with the image from
image/: every pod Ready, the exporter with exactly its capabilities, two operators with one
leader, the webhook called by the apiserver over TLS (a Job's pod in an opted-in namespace is
armed and gets a coordinator), no 403 in any log, and a verb the chart does not grant refused."""

from __future__ import annotations

import ssl
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from .harness import NS, PKI, forbidden_in_logs, wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(3600)]

APISERVER = "https://10.244.0.1:6443"
#: linux/capability.h numbers
CAP_SYS_PTRACE, CAP_SYS_ADMIN, CAP_PERFMON, CAP_BPF = 19, 21, 38, 39


def pods(api, ns=NS, selector=""):
    return api.list_namespaced_pod(ns, label_selector=selector).items


def all_ready(api, ns=NS):
    ps = pods(api, ns)
    return ps if ps and all(p.status.container_statuses and all(c.ready for c in p.status.container_statuses)
                            for p in ps) else None


def component(p) -> str:
    return (p.metadata.labels or {}).get("app.kubernetes.io/component", "")


def test_every_pod_ready(release, api):
    ps = wait_until("all release pods Ready", lambda: all_ready(api), 300)
    by = {}
    for p in ps:
        by.setdefault(component(p), []).append(p.metadata.name)
    assert len(by.get("node", [])) == 1, by          # the DaemonSet on the one node
    assert len(by.get("operator", [])) == 2, by
    assert len(by.get("gateway", [])) == 1, by


def _cap_eff(pid: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    raise AssertionError("no CapEff")


def test_exporter_runs_with_exactly_its_capabilities(release, api):
    (node,) = [p for p in pods(api) if component(p) == "node"]
    st = {c.name: c for c in node.status.container_statuses}["exporter"]
    cid = st.container_id.split("//", 1)[1]
    procs = list(Path("/sys/fs/cgroup/pids/kubepods").rglob(f"{cid}/cgroup.procs"))
    assert procs, f"no kubelet cgroup for the exporter container {cid}"
    pid = procs[0].read_text().split()[0]
    caps = _cap_eff(pid)
    for cap in (CAP_BPF, CAP_PERFMON, CAP_SYS_PTRACE):
        assert caps & (1 << cap), f"exporter lacks capability {cap}: CapEff={caps:x}"
    assert not caps & (1 << CAP_SYS_ADMIN), f"exporter has CAP_SYS_ADMIN: CapEff={caps:x}"


def test_one_operator_leads(release, api):
    from kubernetes import client
    coord = client.CoordinationV1Api(api.api_client)
    ops = {p.metadata.name for p in pods(api) if component(p) == "operator"}
    lease = wait_until("operator lease held", lambda: [l for l in coord.list_namespaced_lease(NS).items
                                                       if l.spec.holder_identity], 120)
    holders = {l.spec.holder_identity for l in lease}
    assert len(holders) == 1, holders
    (holder,) = holders
    assert any(holder.startswith(o) or o in holder for o in ops), (holder, ops)


def test_webhook_arms_a_job_pod_and_operator_makes_its_coordinator(release, api, toolbox):
    from kubernetes import client
    ns = f"ml-{uuid.uuid4().hex[:6]}"
    api.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(
        name=ns, labels={"gpulens.dev/arming": "enabled"})))
    try:
        batch = client.BatchV1Api(api.api_client)
        batch.create_namespaced_job(ns, {
            "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "trainer"},
            "spec": {"backoffLimit": 0, "template": {"spec": {
                "restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                "containers": [{"name": "main", "image": toolbox, "imagePullPolicy": "Never",
                                "command": ["/bin/busybox", "sleep", "600"]}]}}}})
        pod = wait_until("trainer pod", lambda: pods(api, ns, "job-name=trainer"), 60)[0]
        assert (pod.metadata.labels or {}).get("gpulens.dev/armed") == "true", pod.metadata.labels
        assert "gpulens-hook" in [c.name for c in pod.spec.init_containers or []]
        custom = client.CustomObjectsApi(api.api_client)
        ccs = wait_until("CaptureCoordinator", lambda: custom.list_namespaced_custom_object(
            "gpulens.dev", "v1alpha1", ns, "capturecoordinators")["items"], 120)
        assert len(ccs) == 1, [c["metadata"]["name"] for c in ccs]
        coord = wait_until("coordinator pod Ready", lambda: [p for p in pods(api, ns) if component(p) == "coordinator"
                                                             and p.status.container_statuses
                                                             and all(c.ready for c in p.status.container_statuses)], 300)
        assert len(coord) == 1
    finally:
        api.delete_namespace(ns)


def test_no_403_in_any_component_log(release, api):
    wait_until("all release pods Ready", lambda: all_ready(api), 300)
    assert forbidden_in_logs(api, NS) == {}


def _sa_token(api, ns: str, sa: str) -> str:
    import base64
    acc = api.read_namespaced_service_account(sa, ns)
    secret = api.read_namespaced_secret(acc.secrets[0].name, ns)
    return base64.b64decode(secret.data["token"]).decode()


def _as(token: str, method: str, path: str) -> int:
    ctx = ssl.create_default_context(cafile=str(PKI / "ca.crt"))
    req = urllib.request.Request(APISERVER + path, method=method, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_rbac_grants_what_is_used_and_refuses_the_rest(release, api):
    ops = [p for p in pods(api) if component(p) == "operator"]
    token = _sa_token(api, NS, ops[0].spec.service_account_name)
    from kubernetes import client
    (lease,) = [l.metadata.name for l in client.CoordinationV1Api(api.api_client).list_namespaced_lease(NS).items]
    assert _as(token, "GET", f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/{lease}") == 200   # its own lease
    assert _as(token, "GET", "/api/v1/namespaces/kube-system/secrets") == 403          # never granted
    assert _as(token, "DELETE", "/api/v1/nodes/gpulens-node") == 403
    (node,) = [p for p in pods(api) if component(p) == "node"]
    token = _sa_token(api, NS, node.spec.service_account_name)
    assert _as(token, "GET", "/api/v1/pods") == 200                                   # the exporter labels pods
    assert _as(token, "POST", f"/api/v1/namespaces/{NS}/pods") == 403
    assert _as(token, "GET", f"/api/v1/namespaces/{NS}/secrets") == 403
