"""Serving workloads in the cluster (issue 30): a two-replica Deployment of a small PyTorch
inference loop in a namespace opted in to serving is armed by the webhook at creation (its pods
are its revision's job, `<deployment>-<pod-template-hash>`), the operator makes that revision's
coordinator, a capture of one named replica plus a healthy peer through the gateway archives both
and the analysis report compares them, and a rolling update gets the new revision its own
coordinator while the old revision's is collected once its last pod is gone.

Also what arming needs of the API server on this cluster's Kubernetes (1.20 has no
`kubernetes.io/metadata.name` namespace label; the per-workload entry's namespaceSelector uses it):
both opt-in paths, asked of the real API server with dry-run creates.

Named test_6_*: it needs the `gl` release that test_7 uninstalls, and runs before test_9 takes
the cluster down (file order)."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import urllib.request
import uuid

import pytest

from gpulens.capture.models import new_capture_id
from gpulens.capture.wire import labels as L

from .harness import NS, STATE, forbidden_in_logs, pod_log, pod_logs, wait_until
from .workload import capture_status, gateway, read_manifest, torch_site, wait_converged

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(1800)]

DEPLOYMENT = "web"
AGENT = "http://10.244.0.1:9451"
COORDINATORS = "app.kubernetes.io/component=coordinator"
REPLICAS = f"app={DEPLOYMENT}"

#: The replica's "server": a small PyTorch model answering batches in a loop (no optimizer, no
#: steps: what a serving process looks like to gpulens). It imports torch, so the trainer hook
#: registers it as a single-process worker of the revision's job. `/control/<pod>` holding
#: `slow` makes that replica's batches 32x larger: the affected replica of the comparison.
SERVER = r"""
import os, socket, time, torch
torch.set_num_threads(1)
pod = socket.gethostname()
control = f"/control/{pod}"
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 16)).eval()
print(f"serving-replica {pod} up", flush=True)
seen, batch = None, 8
while True:
    try:
        stamp = os.stat(control).st_mtime_ns
    except OSError:
        stamp = None
    if stamp != seen:
        seen = stamp
        try:
            batch = 256 if open(control).read().strip() == "slow" else 8
        except OSError:
            batch = 8
    with torch.inference_mode():
        model(torch.randn(batch, 256)).argmax(1)
    time.sleep(0.01)
