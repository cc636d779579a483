"""Pod lookup through the real `kubernetes` client against kmock (a Kubernetes API emulator over HTTP),
and attribution of a real process placed in a kubepods-style cgroup."""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path

import aiohttp
import pytest
from kubernetes import client

from gpulens.exporter.attribution import Attributor, Workload
from gpulens.exporter.kube import PodIndex, PodInfo
from gpulens.exporter.procfs import ProcFS
from gpulens.exporter.service import Exporter

from .conftest import bcc_usable, make_config, scrape, value
from tests.conftest import requires

NODE = "node-a"


def pod(name: str, uid: str, node: str, namespace: str = "team-a", containers: dict[str, str] | None = None,
        labels: dict[str, str] | None = None, owners: list[dict] | None = None) -> dict:
    meta = {"name": name, "namespace": namespace, "uid": uid, "resourceVersion": "1"}
    if labels:
        meta["labels"] = labels
    if owners:
        meta["ownerReferences"] = [{"controller": True, "uid": str(uuid.uuid4()), **o} for o in owners]
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": meta,
        "spec": {"nodeName": node, "containers": [{"name": n, "image": "x"} for n in (containers or {}).values()]},
        "status": {"containerStatuses": [{"name": n, "containerID": cid, "ready": True, "restartCount": 0,
                                          "image": "x", "imageID": "x"}
                                         for cid, n in (containers or {}).items()]},
    }


def api_factory(kmock):
    def make():
        cfg = client.Configuration(host=str(kmock.url).rstrip("/"))
        return client.ApiClient(cfg)
    return make


async def eventually(predicate, timeout: float = 15.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.05)


@pytest.fixture
async def index(kmock):
    kmock.resources["v1/pods"] = {}
    idx = PodIndex(api_factory(kmock), NODE, watch_timeout_s=2, read_timeout_s=3, backoff_s=(0.1, 0.2))
    yield idx
    await asyncio.to_thread(idx.stop)


CID = "a" * 64


async def test_lists_only_this_nodes_pods_with_a_field_selector(kmock, index):
    uid_here, uid_there = str(uuid.uuid4()), str(uuid.uuid4())
    kmock.objects["v1/pods", "team-a", "trainer-0"] = pod("trainer-0", uid_here, NODE, containers={f"containerd://{CID}": "trainer"})
    # kmock does not filter by field selector; the index must still keep only its node's pods
    kmock.objects["v1/pods", "team-b", "elsewhere"] = pod("elsewhere", uid_there, "node-b")
    index.start()
    await eventually(index.synced.is_set)
    assert index.get(uid_here) == PodInfo(uid=uid_here, namespace="team-a", name="trainer-0", node=NODE,
                                          containers={CID: "trainer"}, workload="Pod/trainer-0")
    assert index.get(uid_there) is None
    pod_requests = [r for r in kmock["get"] if "/pods" in str(r.url)]
    assert pod_requests
    assert all(r.params.get("fieldSelector") == f"spec.nodeName={NODE}" for r in pod_requests)
    assert any(r.params.get("watch") in ("true", "True", "1") for r in pod_requests)


