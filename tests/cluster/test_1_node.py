"""The harness gives a working cluster: a Ready node, pods in real kubelet cgroups, Service
routing by kube-proxy, cluster DNS for Services (and none for what does not exist), and the
apiserver reachable from pods at its Service IP."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path

import pytest

from .harness import BB, NODE, REPO, cluster_sh, wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(3600)]


@pytest.fixture
def namespace(api):
    from kubernetes import client
    name = f"gl-harness-{uuid.uuid4().hex[:8]}"
    api.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    # 1.20 refuses pods (500 "No API token found") until the ServiceAccount's token Secret exists
    wait_until("default ServiceAccount token", lambda: api.read_namespaced_service_account("default", name).secrets, 60)
    yield name
    api.delete_namespace(name)


def pod(name: str, image: str, script: str, *, labels: dict | None = None, restart: str = "Never") -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels or {}},
            "spec": {"restartPolicy": restart, "terminationGracePeriodSeconds": 1, "enableServiceLinks": False,
                     "containers": [{"name": "main", "image": image, "imagePullPolicy": "Never",
                                     "command": [BB, "sh", "-c", script]}]}}


def finished(api, ns: str, name: str):
    p = api.read_namespaced_pod(name, ns)
    return p if p.status.phase in ("Succeeded", "Failed") else None


def test_node_ready_and_status(cluster, api):
    node = api.read_node(NODE)
    ready = [c for c in node.status.conditions if c.type == "Ready"]
    assert ready and ready[0].status == "True"
    assert node.status.node_info.kubelet_version == "v1.20.2"
    assert {a.address for a in node.status.addresses if a.type == "InternalIP"} == {"10.244.0.1"}
    r = cluster_sh("status")
    assert r.returncode == 0, r.stdout
    assert "stopped" not in r.stdout and f"node {NODE} Ready" in r.stdout


def test_the_setups_kubectl_is_the_clusters_version_and_reaches_it(cluster):
    """The README's lines run with .venv/bin/kubectl (scripts/setup.sh): Debian's client of the
    cluster's own version, whatever kubectl the machine has on its PATH."""
    kubectl = REPO / ".venv" / "bin" / "kubectl"
    out = subprocess.run([str(kubectl), "version", "-o", "json"], capture_output=True, text=True, check=False,
                         timeout=60, env=dict(os.environ, KUBECONFIG=cluster.kubeconfig))
    assert out.returncode == 0, out.stderr
    versions = json.loads(out.stdout)
    assert versions["clientVersion"]["gitVersion"] == versions["serverVersion"]["gitVersion"] == "v1.20.2", versions


def test_pod_runs_in_kubelet_cgroups(cluster, api, toolbox, namespace):
    api.create_namespaced_pod(namespace, pod("sleeper", toolbox, f"{BB} sleep 600"))
    p = wait_until("pod Running", lambda: (lambda p: p if p.status.phase == "Running" else None)(
        api.read_namespaced_pod("sleeper", namespace)), 120)
    cid = p.status.container_statuses[0].container_id.split("//", 1)[1]
    qos = p.status.qos_class.lower()
    cg = Path("/sys/fs/cgroup/memory/kubepods") / qos / f"pod{p.metadata.uid}" / cid
    assert cg.is_dir(), f"no kubelet cgroup {cg}"
    pids = (cg / "cgroup.procs").read_text().split()
    assert pids, "the container's cgroup holds no process"
    assert "sleep" in Path(f"/proc/{pids[0]}/cmdline").read_bytes().decode(errors="replace")


def test_service_dns_and_routing(cluster, api, toolbox, namespace):
    """A client pod reaches a web pod through the Service's DNS name (dnsmasq + feeder, kube-proxy);
    a Service that does not exist does not resolve; `kubernetes.default` is the API's Service IP."""
    api.create_namespaced_pod(namespace, pod(
        "web", toolbox, f"{BB} mkdir -p /www && echo served-by-web > /www/index.html && {BB} httpd -f -p 8080 -h /www",
        labels={"app": "web"}, restart="Always"))
    svc = api.create_namespaced_service(namespace, {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]}})
    # busybox's own resolver (nslookup) and nc: its wget goes through static glibc's NSS and crashes
    look = (lambda name: f"{BB} nslookup {name} 2>/dev/null | {BB} awk '/^Address/ && $2 !~ /:53$/ {{print $2}}' | {BB} tail -n1")
    script = (
        f"for i in $({BB} seq 90); do IP=$({look(f'web.{namespace}.svc.cluster.local')}); "
        f"[ -n \"$IP\" ] && GOT=$({BB} printf 'GET / HTTP/1.0\\r\\n\\r\\n' | {BB} nc -w 3 $IP 80 | {BB} tail -n1) "
        f"&& [ \"$GOT\" = served-by-web ] && break; {BB} sleep 1; done; "
        f"echo SVCIP=$IP; echo GOT=$GOT; "
        f"echo NOPE=$({look(f'nope.{namespace}.svc.cluster.local')}); "
        f"echo API=$({look('kubernetes.default.svc.cluster.local')}); "
        f"{BB} nc -w 3 10.96.0.1 443 </dev/null && echo APICONN=ok || echo APICONN=fail")
    api.create_namespaced_pod(namespace, pod("client", toolbox, script))
    p = wait_until("client pod finished", lambda: finished(api, namespace, "client"), 180)
    log = api.read_namespaced_pod_log("client", namespace, _preload_content=False).data.decode()
    assert p.status.phase == "Succeeded", log
    assert f"SVCIP={svc.spec.cluster_ip}\n" in log, log     # the Service's own ClusterIP, from cluster DNS
    assert "GOT=served-by-web" in log, log                  # kube-proxy DNAT to the web pod
    assert "NOPE=\n" in log, log                            # no wildcard answers
    assert "API=10.96.0.1\n" in log, log
    assert "APICONN=ok" in log, log
