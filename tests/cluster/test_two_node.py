"""Two nodes on one machine (`scripts/cluster.sh up --nodes 2`): both Ready at their own addresses;
pods on either node reach each other and Services across the nodes (a pod CIDR per node, routes
between the namespaces); hostPath, hostPID and pod cgroups mean the pod's own node; `down` gives
the machine back as test_9 checks it for one node.

Runs after test_9 (file order): the package's cluster is brought up again with two nodes for this
module (a warm `up`) and taken down by its last test."""

from __future__ import annotations

import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from .conftest import REUSE
from .harness import (BB, KUBECONFIG, NODE, NODE2, NODE2_IP, REPO, STATE, TOOLBOX, cluster_sh, down, machine_diff,
                      machine_state, node_count, sysctls_changed_by_others, up, wait_until)

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(3600)]

NODE_IPS = {NODE: "10.244.0.1", NODE2: NODE2_IP}
POD_NETS = {NODE: "10.244.0.", NODE2: "10.244.1."}


@pytest.fixture(scope="module")
def two(cluster, tmp_path_factory):
    """The cluster with two nodes (a kept two-node cluster under GPULENS_CLUSTER_REUSE), the admin
    API client made after that `up` (new PKI), and the toolbox image loaded into both nodes."""
    if not (REUSE and node_count() == 2 and cluster_sh("status").returncode == 0):
        down()
        up(nodes=2)
    from kubernetes import client, config
    api = client.CoreV1Api(config.new_client_from_config(config_file=str(KUBECONFIG)))
    tar = tmp_path_factory.mktemp("toolbox2") / "toolbox.tar"
    subprocess.run([sys.executable, str(REPO / "cluster" / "oci_image.py"), "--ref", TOOLBOX, "--out", str(tar),
                    "--entrypoint", BB, f"{BB}:bin/busybox"], check=True, capture_output=True)
    r = cluster_sh("load", str(tar))
    assert r.returncode == 0, r.stderr
    return api


@pytest.fixture
def namespace(two):
    from kubernetes import client
    name = f"gl-two-{uuid.uuid4().hex[:8]}"
    two.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    wait_until("default ServiceAccount token", lambda: two.read_namespaced_service_account("default", name).secrets, 60)
    yield name
    two.delete_namespace(name)


def pod(name: str, node: str, script: str, *, labels: dict | None = None, restart: str = "Never",
        host_pid: bool = False, host_path: str | None = None) -> dict:
    """A toolbox pod the scheduler places on `node` (by its hostname label, as a user would)."""
    spec = {"restartPolicy": restart, "terminationGracePeriodSeconds": 1, "enableServiceLinks": False,
            "nodeSelector": {"kubernetes.io/hostname": node}, "hostPID": host_pid,
            "containers": [{"name": "main", "image": TOOLBOX, "imagePullPolicy": "Never",
                            "command": [BB, "sh", "-c", script]}]}
    if host_path:
        spec["volumes"] = [{"name": "h", "hostPath": {"path": host_path, "type": "DirectoryOrCreate"}}]
        spec["containers"][0]["volumeMounts"] = [{"name": "h", "mountPath": "/h"}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels or {}}, "spec": spec}


def finished(api, ns: str, name: str):
    p = api.read_namespaced_pod(name, ns)
    return p if p.status.phase in ("Succeeded", "Failed") else None


def running(api, ns: str, name: str):
    p = api.read_namespaced_pod(name, ns)
    return p if p.status.phase == "Running" and p.status.pod_ip else None


def log_of(api, ns: str, name: str) -> str:
    return api.read_namespaced_pod_log(name, ns, _preload_content=False).data.decode()


def test_two_nodes_ready_at_their_own_addresses(two):
    nodes = {n.metadata.name: n for n in two.list_node().items}
    assert set(nodes) == {NODE, NODE2}
    for name, n in nodes.items():
        assert [c.status for c in n.status.conditions if c.type == "Ready"] == ["True"], name
        assert {a.address for a in n.status.addresses if a.type == "InternalIP"} == {NODE_IPS[name]}, name
    r = cluster_sh("status")
    assert r.returncode == 0, r.stdout
    assert "stopped" not in r.stdout and f"node {NODE} Ready" in r.stdout and f"node {NODE2} Ready" in r.stdout
    for part in ("containerd", "kubelet", "proxy"):
        assert f"node-2 {part} running" in r.stdout, r.stdout