async def test_pods_job_id_comes_from_its_labels_through_list_and_watch(kmock, index):
    """gpulens_job for a pod, read from the pod objects the index already lists and watches (the
    real client's V1Pod models, not dicts): the explicit label wins, then the job controllers'."""
    labelled, jobset, batch, plain = (str(uuid.uuid4()) for _ in range(4))
    kmock.objects["v1/pods", "ml", "l-0"] = pod("l-0", labelled, NODE, namespace="ml",
                                                labels={"gpulens.dev/job": "llama-ft", "job-name": "llama-ft-x"})
    # a JobSet's pods also carry their child Job's name: the JobSet is the job (as for the operator)
    kmock.objects["v1/pods", "ml", "js-0"] = pod("js-0", jobset, NODE, namespace="ml", labels={
        "jobset.sigs.k8s.io/jobset-name": "pretrain", "job-name": "pretrain-workers-0",
        "batch.kubernetes.io/job-name": "pretrain-workers-0"})
    kmock.objects["v1/pods", "ml", "b-0"] = pod("b-0", batch, NODE, namespace="ml", labels={"job-name": "nightly"})
    kmock.objects["v1/pods", "ml", "plain"] = pod("plain", plain, NODE, namespace="ml", labels={"app": "web"})
    index.start()
    await eventually(index.synced.is_set)
    assert {u: index.get(u).job for u in (labelled, jobset, batch, plain)} == \
        {labelled: "llama-ft", jobset: "pretrain", batch: "nightly", plain: ""}
    assert {u: index.get(u).workload for u in (labelled, jobset, batch, plain)} == \
        {labelled: "job/llama-ft", jobset: "job/pretrain", batch: "job/nightly", plain: "Pod/plain"}
    # a pod that arrives through the watch, owned by a PyTorchJob
    late = str(uuid.uuid4())
    base = str(kmock.url).rstrip("/")
    async with aiohttp.ClientSession() as s:
        r = await s.post(f"{base}/api/v1/namespaces/ml/pods", json=pod(
            "bert-worker-0", late, NODE, namespace="ml", labels={"training.kubeflow.org/job-name": "bert"},
            owners=[{"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": "bert"}]))
        assert r.status < 300
    await eventually(lambda: index.get(late) is not None)
    assert index.get(late).job == "bert"


def _operator_job_id(p: dict) -> str | None:
    from gpulens.capture.operator.jobs import job_of_pod as operator_job_of_pod
    ref = operator_job_of_pod(p)
    return ref.job_id if ref else None


@pytest.mark.parametrize("labels,owners", [
    ({"gpulens.dev/job": "exp-1", "jobset.sigs.k8s.io/jobset-name": "js"}, []),
    ({"gpulens.dev/job": "", "job-name": "j"}, []),
    ({"jobset.sigs.k8s.io/jobset-name": "js", "batch.kubernetes.io/job-name": "js-w-0", "job-name": "js-w-0"}, []),
    ({"training.kubeflow.org/job-name": "bert"}, [{"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": "bert"}]),
    ({}, [{"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": "owned"}]),
    ({"batch.kubernetes.io/job-name": "new", "job-name": "old"}, []),
    ({"job-name": "legacy"}, []),
    ({}, [{"apiVersion": "batch/v1", "kind": "Job", "name": "owner-only"}]),
    ({"app": "x"}, [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "rs"}]),
])
def test_job_id_is_the_one_the_operator_gives_the_coordinator(labels, owners):
    """Exporter and capture never import each other, so the rule is duplicated; this keeps both in step
    (the gateway calls the Service of the job the alert names, which the operator made for its job id)."""
    from gpulens.exporter.kube import job_of_pod, pod_info
    p = pod("w-0", "u-1", NODE, labels=labels, owners=owners)
    expected = _operator_job_id(p)
    assert pod_info(p).job == (expected or "")
    assert job_of_pod(client.ApiClient().deserialize(_Resp(p), "V1Pod").metadata) == (expected or "")


_RS = {"apiVersion": "apps/v1", "kind": "ReplicaSet"}