"""


def server_deployment(image: str, control_dir: str) -> dict:
    """Deployment `web`: two replicas of SERVER on the gpulens image (Debian's python3; torch from
    this machine's venv by hostPath, as the trainers get it). A rolling update surges one new pod
    and takes no old one down before a new one is Ready."""
    site = torch_site()
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": DEPLOYMENT},
        "spec": {
            "replicas": 2, "selector": {"matchLabels": {"app": DEPLOYMENT}},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {"metadata": {"labels": {"app": DEPLOYMENT}}, "spec": {
                "terminationGracePeriodSeconds": 2,
                "containers": [{
                    "name": "server", "image": image, "imagePullPolicy": "Never",
                    "command": ["python3", "-c", SERVER],
                    "env": [{"name": "PYTHONPATH", "value": site}, {"name": "OMP_NUM_THREADS", "value": "1"},
                            {"name": "HOME", "value": "/tmp"}],
                    "securityContext": {"runAsUser": 0},      # writes into the registry host folder
                    "resources": {"requests": {"cpu": "50m"}},
                    "volumeMounts": [{"name": "site", "mountPath": site, "readOnly": True},
                                     {"name": "control", "mountPath": "/control", "readOnly": True}]}],
                "volumes": [{"name": "site", "hostPath": {"path": site, "type": "Directory"}},
                            {"name": "control", "hostPath": {"path": control_dir, "type": "Directory"}}]}}}}


def _apps(api):
    from kubernetes import client
    return client.AppsV1Api(api.api_client)


def _custom(api):
    from kubernetes import client
    return client.CustomObjectsApi(api.api_client)


def coordinators(api, ns: str) -> dict[str, dict]:
    """jobId -> its CaptureCoordinator (those not being deleted)."""
    items = _custom(api).list_namespaced_custom_object(L.GROUP, L.VERSION, ns, L.PLURAL)["items"]
    return {c["spec"]["jobId"]: c for c in items if not c["metadata"].get("deletionTimestamp")}


def ready_coordinator_pod(api, ns: str, job: str):
    name = L.coordinator_name(job, 0)
    pods = [p for p in api.list_namespaced_pod(ns, label_selector=COORDINATORS).items
            if p.metadata.name == name and p.status.container_statuses
            and all(c.ready for c in p.status.container_statuses)]
    return pods[0] if pods else None


def revision_pods(api, ns: str, job: str) -> list:
    """The live pods of one revision (by the job label the webhook stamped), by name."""
    pods = api.list_namespaced_pod(ns, label_selector=f"{REPLICAS},{L.JOB}={job}").items
    return sorted((p for p in pods if not p.metadata.deletion_timestamp), key=lambda p: p.metadata.name)


def _tokens(api) -> dict[str, str]:
    secret = next(s for s in api.list_namespaced_secret(NS).items if s.data and "gateway" in s.data)
    return {k: base64.b64decode(v).decode() for k, v in secret.data.items()}


def registered(api, ns: str, job: str) -> dict[str, dict]:
    """pod -> its live registration record, as the node agent lists them to coordinators."""
    req = urllib.request.Request(f"{AGENT}/v1/workers", headers={"Authorization": f"Bearer {_tokens(api)['agent']}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        workers = json.loads(r.read())["workers"]
    return {w["pod"]: w for w in workers if w.get("alive") and w.get("namespace") == ns and w.get("job_id") == job}


def namespace_gone(api, name: str) -> bool:
    from kubernetes.client.rest import ApiException
    try:
        api.read_namespace(name)
        return False
    except ApiException as e:
        if e.status == 404:
            return True
        raise


class Serving:
    """The serving namespace, its control folder, and the first revision's job and pods."""

    def __init__(self, ns: str, control):
        self.ns, self.control = ns, control
        self.job = ""
        self.pods: list[str] = []


@pytest.fixture(scope="module")
def serving(release, api, gpulens_image):
    """Deployment `web` (two replicas) in a fresh namespace labelled gpulens.dev/serving=enabled,
    both replicas running and registered with the node agent. The namespace is deleted at the end
    and waited for until it is gone: a later module's checks must not see it terminating."""
    from kubernetes import client
    ns = f"serve-{uuid.uuid4().hex[:6]}"
    control = STATE / "control" / ns            # under the cluster's state: `down` removes it
    control.mkdir(parents=True)
    api.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(
        name=ns, labels={L.NAMESPACE_SERVING: "enabled"})))
    try:
        s = Serving(ns, control)
        _apps(api).create_namespaced_deployment(ns, server_deployment(gpulens_image, str(control)))
        rs = wait_until("the Deployment's ReplicaSet", lambda: _apps(api).list_namespaced_replica_set(
            ns, label_selector=REPLICAS).items, 120)
        assert len(rs) == 1, [r.metadata.name for r in rs]
        s.job = rs[0].metadata.name

        def running():
            pods = revision_pods(api, ns, s.job)
            for p in pods:
                assert p.status.phase not in ("Failed", "Succeeded"), pod_log(api, ns, p.metadata.name)[-3000:]
            up = [p for p in pods if p.status.phase == "Running"
                  and "serving-replica" in pod_log(api, ns, p.metadata.name, "server")]
            return len(up) == 2 and up
        s.pods = [p.metadata.name for p in wait_until("both replicas armed and serving", running, 300, 1)]
        wait_until("both replicas registered with the node agent",
                   lambda: set(registered(api, ns, s.job)) == set(s.pods), 120, 1)
        yield s
    finally:
        api.delete_namespace(ns)
        wait_until(f"namespace {ns} deleted", lambda: namespace_gone(api, ns), 300, 1)
        shutil.rmtree(control, ignore_errors=True)