@pytest.mark.parametrize("server_node,client_node", [(NODE2, NODE), (NODE, NODE2)])
def test_pods_reach_each_other_and_services_across_nodes(two, namespace, server_node, client_node):
    """A client on one node reaches a web pod on the other by pod IP and by its Service's DNS name
    (kube-proxy of the client's node, cluster DNS), and the API's Service IP."""
    two.create_namespaced_pod(namespace, pod(
        "web", server_node, f"{BB} mkdir -p /www && echo served-from-{server_node} > /www/index.html && "
                            f"{BB} httpd -f -p 8080 -h /www", labels={"app": "web"}, restart="Always"))
    web = wait_until("web pod Running", lambda: running(two, namespace, "web"), 120)
    assert web.spec.node_name == server_node and web.status.pod_ip.startswith(POD_NETS[server_node])
    assert web.status.host_ip == NODE_IPS[server_node]
    svc = two.create_namespaced_service(namespace, {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]}})
    look = (lambda name: f"{BB} nslookup {name} 2>/dev/null | {BB} awk '/^Address/ && $2 !~ /:53$/ {{print $2}}' | {BB} tail -n1")
    get = (lambda ip, port: f"{BB} printf 'GET / HTTP/1.0\\r\\n\\r\\n' | {BB} nc -w 3 {ip} {port} | {BB} tail -n1")
    script = (
        f"for i in $({BB} seq 90); do IP=$({look(f'web.{namespace}.svc.cluster.local')}); "
        f"[ -n \"$IP\" ] && SVC=$({get('$IP', 80)}) && [ -n \"$SVC\" ] && break; {BB} sleep 1; done; "
        f"echo SVCIP=$IP; echo SVC=$SVC; echo POD=$({get(web.status.pod_ip, 8080)}); "
        f"echo MYIP=$({BB} hostname -i); "
        f"{BB} nc -w 3 10.96.0.1 443 </dev/null && echo APICONN=ok || echo APICONN=fail")
    two.create_namespaced_pod(namespace, pod("client", client_node, script))
    p = wait_until("client pod finished", lambda: finished(two, namespace, "client"), 180)
    log = log_of(two, namespace, "client")
    assert p.status.phase == "Succeeded" and p.spec.node_name == client_node, log
    assert f"MYIP={POD_NETS[client_node]}" in log, log
    assert f"SVCIP={svc.spec.cluster_ip}\n" in log, log
    assert f"SVC=served-from-{server_node}\n" in log, log          # Service -> the other node's pod
    assert f"POD=served-from-{server_node}\n" in log, log          # pod IP -> pod IP, across the nodes
    assert "APICONN=ok" in log, log


def test_host_path_pid_and_cgroups_are_the_nodes_own(two, namespace):
    """The same hostPath on the two nodes is two folders (node 2's lives in its state dir), hostPID
    sees the node's own PID namespace (node 2's PID 1 is its init, not the machine's), and node 2's
    pods sit under its own cgroup parent."""
    tag = f"two-node-{uuid.uuid4().hex[:8]}"
    host_dir = f"/var/lib/gpulens/{tag}"
    node2_dir = STATE / "nodes" / NODE2 / "host" / "var/lib/gpulens" / tag
    script = (f"echo $NODE_NAME > /h/written-by; echo INIT=$({BB} tr '\\0' ' ' < /proc/1/cmdline); "
              f"echo NPROC=$({BB} ls -d /proc/[0-9]* | {BB} wc -l); {BB} sleep 600")
    try:
        for i, node in enumerate((NODE, NODE2)):
            spec = pod(f"p{i}", node, script.replace("$NODE_NAME", node), host_pid=True, host_path=host_dir)
            two.create_namespaced_pod(namespace, spec)
        pods = [wait_until(f"p{i} Running", lambda i=i: running(two, namespace, f"p{i}"), 120) for i in (0, 1)]
        logs = [wait_until(f"p{i} log", lambda i=i: (lambda s: s if "NPROC=" in s else None)(log_of(two, namespace, f"p{i}")), 60)
                for i in (0, 1)]
        assert (Path(host_dir) / "written-by").read_text().strip() == NODE
        assert (node2_dir / "written-by").read_text().strip() == NODE2
        assert "_node_init 2" in logs[1] and "_node_init" not in logs[0], logs
        nproc = [int(s.split("NPROC=")[1].split()[0]) for s in logs]
        assert nproc[1] < nproc[0], nproc     # node 2 sees only its own processes
        for p, root in zip(pods, ("kubepods", "gl-node-2/kubepods")):
            cid = p.status.container_statuses[0].container_id.split("//", 1)[1]
            cg = Path("/sys/fs/cgroup/memory") / root / p.status.qos_class.lower() / f"pod{p.metadata.uid}" / cid
            assert (cg / "cgroup.procs").read_text().split(), f"no process in {cg}"
    finally:
        shutil.rmtree(host_dir, ignore_errors=True)


def test_down_restores_machine_with_two_nodes(cluster, two, capsys):
    """Last here: `down` with two nodes gives back what the package's first `up` found."""
    during = machine_state()
    assert any(link.startswith("gl-veth-") for link in during.links), during.links
    assert any("gl-node-2" in c for c in during.kubepods_cgroups), during.kubepods_cgroups
    theirs = sysctls_changed_by_others(during)
    down_s = down()
    diffs = machine_diff(cluster.before, machine_state(), theirs)
    assert not diffs, f"down left the machine changed: {diffs}"
    assert cluster_sh("status").returncode != 0
    with capsys.disabled():
        print(f"\n[cluster] two-node down {down_s:.1f}s")