@pytest.mark.parametrize("name,labels,owners,workload", [
    # a job known by any of the operator's rules: the job is the workload
    ("w-0", {"gpulens.dev/job": "llama-ft", "pod-template-hash": "abc12"}, [{**_RS, "name": "x-abc12"}], "job/llama-ft"),
    ("w-0", {"training.kubeflow.org/job-name": "bert"},
     [{"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": "bert"}], "job/bert"),
    ("w-0", {"jobset.sigs.k8s.io/jobset-name": "pretrain", "job-name": "pretrain-workers-0"}, [], "job/pretrain"),
    ("w-0", {"job-name": "train-v2"}, [{"apiVersion": "batch/v1", "kind": "Job", "name": "train-v2"}], "job/train-v2"),
    # a CronJob's run: its Job name changes every run, the CronJob does not
    ("n-1", {"batch.kubernetes.io/job-name": "nightly-29412345"},
     [{"apiVersion": "batch/v1", "kind": "Job", "name": "nightly-29412345"}], "CronJob/nightly"),
    ("n-1", {"gpulens.dev/job": "nightly-29412345", "job-name": "nightly-29412345"}, [], "job/nightly-29412345"),
    # a Deployment: each rollout has a new ReplicaSet <deployment>-<pod-template-hash>
    ("web-6d5f8c7b9-x2lqm", {"pod-template-hash": "6d5f8c7b9"}, [{**_RS, "name": "web-6d5f8c7b9"}], "Deployment/web"),
    ("web-7c9d6b5f4-k8mzt", {"pod-template-hash": "7c9d6b5f4"}, [{**_RS, "name": "web-7c9d6b5f4"}], "Deployment/web"),
    # armed for serving (issue 30): the job label names the revision, the workload stays the Deployment
    ("web-6d5f8c7b9-x2lqm", {"pod-template-hash": "6d5f8c7b9", "gpulens.dev/job": "web-6d5f8c7b9",
                             "gpulens.dev/serving": "Deployment"}, [{**_RS, "name": "web-6d5f8c7b9"}], "Deployment/web"),
    ("db-0", {"gpulens.dev/job": "db-5d8f7", "gpulens.dev/serving": "StatefulSet"},
     [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "db"}], "StatefulSet/db"),
    ("rs-1", {}, [{**_RS, "name": "bare-rs"}], "ReplicaSet/bare-rs"),
    ("rs-1", {"pod-template-hash": "zzz"}, [{**_RS, "name": "other-name"}], "ReplicaSet/other-name"),
    ("db-0", {}, [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "db"}], "StatefulSet/db"),
    ("agent-x", {}, [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "agent"}], "DaemonSet/agent"),
    ("head-0", {}, [{"apiVersion": "ray.io/v1", "kind": "RayCluster", "name": "r1"}], "RayCluster/r1"),
    # unowned: the pod is its own workload
    ("lonely", {"app": "x"}, [], "Pod/lonely"),
])
def test_workload_of_a_pod_survives_its_replacement(name, labels, owners, workload):
    from gpulens.exporter.kube import pod_info, workload_of_pod
    p = pod(name, "u-1", NODE, labels=labels, owners=owners)
    assert pod_info(p).workload == workload
    assert workload_of_pod(client.ApiClient().deserialize(_Resp(p), "V1Pod").metadata) == workload


def test_workload_prefers_the_controlling_owner_and_ignores_broken_references():
    from gpulens.exporter.kube import workload_of_pod
    meta = {"name": "p", "ownerReferences": [{"kind": "ConfigMap", "name": "cm"},
                                             {"kind": "StatefulSet", "name": "db", "controller": True}]}
    assert workload_of_pod(meta) == "StatefulSet/db"
    assert workload_of_pod({"name": "p", "ownerReferences": [{"kind": "StatefulSet"}, {"name": "x"}]}) == "Pod/p"
    assert workload_of_pod({"name": "p", "labels": "not-a-map", "ownerReferences": None}) == "Pod/p"
    # a ReplicaSet name that is only the hash is not a Deployment's
    assert workload_of_pod({"name": "p", "labels": {"pod-template-hash": "h"},
                            "ownerReferences": [{"kind": "ReplicaSet", "name": "-h"}]}) == "ReplicaSet/-h"


def test_workload_label_of_registrations_and_local_processes():
    from gpulens.exporter.attribution import local_workload, workload_id
    assert workload_id(Workload("ml", "trainer-7", "c", "registration", "llama-ft")) == "job/llama-ft"
    assert workload_id(Workload("ml", "trainer-7", "c", "registration", "")) == "Pod/trainer-7"
    assert workload_id(local_workload("python3")) == "Pod/python3"
    assert workload_id(Workload("ml", "web-1", "c", "kubernetes", "", "Deployment/web")) == "Deployment/web"