def _replica_pod(ns: str, rs: str, template_hash: str, labels: dict | None = None) -> dict:
    """A pod shaped as the ReplicaSet controller submits it (owner reference and pod-template-hash)."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"generateName": f"{rs}-", "namespace": ns,
                         "labels": {"app": "probe", "pod-template-hash": template_hash, **(labels or {})},
                         "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": rs,
                                              "uid": str(uuid.uuid4()), "controller": True}]},
            "spec": {"containers": [{"name": "server", "image": "localhost/none:1", "command": ["python3", "serve.py"]}]}}


def test_both_serving_opt_ins_arm_on_this_kubernetes_and_nothing_else_does(serving, api, capsys):
    """Dry-run creates through the real API server and webhook (nothing is persisted). The per-workload
    entry selects namespaces with `kubernetes.io/metadata.name NotIn [kube-system, <release ns>]`,
    a label the API server sets only from 1.21: on 1.20 it matches every namespace, so the
    exclusion must hold in the webhook itself."""
    from kubernetes import client
    version = client.VersionApi(api.api_client).get_code()
    labels_of = {n: api.read_namespace(n).metadata.labels or {} for n in ("default", "kube-system", NS, serving.ns)}
    assert not any(k.startswith("gpulens.dev/") for k in labels_of["default"]), labels_of["default"]
    with capsys.disabled():
        print(f"\n[serving] Kubernetes {version.git_version}: kube-system's labels {labels_of['kube-system']}")

    def armed(ns: str, labels: dict | None = None) -> dict:
        pod = api.create_namespaced_pod(ns, _replica_pod(ns, "probe-5d8f7c9b6", "5d8f7c9b6", labels), dry_run="All")
        return pod.metadata.labels or {}

    # per workload: gpulens.dev/arm=true on the pod template, in a namespace nobody labelled
    got = armed("default", {L.ARM_OPT_OUT: "true"})
    assert got.get(L.ARMED) == "true" and got.get(L.JOB) == "probe-5d8f7c9b6" and got.get(L.SERVING) == "Deployment", \
        (version.git_version, labels_of["default"], got)
    # per namespace: gpulens.dev/serving=enabled, no label on the pod
    got = armed(serving.ns)
    assert got.get(L.ARMED) == "true" and got.get(L.JOB) == "probe-5d8f7c9b6", got
    # neither: left alone; opted out in a serving namespace: left alone
    assert L.ARMED not in armed("default")
    assert L.ARMED not in armed(serving.ns, {L.ARM_OPT_OUT: "false"})
    # never kube-system or the release's own namespace, whatever the API server's namespace labels
    for ns in ("kube-system", NS):
        assert L.ARMED not in armed(ns, {L.ARM_OPT_OUT: "true"}), (version.git_version, ns, labels_of[ns])
    if "kubernetes.io/metadata.name" not in labels_of["kube-system"]:
        # 1.20: the entry's selector let kube-system's pod through, and the webhook itself said no
        wait_until("the webhook's skip of the kube-system pod in the operators' logs", lambda: any(
            "event=pod.skipped" in line and "namespace=kube-system" in line and "never armed" in line
            for line in pod_logs(api, NS, "app.kubernetes.io/component=operator").splitlines()), 30, 1)


def test_the_replicas_are_armed_as_their_revision_with_one_coordinator(serving, api):
    ns, job = serving.ns, serving.job
    assert job.startswith(f"{DEPLOYMENT}-")
    for name in serving.pods:
        p = api.read_namespaced_pod(name, ns)
        lbl = p.metadata.labels
        assert (lbl.get(L.ARMED), lbl.get(L.JOB), lbl.get(L.SERVING), lbl.get(L.ATTEMPT)) == \
            ("true", job, "Deployment", "0"), lbl
        assert [c.name for c in p.spec.init_containers or []] == ["gpulens-hook"]
        # one worker per replica, its own world (rank 0 of 1), registered under the revision's job
        rec = registered(api, ns, job)[name]
        assert (rec["global_rank"], rec["world_size"], rec["attempt"]) == (0, 1, 0), rec
    ccs = wait_until("the revision's CaptureCoordinator", lambda: coordinators(api, ns), 120)
    assert list(ccs) == [job], list(ccs)
    pod = wait_until("its coordinator pod Ready", lambda: ready_coordinator_pod(api, ns, job), 300, 1)
    args = pod.spec.containers[0].args or pod.spec.containers[0].command
    assert "--serving" in args, args


@pytest.fixture(scope="module")
def replica_capture(serving, api) -> dict:
    """A person's capture of one named replica (the slowed one) plus one healthy peer, typed as
    docs/kubernetes.md shows it: `gpulens capture start --workload Deployment/web --pod <replica>
    --peers 1` against the chart's gateway, which knows no pods (issue 43 item 12). One capture id
    for every try, so a retry while the coordinator comes up can never start a second capture."""
    ns = serving.ns
    affected = serving.pods[-1]
    (serving.control / affected).write_text("slow")
    wait_until("the coordinator pod Ready", lambda: ready_coordinator_pod(api, ns, serving.job), 300, 1)
    base, token = gateway(api)
    capture_id = new_capture_id()
    cmd = [sys.executable, "-m", "gpulens.cli", "capture", "start", "--url", base, "--namespace", ns,
           "--workload", f"Deployment/{DEPLOYMENT}", "--pod", affected, "--peers", "1", "--duration-ms", "2000",
           "--capture-id", capture_id]
    tries: list = []

    def started():
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False,
                             env={**os.environ, "GPULENS_TOKEN": token})
        tries.append((run.returncode, run.stderr.strip()[-400:]))
        assert run.returncode in (0, 4), tries          # 2 (bad usage, "belongs to no known job") fails at once
        return run.returncode == 0 and run.stdout.split()

    out = wait_until("the CLI's capture accepted by the gateway", started, 240, 2)
    assert out == [capture_id], (out, tries)
    return wait_converged(api, capture_id)      # its manifest names the revision's job (the test below)


def test_a_capture_of_a_named_replica_and_a_healthy_peer_archives_both(serving, api, s3, replica_capture):
    done = replica_capture
    affected, peer = serving.pods[-1], serving.pods[0]
    assert done["phase"] == "converged" and done["fully_succeeded"], json.dumps(done)[:3000]
    assert done["counts"] == {"archived": 2}, done["counts"]
    manifest = read_manifest(s3, done["manifest_uri"])
    assert manifest["job_id"] == serving.job and manifest["failures"] == []
    assert manifest["request"]["pods"] == [affected] and manifest["request"]["peers"] == 1, manifest["request"]
    # the named pod first, then the peer; capture ranks 0 and 1 (both replicas' worker says rank 0)
    assert sorted((a["rank"], a["pod"]) for a in manifest["artifacts"]) == [(0, affected), (1, peer)]
    cli = s3.client()
    for art in manifest["artifacts"]:
        b, _, k = art["uri"].removeprefix("s3://").partition("/")
        assert cli.head_object(Bucket=b, Key=k)["ContentLength"] == art["size"] > 0


def test_the_report_compares_the_affected_replica_with_its_peer(serving, api, s3, replica_capture):
    cid = replica_capture["capture_id"]
    affected, peer = serving.pods[-1], serving.pods[0]
    status = wait_until("the capture's analysis finished", lambda: (
        lambda st: st.get("analysis", {}).get("state") in ("done", "failed", "skipped", "disabled") and st)(
        capture_status(api, cid)), 900, 2)
    assert status["analysis"]["state"] == "done", json.dumps(status)[:3000]
    bucket, _, key = status["report_uri"].removeprefix("s3://").partition("/")
    cli = s3.client()
    summary = json.loads(cli.get_object(Bucket=bucket, Key=key.replace("report.html", "summary.json"))["Body"].read())
    rep = summary.get("replicas")
    assert rep, sorted(summary)
    assert rep["affected_pods"] == [affected] and rep["peer_pods"] == [peer], rep
    assert [(p["pod"], p["peer_pod"]) for p in rep["pairs"]] == [(affected, peer)], rep["pairs"]
    # 32x larger batches on the affected replica, same cadence: its model's operators take longer
    top = rep["operators"][0]
    assert top["delta_us"] > 0 and top["us"] > top["peer_us"], rep["operators"][:3]
    assert affected in rep["why"] and peer in rep["why"], rep["why"]
    html = cli.get_object(Bucket=bucket, Key=key)["Body"].read().decode()
    assert "Affected replica against its healthy peer" in html and affected in html and peer in html


def test_a_rolling_update_gets_its_own_coordinator_and_the_old_one_goes_with_its_last_pod(serving, api):
    """The new template's pods wait on a readiness gate (a file in the control folder), so the
    update stops mid-way (one new pod, both old ones) until the test opens it."""
    ns, old = serving.ns, serving.job
    wait_until("the first revision's coordinator pod Ready", lambda: ready_coordinator_pod(api, ns, old), 300, 1)
    old_cc = coordinators(api, ns)[old]
    gate = {"exec": {"command": ["test", "-e", "/control/rollout"]}, "periodSeconds": 1}
    _apps(api).patch_namespaced_deployment(DEPLOYMENT, ns, {"spec": {"template": {"spec": {"containers": [
        {"name": "server", "env": [{"name": "MODEL_REVISION", "value": "2"}], "readinessProbe": gate}]}}}})

    def new_revision():
        names = {r.metadata.name for r in _apps(api).list_namespaced_replica_set(ns, label_selector=REPLICAS).items}
        return [n for n in names if n != old]
    (new,) = wait_until("the update's ReplicaSet", new_revision, 120)
    # mid-way: the new revision has a pod (armed as the new job) and its own coordinator; the old
    # revision's pods and coordinator are all still there
    (first,) = wait_until("the new revision's first pod", lambda: revision_pods(api, ns, new), 120)
    assert first.metadata.labels[L.JOB] == new and first.metadata.labels[L.SERVING] == "Deployment"
    wait_until("the new revision's CaptureCoordinator", lambda: new in coordinators(api, ns), 120)
    wait_until("the new revision's coordinator pod Ready", lambda: ready_coordinator_pod(api, ns, new), 300, 1)
    assert sorted(coordinators(api, ns)) == sorted([old, new])
    assert coordinators(api, ns)[old]["metadata"]["uid"] == old_cc["metadata"]["uid"]
    assert [p.metadata.name for p in revision_pods(api, ns, old)] == serving.pods
    assert len(revision_pods(api, ns, new)) == 1

    (serving.control / "rollout").write_text("go")
    wait_until("the update finished: two new replicas Ready, no old one left", lambda: (
        len([p for p in revision_pods(api, ns, new) if p.status.container_statuses
             and all(c.ready for c in p.status.container_statuses)]) == 2
        and not api.list_namespaced_pod(ns, label_selector=f"{REPLICAS},{L.JOB}={old}").items), 300, 1)
    wait_until("the old revision's coordinator collected", lambda: list(coordinators(api, ns)) == [new], 120, 1)
    old_name = L.coordinator_name(old, 0)
    wait_until("the old coordinator's pod and Service gone", lambda: not [
        p for p in api.list_namespaced_pod(ns, label_selector=COORDINATORS).items if p.metadata.name == old_name]
        and not [s for s in api.list_namespaced_service(ns).items if s.metadata.name == L.service_name(old)], 120, 1)
    assert ready_coordinator_pod(api, ns, new) is not None
    assert set(registered(api, ns, new)) == {p.metadata.name for p in revision_pods(api, ns, new)}


def test_the_serving_loop_ran_without_a_403(serving, api):
    assert {**forbidden_in_logs(api, NS), **forbidden_in_logs(api, serving.ns)} == {}
