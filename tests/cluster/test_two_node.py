"""Two nodes on one machine (`scripts/cluster.sh up --nodes 2`): both Ready at their own addresses;
pods on either node reach each other and Services across the nodes (a pod CIDR per node, routes
between the namespaces); hostPath, hostPID and pod cgroups mean the pod's own node; `down` gives
the machine back as test_9 checks it for one node.

Then the design's own smoke test (issue 33): the chart on both nodes, a DDP job of two pods (one
per node) with two torchrun workers each, four ranks in one gloo world; one capture through the
gateway archives every rank by its own node's agent under one manifest, the analysis Job reads
all four; an iteration capture traces the same iterations on every rank; a hung agent on the
second node costs only that node's ranks, and the next capture archives all four again; the second
node lost mid-capture (`cluster.sh lose 2`, then `restore 2`) costs its ranks, and the Job's next
attempt gets its own coordinator and a whole capture.

Runs after test_9 (file order): the package's cluster is brought up again with two nodes for this
module (a warm `up`) and taken down by its last test."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpulens.capture.wire import labels as L
from tests import rule_signals

from .conftest import (REUSE, S3, Grafana, grafana_server, load_gpulens_image, load_toolbox, monitoring_of,
                       restart_release_pods, s3_server)
from .harness import (BB, CHART, KUBECONFIG, NODE, NODE2, NODE2_IP, NS, RELEASE, REPO, STATE, TOOLBOX, cluster_sh, down, forbidden_in_logs,
                      machine_diff, machine_state, node_count, pod_log, pod_logs, readme_install, sysctls_changed_by_others,
                      up, wait_until)
from .workload import (JOB, PEERS, armed_namespace, call, capture_status, gateway, start_capture, trainer_job,
                       trainer_peers_service, wait_converged, wait_training)

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
    load_toolbox(tmp_path_factory.mktemp("toolbox2"))
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


# --- the smoke test: the chart on two nodes, four ranks, one capture, one manifest (issue 33) -----

NODE_SEL = "app.kubernetes.io/component=node"
OPERATOR_SEL = "app.kubernetes.io/component=operator"
COORDINATOR_PODS = "app.kubernetes.io/component=coordinator"


@dataclass
class TwoNodeRelease:
    image: str
    s3: S3
    grafana: Grafana


@pytest.fixture(scope="module")
def two_release(two, tmp_path_factory):
    """The chart installed on the two-node cluster by the README's own lines, archiving to an S3
    server and annotating a Grafana double of its own (the package's went with the one-node cluster)."""
    image = load_gpulens_image(tmp_path_factory.mktemp("image2"))
    with s3_server() as s3, grafana_server() as grafana:
        install = readme_install(image, s3.endpoint, grafana.url)
        install.run(str(KUBECONFIG), REPO, tmp_path_factory.mktemp("readme-two"), rerun=REUSE)
        if REUSE:
            restart_release_pods(two)
        yield TwoNodeRelease(image, s3, grafana)


@pytest.fixture(scope="module")
def ddp(two, two_release):
    """Job `trainer`: two pods, one per node, two torchrun workers each: ranks 0-3 in one gloo world
    (tests/cluster/workload.py, FIND_PEERS), in an armed namespace. Yields (namespace, {node: pod}).
    As a training Job is set to survive a lost node: a pod on an unreachable node is evicted after
    10 s, and the Job replaces failed pods (the last test loses node 2)."""
    from kubernetes import client
    ns = armed_namespace(two)
    try:
        two.create_namespaced_service(ns, trainer_peers_service())
        client.BatchV1Api(two.api_client).create_namespaced_job(
            ns, trainer_job(two_release.image, nodes=2, backoff_limit=6, lost_node_after_s=10))
        pods = wait_until("the trainer's two pods", lambda: (lambda ps: len(ps) == 2 and ps)(
            two.list_namespaced_pod(ns, label_selector=f"job-name={JOB}").items), 60)
        pods = [wait_training(two, ns, p.metadata.name) for p in pods]
        yield ns, {p.spec.node_name: p for p in pods}
    finally:
        if KUBECONFIG.exists():         # the module's last test takes the cluster down first
            two.delete_namespace(ns)


def _node_pod(api, node: str):
    (p,) = [p for p in api.list_namespaced_pod(NS, label_selector=NODE_SEL).items if p.spec.node_name == node]
    return p


def _bytes(s3: S3, uri: str) -> bytes:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return s3.client().get_object(Bucket=bucket, Key=key)["Body"].read()


def test_the_chart_runs_an_exporter_and_agent_on_each_node(two, two_release):
    pods = two.list_namespaced_pod(NS, label_selector=NODE_SEL).items
    assert sorted(p.spec.node_name for p in pods) == sorted([NODE, NODE2]), [p.spec.node_name for p in pods]

    def both_ready():
        # `helm install --wait` counts a DaemonSet done with maxUnavailable (1) of its pods not yet
        # Ready, so on two nodes one pod may still be starting when it returns: wait for both
        now = two.list_namespaced_pod(NS, label_selector=NODE_SEL).items
        ready = {p.spec.node_name: {c.name: c.ready for c in p.status.container_statuses or []} for p in now}
        both_ready.last = ready
        return all(r.get("exporter") and r.get("agent") for r in ready.values()) and len(ready) == 2 and now
    both_ready.last = None
    try:
        pods = wait_until("the exporter and agent Ready on both nodes", both_ready, 300, 2)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {both_ready.last}") from None
    for p in pods:
        assert p.status.host_ip == NODE_IPS[p.spec.node_name]


def test_four_ranks_on_two_nodes_one_capture_one_manifest_one_analysis(two, two_release, ddp):
    """Armed at creation; one capture through the gateway; each rank's trace archived by the agent
    of its own node (its log says so, the other's does not), checksums recomputed from S3 match,
    the manifest names rank, pod and node for each; the analysis Job's report covers four ranks."""
    ns, pods = ddp
    assert set(pods) == {NODE, NODE2}
    for p in pods.values():
        assert (p.metadata.labels or {}).get("gpulens.dev/armed") == "true", p.metadata.labels
        assert [c.name for c in p.spec.init_containers or []] == ["gpulens-hook"]
    done = wait_converged(two, start_capture(two, ns, 1500))
    cid = done["capture_id"]
    assert done["phase"] == "converged" and done["fully_succeeded"], _targets(done)
    assert done["counts"] == {"archived": 4}, _targets(done)
    manifest = json.loads(_bytes(two_release.s3, done["manifest_uri"]))
    assert manifest["capture_id"] == cid and manifest["failures"] == [] and manifest["fully_succeeded"]
    arts = sorted(manifest["artifacts"], key=lambda a: a["rank"])
    assert [a["rank"] for a in arts] == [0, 1, 2, 3]
    by_node: dict[str, set[int]] = {}
    for a in arts:
        pod = pods[a["node"]]                          # the node the manifest names runs that pod
        assert a["pod"] == pod.metadata.name, (a["rank"], a["pod"], a["node"])
        by_node.setdefault(a["node"], set()).add(a["rank"])
        body = _bytes(two_release.s3, a["uri"])
        assert len(body) == a["size"] and hashlib.sha256(body).hexdigest() == a["sha256"], a["uri"]
    # torchrun's node rank follows the sorted pod IPs: node 1's pod (10.244.0.x) holds ranks 0-1
    assert by_node == {NODE: {0, 1}, NODE2: {2, 3}}, by_node
    assert {a["local_rank"] for a in arts if a["node"] == NODE2} == {0, 1}
    # each node's agent archived exactly its own node's ranks (its log, read once per node)
    archived = {}
    for node in (NODE, NODE2):
        lines = [line for line in pod_log(two, NS, _node_pod(two, node).metadata.name, "agent").splitlines()
                 if "event=target.archived" in line and f"capture_id={cid}" in line]
        archived[node] = {a["target_id"] for a in arts if any(f"target_id={a['target_id']} " in f"{line} " for line in lines)}
    assert archived == {node: {a["target_id"] for a in arts if a["node"] == node} for node in (NODE, NODE2)}, archived

    status = wait_until("the capture's analysis finished", lambda: (
        lambda st: st.get("analysis", {}).get("state") in ("done", "failed", "skipped", "disabled") and st)(
        capture_status(two, cid)), 900, 2)
    assert status["analysis"]["state"] == "done", json.dumps(status["analysis"])
    summary = json.loads(_bytes(two_release.s3, status["report_uri"].replace("report.html", "summary.json")))
    assert summary["capture"]["capture_id"] == cid
    assert summary["counts"]["analysed"] == 4 and summary["counts"]["missing"] == 0, summary["counts"]
    assert sorted(r["rank"] for r in summary["ranks"]) == [0, 1, 2, 3]
    assert {r["rank"]: r["node"] for r in summary["ranks"]} == {a["rank"]: a["node"] for a in arts}
    assert all(r["trace"] for r in summary["ranks"]), [r["rank"] for r in summary["ranks"] if not r["trace"]]


def test_an_iteration_capture_traces_the_same_iterations_on_all_four_ranks(two, ddp, two_release):
    ns, _ = ddp
    base, token = gateway(two)
    started = wait_until("iteration capture accepted", lambda: (lambda r: r[0] in (200, 201, 202) and r[1])(
        call(f"{base}/v1/captures?namespace={ns}", token, {"job_id": JOB, "iterations": 2, "duration_ms": 20000})),
        240, 2)
    done = wait_converged(two, started["capture_id"])
    assert done["fully_succeeded"] and done["counts"] == {"archived": 4}, _targets(done)
    manifest = json.loads(_bytes(two_release.s3, done["manifest_uri"]))
    spans = {a["rank"]: (a["iterations"]["first"], a["iterations"]["last"]) for a in manifest["artifacts"]}
    assert sorted(spans) == [0, 1, 2, 3]
    assert len(set(spans.values())) == 1 and None not in next(iter(spans.values())), spans
    assert {a["iterations"]["optimizer_steps"] for a in manifest["artifacts"]} == {2}, manifest["artifacts"]
    assert {a["node"] for a in manifest["artifacts"]} == {NODE, NODE2}


def _targets(status: dict) -> str:
    """A capture's targets, a line each: what a failed assertion should show first."""
    return "\n".join(f"rank {t['rank']} {t['node']} {t['state']} {t.get('reason')}: {(t.get('detail') or '')[:600]}"
                     for t in status.get("targets") or [])


def _kineto_said(api, ns: str, pods: dict) -> str:
    """What each trainer pod's Kineto logged about on-demand requests (a refusal's cause is there)."""
    words = ("on-demand", "Received config from dyno", "Not starting", "Tracing started", "Tracing complete",
             "Failed to parse", "Ignored request", "could not start", "ipc fabric", "sync_send fail")
    out = []
    for node, p in sorted(pods.items()):
        lines = [ln for ln in pod_log(api, ns, p.metadata.name, "trainer").splitlines() if any(w in ln for w in words)]
        out.append(f"\n--- {node} {p.metadata.name}: Kineto's last on-demand lines\n" + "\n".join(lines[-40:]))
        agent = _node_pod(api, node)
        said = [ln for ln in pod_log(api, agent.metadata.namespace, agent.metadata.name, "agent").splitlines()
                if "ipc." in ln or "kineto." in ln]
        out.append(f"\n--- {node} agent {agent.metadata.name}: its endpoint's last lines\n" + "\n".join(said[-60:]))
    return "".join(out)


def _container_pids(pod, container: str) -> list[int]:
    """The machine's pids of a container's processes (their cgroup paths name the container id)."""
    (cid,) = [c.container_id.split("//", 1)[1] for c in pod.status.container_statuses if c.name == container]
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if cid in (d / "cgroup").read_text():
                    out.append(int(d.name))
            except OSError:
                pass
    return out


def test_a_hung_agent_on_one_node_costs_only_its_ranks(two, ddp, two_release):
    """Node 2's agent stopped (SIGSTOP: alive, silent) once the capture is dispatched: node 1's
    ranks are archived, node 2's end `agent_unreachable`, the capture converges; the agent resumed,
    the next capture archives all four."""
    ns, pods = ddp
    base, token = gateway(two)
    agent = _node_pod(two, NODE2)
    pids = _container_pids(agent, "agent")
    assert pids, "no process of node 2's agent container found"
    started = wait_until("capture accepted", lambda: (lambda r: r[0] in (200, 201, 202) and r[1])(
        call(f"{base}/v1/captures?namespace={ns}", token, {"job_id": JOB, "duration_ms": 1500})), 240, 2)
    cid = started["capture_id"]
    try:
        def dispatched():
            targets = capture_status(two, cid).get("targets") or []
            return len(targets) == 4 and all(t["state"] != "pending" for t in targets) and targets
        wait_until("all four ranks dispatched", dispatched, 120, 0.3)
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        done = wait_converged(two, cid, timeout=400)
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    assert done["phase"] == "converged" and not done["fully_succeeded"], _targets(done)
    states = {t["node"]: set() for t in done["targets"]}
    for t in done["targets"]:
        states[t["node"]].add((t["state"], t.get("reason")))
    assert states[NODE] == {("archived", None)}, _targets(done)
    assert states[NODE2] == {("failed", "agent_unreachable")}, _targets(done)
    manifest = json.loads(_bytes(two_release.s3, done["manifest_uri"]))
    assert sorted(a["rank"] for a in manifest["artifacts"]) == [0, 1]
    assert sorted((f["rank"], f["reason"]) for f in manifest["failures"]) == [(2, "agent_unreachable"), (3, "agent_unreachable")]
    # The workload never noticed: both trainer pods still run, no restart.
    for p in pods.values():
        now = two.read_namespaced_pod(p.metadata.name, ns)
        assert now.status.phase == "Running" and now.status.container_statuses[0].restart_count == 0

    again = wait_converged(two, start_capture(two, ns, 1500))
    assert again["fully_succeeded"] and again["counts"] == {"archived": 4}, _targets(again) + _kineto_said(two, ns, pods)
    # The trainers' polls that queued while it was stopped went unanswered once it ran again: an
    # answer Kineto no longer waits for would leave every later one a poll late (docs/agent.md).
    log = pod_log(two, NS, agent.metadata.name, "agent")
    assert "event=ipc.late_poll_unanswered" in log, log[-3000:]


STALLED = "GPUWorkloadStalled"
#: The stand-in GPU's folder on each node (node-private: cluster.sh NODE_PRIVATE_DIRS): where the
#: hanging job's workers publish their contexts and `exporter.nvml: stub:<folder>` reads them.
STUB_GPU = "/var/lib/gpulens-cluster/node/stub-gpu"


def _node_pods_with_nvml(api, nvml: str):
    """Both nodes' exporter+agent pods from a template whose exporter has --nvml=`nvml`, Ready."""
    pods = api.list_namespaced_pod(NS, label_selector=NODE_SEL).items
    ok = [p for p in pods if not p.metadata.deletion_timestamp and _ready(p) and f"--nvml={nvml}" in next(
          c for c in p.spec.containers if c.name == "exporter").args]
    return len(pods) == len(ok) == 2 and ok


@contextlib.contextmanager
def _exporter_nvml(api, nvml: str):
    """The release upgraded as a user would (`helm upgrade --reuse-values --set exporter.nvml=...`),
    until both nodes run it; back to NVML proper (`auto`, the README's) at the end, so the tests
    after see the release as installed. The one-node cluster's trainers do not publish to the
    stand-in's folder, and with a working NVML view a pod NVML does not list is not live to the
    rules: the README's values keep `auto`."""
    from helm_python import Config

    def set_to(value: str) -> None:
        Config(kubeconfig_path=str(KUBECONFIG), namespace=NS).upgrade(
            str(CHART), RELEASE, {"exporter": {"nvml": value}}, namespace=NS, wait="watcher", timeout=600,
            reuse_values=True, reset_values=False)
        wait_until(f"both nodes' exporters with --nvml={value}, Ready", lambda: _node_pods_with_nvml(api, value), 300, 1)
    try:
        set_to(nvml)
        yield
    finally:
        set_to("auto")


def test_a_rank_hung_on_the_second_node_is_named_by_a_hang_capture(two, two_release, ddp, tmp_path_factory):
    """Issue 45 in the cluster, from the alert on: a second four-rank job (two pods, one per node,
    the chart's agents in their containers: hostPID, root without DAC_OVERRIDE, py-spy from the
    image) learns its baseline under Prometheus and Alertmanager outside the cluster (as test_5's),
    the exporters' NVML view listing its workers' stand-in GPU contexts (the release upgraded to
    `exporter.nvml: stub:<folder>`: the stalled rule needs NVML's view). Then rank 3, on node 2, stops before an all_reduce that ranks 0-2 wait in:
    GPUWorkloadStalled fires, labelled gpulens_capture=hang; Alertmanager's webhook reaches the
    gateway, which starts the hang capture. It archives every rank's Flight Recorder dump and stacks
    (each agent reaches its ranks' hook sockets through the sockets hostPath and reads them with
    py-spy), the analysis Job reads them from S3, and the verdict names rank 3, its pod, node 2,
    the collective and its sequence id."""
    from kubernetes import client
    ns = armed_namespace(two)
    control = STATE / "control" / ns       # not a node's own folder (cluster.sh NODE_PRIVATE_DIRS): both read it
    control.mkdir(parents=True)
    (control / "incident").write_text("none")
    try:
        with _exporter_nvml(two, f"stub:{STUB_GPU}"), monitoring_of(two, tmp_path_factory.mktemp("monitoring-two")) as mon:
            two.create_namespaced_service(ns, trainer_peers_service())
            client.BatchV1Api(two.api_client).create_namespaced_job(ns, trainer_job(
                two_release.image, nodes=2, control_dir=str(control), stub_gpu=STUB_GPU,
                trainer_args=("--hang-rank", "3")))
            pods = wait_until("the hanging job's two pods", lambda: (lambda ps: len(ps) == 2 and ps)(
                two.list_namespaced_pod(ns, label_selector=f"job-name={JOB}").items), 60)
            pods = {p.spec.node_name: wait_training(two, ns, p.metadata.name) for p in pods}
            hung = pods[NODE2].metadata.name
            # as test_5: an incident before the workload's baseline would become the baseline
            baseline = (f'namespace_workload:gpulens_launches_per_worker:baseline_rate5m'
                        f'{{namespace="{ns}",gpulens_workload="job/{JOB}"}}')
            wait_until("the workload's baseline", lambda: mon.query(baseline), 900, 3)
            (control / "incident").write_text("hang")       # every rank reads it; only rank 3 (--hang-rank) acts
            wait_until("rank 3 stopped before its all_reduce", lambda: "demo-trainer rank=3 stops before" in pod_log(
                two, ns, hung, "trainer"), 120, 1)
            stalled_at = time.monotonic()

            try:
                alerts = wait_until(f"{STALLED} firing", lambda: mon.firing(STALLED, ns), 600, 2)
            except AssertionError as e:
                raise AssertionError(f"{e}\n{rule_signals.describe(mon.prometheus, ns)}") from None
            fired_s = time.monotonic() - stalled_at
            for a in alerts:
                assert (a["labels"]["diagnosis"], a["labels"]["gpulens_capture"]) == ("stalled", "hang"), a["labels"]
                assert a["labels"]["gpulens_job"] == JOB and a["labels"]["pod"] in {p.metadata.name for p in pods.values()}
            pattern = re.compile(rf"event=alert\.capture_started .*alertname={STALLED} job={re.escape(ns)}/{JOB} "
                                 r"capture_id=(\S+)")
            started = {"capture_id": wait_until("the gateway starting the hang capture for the alert", lambda: pattern.search(
                pod_logs(two, NS, "app.kubernetes.io/component=gateway")), 120, 1).group(1)}
            done = wait_converged(two, started["capture_id"])
            assert done["phase"] == "converged" and done["fully_succeeded"] and done["kind"] == "hang", _targets(done)
            manifest = json.loads(_bytes(two_release.s3, done["manifest_uri"]))
            arts = sorted(manifest["artifacts"], key=lambda a: a["rank"])
            assert [(a["rank"], a["node"], a["kind"]) for a in arts] == [
                (0, NODE, "hang_evidence"), (1, NODE, "hang_evidence"), (2, NODE2, "hang_evidence"),
                (3, NODE2, "hang_evidence")], arts
            for a in arts:
                body = _bytes(two_release.s3, a["uri"])
                assert len(body) == a["size"] and hashlib.sha256(body).hexdigest() == a["sha256"], a["uri"]
                doc = json.loads(body)
                assert doc["flight_recorder"]["dump"] is not None, (a["rank"], doc["flight_recorder"])
                assert doc["stacks"]["doc"] is not None, (a["rank"], doc["stacks"])      # py-spy in the agent's container
            status = wait_until("the hang analysis finished", lambda: (
                lambda st: st.get("analysis", {}).get("state") in ("done", "failed", "skipped", "disabled") and st)(
                capture_status(two, done["capture_id"])), 600, 2)
            assert status["analysis"]["state"] == "done", json.dumps(status["analysis"])
            summary = json.loads(_bytes(two_release.s3, status["report_uri"].replace("report.html", "summary.json")))
            v = summary["verdict"]
            print(f"[hang] two nodes: {v['line']}\n[hang] two nodes: stall -> alert firing {fired_s:.0f} s, "
                  f"-> report {time.monotonic() - stalled_at:.0f} s (rules at 1/30 time scale: `for: 5m` is 10 s)")
            assert v["kind"] == "never_entered" and "all_reduce" in v["op"] and v["seq"], v
            assert [(x["rank"], x["pod"], x["node"]) for x in v["suspects"]] == [(3, hung, NODE2)], v["suspects"]
            assert "stop_before_collective" in (v["suspects"][0]["now_at"] or ""), v["suspects"]
            for needle in ("rank 3", hung, NODE2, f"collective_seq_id {v['seq']}"):
                assert needle in v["line"], (needle, v["line"])
            assert status["analysis"].get("verdict") == v["line"]          # the status (and annotation) lead with it
    finally:
        two.delete_namespace(ns)
        shutil.rmtree(control, ignore_errors=True)


def _ready(pod) -> bool:
    return bool(pod.status.container_statuses) and all(c.ready for c in pod.status.container_statuses)


def _node_ready(api, node: str) -> bool:
    return [c.status for c in api.read_node(node).status.conditions if c.type == "Ready"] == ["True"]


def _placed_off(api, node: str, ns: str) -> None:
    """The lost-node test's precondition: gpulens' own pods that are not per node (operator, webhook,
    gateway) and the job's coordinator run on the node that stays. One of them on the lost node is
    replaced only once Kubernetes evicts its pod (300 s by default), so its capture waits that long;
    a deleted coordinator is test_3_loop's case. Those on `node` are deleted with `node` cordoned."""
    def movable():
        pods = api.list_namespaced_pod(NS).items + api.list_namespaced_pod(ns, label_selector=COORDINATOR_PODS).items
        return [p for p in pods if p.status.phase in ("Pending", "Running")
                and not any(o.kind == "DaemonSet" for o in p.metadata.owner_references or [])]
    api.patch_node(node, {"spec": {"unschedulable": True}})
    try:
        for p in movable():
            if p.spec.node_name == node:
                api.delete_namespaced_pod(p.metadata.name, p.metadata.namespace)
        wait_until(f"gpulens' own pods and the coordinator Ready off {node}", lambda: (lambda ps: ps and all(
            p.spec.node_name and p.spec.node_name != node and _ready(p) and not p.metadata.deletion_timestamp
            for p in ps))(movable()), 300, 1)
    finally:
        api.patch_node(node, {"spec": {"unschedulable": False}})


def _job_pods_said(api, ns: str) -> str:
    """The job's pods (node, phase, attempt, being deleted) with their logs' last lines, and the
    addresses its PEERS Service lists: what a replacement that never trained is read from."""
    out = []
    for p in api.list_namespaced_pod(ns, label_selector=f"job-name={JOB}").items:
        try:
            tail = "\n    ".join(pod_log(api, ns, p.metadata.name, "trainer").splitlines()[-15:])
        except Exception as exc:  # noqa: BLE001 - a diagnostic must not hide the failure
            tail = f"(no log: {type(exc).__name__})"
        out.append(f"pod {p.metadata.name} node={p.spec.node_name} phase={p.status.phase} ip={p.status.pod_ip} "
                   f"attempt={(p.metadata.labels or {}).get(L.ATTEMPT)} deleting={p.metadata.deletion_timestamp}\n    {tail}")
    try:
        subsets = api.read_namespaced_endpoints(PEERS, ns).subsets or []
        out.append("PEERS: ready " + str(sorted(a.ip for s in subsets for a in s.addresses or []))
                   + " not ready " + str(sorted(a.ip for s in subsets for a in s.not_ready_addresses or [])))
    except Exception as exc:  # noqa: BLE001
        out.append(f"PEERS: {exc}")
    return "\n".join(out)


def _eviction_said(api) -> str:
    """What decides a lost node's evictions: each node's Ready condition, taints and lease renewals
    (the node lifecycle controller judges health by them), and what the controller-manager said of
    disruption and taints (it stops evicting in a zone whose nodes all look lost: a late heartbeat
    of node 1 under load would do that)."""
    from kubernetes import client
    out = []
    for node in (NODE, NODE2):
        try:
            n = api.read_node(node)
            ready = [(c.status, c.reason, str(c.last_heartbeat_time), str(c.last_transition_time))
                     for c in n.status.conditions if c.type == "Ready"]
            lease = client.CoordinationV1Api(api.api_client).read_namespaced_lease(node, "kube-node-lease")
            out.append(f"{node}: Ready {ready} taints {[(t.key, t.effect, str(t.time_added)) for t in n.spec.taints or []]}"
                       f" lease renewed {lease.spec.renew_time}")
        except Exception as exc:  # noqa: BLE001 - a diagnostic must not hide the failure
            out.append(f"{node}: {type(exc).__name__}: {exc}")
    log = STATE / "logs" / "controller-manager.log"
    try:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if any(
            w in ln.lower() for w in ("master disruption", "taint_manager", "noexecute", "evict", "notready", "not-ready",
                                      "zone", "deleting pod"))]
        out.append("controller-manager (node lifecycle):\n  " + "\n  ".join(lines[-40:]))
    except OSError as exc:
        out.append(f"controller-manager log: {exc}")
    return "\n".join(out)