class _Resp:
    """What ApiClient.deserialize reads: a response with `.data` (the JSON text)."""

    def __init__(self, obj: dict):
        import json
        self.data = json.dumps(obj)


def test_label_names_match_the_operators():
    import gpulens.capture.wire.labels as L
    from gpulens.exporter import kube
    assert (kube.SERVING_LABEL, kube.SERVING_KINDS) == (L.SERVING, L.SERVING_KINDS)
    assert (kube.JOB_LABEL, kube.BATCH_JOB_NAME, kube.LEGACY_JOB_NAME, kube.JOBSET_NAME, kube.PYTORCHJOB_NAME) == \
        (L.JOB, L.BATCH_JOB_NAME, L.LEGACY_JOB_NAME, L.JOBSET_NAME, L.PYTORCHJOB_NAME)


async def test_watch_adds_and_removes_pods(kmock, index):
    index.start()
    await eventually(index.synced.is_set)
    uid = str(uuid.uuid4())
    base = str(kmock.url).rstrip("/")
    async with aiohttp.ClientSession() as s:
        r = await s.post(f"{base}/api/v1/namespaces/team-a/pods",
                         json=pod("late", uid, NODE, containers={f"cri-o://{CID}": "main"}))
        assert r.status < 300
        await eventually(lambda: index.get(uid) is not None)
        assert index.get(uid).containers == {CID: "main"}
        r = await s.delete(f"{base}/api/v1/namespaces/team-a/pods/late")
        assert r.status < 300
        await eventually(lambda: index.get(uid) is None)


async def test_api_errors_are_recorded_and_the_index_recovers(kmock, index):
    uid = str(uuid.uuid4())
    kmock.objects["v1/pods", "team-a", "p"] = pod("p", uid, NODE)
    kmock["list"][:2] << 500
    index.start()
    await eventually(lambda: index.errors >= 2)
    assert not index.synced.is_set()
    assert "500" in (index.last_error or "")
    await eventually(index.synced.is_set)
    assert index.get(uid) is not None
    assert index.last_error is None


async def test_unreachable_api_server_does_not_crash(tmp_path):
    def unreachable():
        return client.ApiClient(client.Configuration(host="http://127.0.0.1:9"))   # discard port: refused
    idx = PodIndex(unreachable, NODE, read_timeout_s=1, backoff_s=(0.05,))
    idx.start()
    try:
        await eventually(lambda: idx.errors >= 2)
        assert not idx.synced.is_set() and idx.last_error
    finally:
        await asyncio.to_thread(idx.stop)


def test_pod_info_from_raw_dict_and_bad_objects():
    assert PodInfo is not None
    from gpulens.exporter.kube import pod_info
    info = pod_info(pod("x", "u-1", NODE, containers={f"docker://{CID}": "c"}))
    assert info.containers == {CID: "c"} and info.node == NODE
    assert pod_info({"metadata": {}}) is None
    assert pod_info(None) is None
    assert pod_info({"metadata": {"uid": "u"}, "status": {"containerStatuses": [{"name": "c"}]}}).containers == {}


# ---- a real process in a kubepods cgroup -----------------------------------------------------------

def _cgroup2_mount() -> Path | None:
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            if right.split()[0] == "cgroup2":
                return Path(left.split()[4])
    return None


@pytest.fixture
def kube_cgroup():
    """Create <cgroup2>/gpulens-test-*/kubepods-burstable-pod<uid>.slice/cri-containerd-<id>.scope."""
    mount = _cgroup2_mount()
    if os.geteuid() != 0 or mount is None:
        pytest.skip("needs root and a cgroup2 mount")
    uid = str(uuid.uuid4())
    cid = uuid.uuid4().hex * 2
    top = mount / f"gpulens-test-{uuid.uuid4().hex[:8]}.slice"
    leaf = top / f"kubepods-burstable-pod{uid.replace('-', '_')}.slice" / f"cri-containerd-{cid}.scope"
    try:
        leaf.mkdir(parents=True)
    except OSError as exc:
        pytest.skip(f"cannot create cgroups here: {exc}")
    moved: list[int] = []

    def enter(pid: int) -> None:
        (leaf / "cgroup.procs").write_text(str(pid))
        moved.append(pid)

    yield uid, cid, enter
    for pid in moved:
        try:
            (mount / "cgroup.procs").write_text(str(pid))
        except OSError:
            pass   # already exited
    for d in (leaf, leaf.parent, top):
        try:
            d.rmdir()
        except OSError:
            pass


@pytest.mark.root
async def test_attributor_uses_cgroup_and_pod_index(kmock, index, kube_cgroup):
    uid, cid, enter = kube_cgroup
    kmock.objects["v1/pods", "ml", "trainer-7"] = pod("trainer-7", uid, NODE, namespace="ml",
                                                      containers={f"containerd://{cid}": "pytorch"},
                                                      labels={"gpulens.dev/job": "llama-ft"})
    proc = await asyncio.create_subprocess_exec("sleep", "30")
    try:
        enter(proc.pid)
        attributor = Attributor(ProcFS(), pods=index)
        assert attributor.attribute(proc.pid) is None          # pod named by the cgroup, index not synced yet
        index.start()
        await eventually(index.synced.is_set)
        assert attributor.attribute(proc.pid) == Workload("ml", "trainer-7", "pytorch", "kubernetes", "llama-ft",
                                                          "job/llama-ft")
        # without Kubernetes the same process falls back to its name
        assert Attributor(ProcFS()).attribute(proc.pid) == Workload("local", "sleep", "", "local")
    finally:
        proc.kill()
        await proc.wait()


@pytest.mark.root
@requires(bcc_usable())
async def test_exporter_labels_workload_with_its_kubernetes_pod(kmock, index, kube_cgroup, stub, libcuda, tmp_path):
    uid, cid, enter = kube_cgroup
    kmock.objects["v1/pods", "ml", "trainer-0"] = pod("trainer-0", uid, NODE, namespace="ml",
                                                      containers={f"containerd://{cid}": "pytorch"},
                                                      labels={"gpulens.dev/job": "llama-ft"})
    exp = Exporter(make_config(tmp_path, libcuda, node=NODE, kubernetes=True), pod_index=index)
    await asyncio.to_thread(exp.start)
    proc = await asyncio.create_subprocess_exec(str(stub.workload), "--lib", str(libcuda), "--wait-stdin",
                                                "--steps", "20", "--kernels", "5", stdin=asyncio.subprocess.PIPE,
                                                stdout=asyncio.subprocess.PIPE)
    try:
        assert (await proc.stdout.readline()).startswith(b"ready")
        enter(proc.pid)
        await eventually(index.synced.is_set)
        for _i in range(100):
            await asyncio.to_thread(exp.tick)
            if exp.probes.libraries:
                break
            await asyncio.sleep(0.05)
        proc.stdin.write(b"go\n")
        await proc.stdin.drain()
        await proc.stdout.readline()          # the report: loop done
        s = await asyncio.to_thread(scrape, exp)
        assert value(s, "gpulens_kernel_launches_total", namespace="ml", pod="trainer-0", container="pytorch",
                     node=NODE, gpulens_job="llama-ft", gpulens_workload="job/llama-ft") == 100
        assert value(s, "gpulens_exporter_source_info", source="attribution", state="ok") == 1
    finally:
        proc.kill()
        await proc.wait()
        await asyncio.to_thread(exp.close)


async def test_expired_watch_relists_at_once_without_counting_an_error(kmock, index):
    """410 Gone on the watch (our resourceVersion is too old) means: list again, now."""
    uid = str(uuid.uuid4())
    kmock.objects["v1/pods", "team-a", "p"] = pod("p", uid, NODE)
    kmock["watch"][:1] << {"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                                       "code": 410, "reason": "Expired",
                                                       "message": "too old resource version"}}
    index.start()
    await eventually(lambda: index.lists >= 2)
    assert index.errors == 0
    assert index.get(uid) is not None