def test_a_lost_node_costs_its_ranks_and_the_next_attempt_gets_its_own_coordinator(two, ddp, two_release):
    """Node 2 crashes mid-capture (`cluster.sh lose 2`: its kubelet, containerd, agent and trainer
    processes killed at once; its ranks die and the gloo world breaks), then boots again. The
    capture converges: node 2's ranks `agent_unreachable`, node 1's ranks what became of them, each
    named in the manifest. Kubernetes evicts node 2's pod, the Job replaces both pods, the webhook
    numbers them a later attempt, which gets its own coordinator, and its capture archives all four."""
    from kubernetes import client
    ns, pods = ddp
    custom = client.CustomObjectsApi(two.api_client)
    _placed_off(two, NODE2, ns)
    old = {p.metadata.name: p for p in two.list_namespaced_pod(ns, label_selector=f"job-name={JOB}").items}
    assert {p.metadata.labels.get(L.ATTEMPT) for p in old.values()} == {"0"}, [p.metadata.labels for p in old.values()]
    cid = start_capture(two, ns, 5000)

    def dispatched():
        targets = capture_status(two, cid).get("targets") or []
        return len(targets) == 4 and all(t["state"] != "pending" for t in targets) and targets
    wait_until("all four ranks dispatched", dispatched, 120, 0.3)
    lost = cluster_sh("lose", "2", timeout=120)
    assert lost.returncode == 0, lost.stderr
    try:
        try:
            done = wait_converged(two, cid, timeout=400)
        except AssertionError as exc:
            said = "\n".join(ln for ln in pod_logs(two, NS, OPERATOR_SEL).splitlines() if "coordinator." in ln)
            raise AssertionError(f"{exc}\n{json.dumps(capture_status(two, cid))[:3000]}\n{said[-3000:]}") from None
        states: dict[str, set] = {NODE: set(), NODE2: set()}
        for t in done["targets"]:
            states[t["node"]].add((t["state"], t.get("reason")))
        assert done["phase"] == "converged" and not done["fully_succeeded"], _targets(done)
        assert states[NODE2] == {("failed", "agent_unreachable")}, _targets(done)
        # node 1's ranks traced on or died with the world: either is theirs to say, never unknown
        assert states[NODE] <= {("archived", None), ("failed", "process_gone")}, _targets(done)
        manifest = json.loads(_bytes(two_release.s3, done["manifest_uri"]))
        named = sorted([a["rank"] for a in manifest["artifacts"]] + [f["rank"] for f in manifest["failures"]])
        assert named == [0, 1, 2, 3] and all(f["reason"] for f in manifest["failures"]), manifest["failures"]
        print(f"\n[lost-node] capture {cid}: " + _targets(done).replace("\n", "\n[lost-node] "))
        # node 1's pod failed within seconds and the Job replaced it (attempt 1) long before this
        # capture's deadline: the old coordinator was kept until the capture converged (drained)
        old_cc = L.coordinator_name(JOB, 0)
        assert any("event=coordinator.draining" in ln and f"coordinator={old_cc} " in f"{ln} "
                   for ln in pod_logs(two, NS, OPERATOR_SEL).splitlines()), "the operator never drained " + old_cc
        assert done["attempt"] == 0, done
        wait_until(f"{NODE2} NotReady", lambda: not _node_ready(two, NODE2), 120, 1)
        (on1,) = [p for p in old.values() if p.spec.node_name == NODE]
        wait_until("node 1's trainer pod failed (its world broke)", lambda: two.read_namespaced_pod(
            on1.metadata.name, ns).status.phase == "Failed", 300, 1)
        (on2,) = [p for p in old.values() if p.spec.node_name == NODE2]
        try:
            wait_until("node 2's trainer pod evicted", lambda: two.read_namespaced_pod(
                on2.metadata.name, ns).metadata.deletion_timestamp, 300, 1)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{_eviction_said(two)}") from None
    finally:
        back = cluster_sh("restore", "2", timeout=400)
        assert back.returncode == 0, back.stderr
    assert _node_ready(two, NODE2)

    def next_attempt():
        now = [p for p in two.list_namespaced_pod(ns, label_selector=f"job-name={JOB}").items
               if p.metadata.name not in old and p.status.phase in ("Pending", "Running")
               and not p.metadata.deletion_timestamp]
        attempts = {p.metadata.labels.get(L.ATTEMPT) for p in now}
        return len(now) == 2 and len(attempts) == 1 and now
    try:
        wait_until("node 2's old pod gone (its kubelet confirmed the eviction)", lambda: on2.metadata.name not in {
            p.metadata.name for p in two.list_namespaced_pod(ns, label_selector=f"job-name={JOB}").items}, 120, 1)
        new = wait_until("the Job's two replacement pods, of one attempt", next_attempt, 600, 2)
        attempt = int(new[0].metadata.labels[L.ATTEMPT])
        new = {p.spec.node_name: p for p in (wait_training(two, ns, p.metadata.name) for p in new)}
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{_job_pods_said(two, ns)}") from None
    assert attempt >= 1 and set(new) == {NODE, NODE2}, [(p.metadata.name, n) for n, p in new.items()]
    want = L.coordinator_name(JOB, attempt)
    wait_until(f"attempt {attempt}'s CaptureCoordinator", lambda: want in {
        c["metadata"]["name"] for c in custom.list_namespaced_custom_object(L.GROUP, L.VERSION, ns, L.PLURAL)["items"]
        if not c["metadata"].get("deletionTimestamp")}, 300, 2)
    again = wait_converged(two, start_capture(two, ns, 1500, timeout=600))
    assert (again["attempt"], again["counts"]) == (attempt, {"archived": 4}), _targets(again) + _kineto_said(two, ns, new)
    assert f"/{ns}/{JOB}/{attempt}/" in again["manifest_uri"], again["manifest_uri"]
    print(f"[lost-node] attempt {attempt}: capture {again['capture_id']} archived all four")


def test_the_two_node_loop_ran_without_a_403(two, ddp):
    ns, _ = ddp
    assert {**forbidden_in_logs(two, NS), **forbidden_in_logs(two, ns)} == {}


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
