"""The README's single-node trial ("Deploy on Kubernetes"), run exactly as printed: a release with
its own name (`lens`) in its own namespace, a `file://` archive in a host folder, a two-worker
torchrun Job in the namespace the README arms, and a capture through the release's gateway: both
ranks archived in that host folder, the manifest naming both, the analysis Job's report beside it.

One node holds one release's host-network exporter and agent, so the release the earlier tests
installed (`gl`) is uninstalled first, as a user replacing it would."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import pytest

from .conftest import REUSE, own_pythonpath_image
from .harness import NS, RELEASE, REPO, STATE, wait_until
from .readme_install import TRIAL_MARKS, Install
from .workload import JOB, call, start_trainer, torch_site

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(3600)]

ARCHIVE = STATE / "trial-archive"       # under the cluster's state: `down` removes it


def _uninstall_earlier_release(cluster, api) -> None:
    from helm_python import Config
    cfg = Config(kubeconfig_path=cluster.kubeconfig, namespace=NS)
    if any(r.get("name") == RELEASE for r in cfg.list(name_filter=f"^{RELEASE}$") or []):
        cfg.uninstall(RELEASE, wait="watcher", timeout=300)
    wait_until(f"release {RELEASE}'s pods gone", lambda: not [
        p for p in api.list_namespaced_pod(NS).items if (p.metadata.labels or {}).get("app.kubernetes.io/instance")
        == RELEASE], 300, 1)


@pytest.fixture(scope="module")
def trial(cluster, api, gpulens_image, tmp_path_factory) -> Install:
    _uninstall_earlier_release(cluster, api)
    repo, _, tag = gpulens_image.rpartition(":")
    install = Install.from_readme(REPO / "README.md", {"VERSION": tag, "ARCHIVE_DIR": str(ARCHIVE)}, TRIAL_MARKS)
    assert install.values["image"]["repository"] == repo, "the README's trial installs another image"
    install.run(cluster.kubeconfig, REPO, tmp_path_factory.mktemp("readme-trial"))
    yield install
    if REUSE:      # a kept cluster's next session installs `gl` again: one node, one release
        from helm_python import Config
        Config(kubeconfig_path=cluster.kubeconfig, namespace=install.helm.args["namespace"]).uninstall(
            install.helm.args["release"], wait="watcher", timeout=300)


def _armed_namespace(install: Install) -> str:
    (label,) = [s for s in install.steps if s.verb == "label" and s.args["labels"].get("gpulens.dev/arming")]
    return label.args["name"]


def _gateway(api, namespace: str) -> tuple[str, str]:
    (svc,) = [s for s in api.list_namespaced_service(namespace).items
              if (s.metadata.labels or {}).get("app.kubernetes.io/component") == "gateway"]
    secret = next(s for s in api.list_namespaced_secret(namespace).items if s.data and "gateway" in s.data)
    return f"http://{svc.spec.cluster_ip}:{svc.spec.ports[0].port}", base64.b64decode(secret.data["gateway"]).decode()


@pytest.fixture(scope="module")
def trainer(trial, api, gpulens_image):
    """The trainer Job in the namespace the README arms: (namespace, pod). Its image is someone
    else's shape: torch's folder is on the image's own `ENV PYTHONPATH`, the pod sets none, so the
    trainer imports torch only if arming keeps that path (issue 43)."""
    ns = _armed_namespace(trial)
    return ns, start_trainer(api, ns, own_pythonpath_image(gpulens_image), image_pythonpath=True)


def _coordinator_objects(api, ns: str) -> tuple[list, list]:
    sel = "app.kubernetes.io/component=coordinator"
    return api.list_namespaced_pod(ns, label_selector=sel).items, api.list_namespaced_service(ns, label_selector=sel).items


def test_an_images_own_pythonpath_survives_arming(trainer, api):
    """The trainer stepped (start_trainer waited for both workers), so torch came from the image's
    PYTHONPATH; the webhook read it with an init container of that image, as nobody."""
    ns, pod = trainer
    env = {e.name: e.value for e in pod.spec.containers[0].env or []}
    assert env["PYTHONPATH"] == "/opt/gpulens/hook", env     # what arming must set: the image's is replaced
    (reader,) = [c for c in pod.spec.init_containers if c.name.startswith("gpulens-image-env")]
    assert reader.image == pod.spec.containers[0].image and reader.security_context.run_as_user == 65534
    log = api.read_namespaced_pod_log(pod.metadata.name, ns, container="trainer")
    assert "not armed" not in log and "ModuleNotFoundError" not in log, log[-2000:]


def test_the_coordinator_comes_with_the_jobs_first_pod_not_the_resync(trainer, api, capsys):
    """Readiness (BENCHMARKS.md): the coordinator Pod and Service, from server-side creation times."""
    ns, pod = trainer
    assert (pod.metadata.annotations or {}).get("gpulens.dev/local-world-size") == "2"   # torchrun --nproc-per-node=2
    pods, svcs = wait_until("the coordinator Pod and Service", lambda: (
        lambda o: o[0] and o[1] and o)(_coordinator_objects(api, ns)), 300, 1)
    first = min(p.metadata.creation_timestamp for p in api.list_namespaced_pod(ns, label_selector=f"job-name={JOB}").items)
    with capsys.disabled():
        print(f"\n[readiness] first trainer pod -> coordinator Pod {(pods[0].metadata.creation_timestamp - first).total_seconds():.0f} s, "
              f"Service {(svcs[0].metadata.creation_timestamp - first).total_seconds():.0f} s (1 s resolution)")


def test_the_readme_trial_captures_both_ranks_into_the_host_folder(trial, trainer, api):
    helm = trial.helm.args
    assert helm["release"] not in (RELEASE, "gpulens"), "the trial must use a release name of its own"
    ns, _ = trainer

    base, token = _gateway(api, helm["namespace"])
    assert base and f"{helm['release']}-gpulens-gateway" in [s.metadata.name for s in
                                                             api.list_namespaced_service(helm["namespace"]).items]
    started = wait_until("capture accepted by the trial's gateway", lambda: (
        lambda r: r[0] in (200, 201, 202) and r[1])(call(f"{base}/v1/captures?namespace={ns}", token,
                                                          {"job_id": JOB, "duration_ms": 1500})), 300, 2)
    cid = started["capture_id"]
    done = wait_until(f"capture {cid} analysed", lambda: (
        lambda s: s.get("phase") == "failed" and s or (s.get("analysis", {}).get("state") in
                                                       ("done", "failed", "skipped", "disabled") and s))(
        call(f"{base}/v1/captures/{cid}", token)[1]), 900, 2)
    assert done["phase"] == "converged" and done["fully_succeeded"], json.dumps(done)[:3000]
    assert done["counts"] == {"archived": 2}, done["counts"]

    uri = done["manifest_uri"]
    assert uri.startswith(f"file://{ARCHIVE}/{ns}/{JOB}/"), uri
    manifest = json.loads(Path(uri.removeprefix("file://")).read_text())
    assert manifest["capture_id"] == cid and sorted(a["rank"] for a in manifest["artifacts"]) == [0, 1]
    assert manifest["failures"] == []
    for art in manifest["artifacts"]:
        path = Path(art["uri"].removeprefix("file://"))
        assert path.is_file() and path.stat().st_size == art["size"], art
    assert done["analysis"]["state"] == "done" and done["analysis"].get("exit_code") == 0, json.dumps(done)[:3000]
    report = Path(done["report_uri"].removeprefix("file://"))
    assert report.is_file() and cid in report.read_text(errors="replace")
    assert report.parent.parent == Path(uri.removeprefix("file://")).parent


def test_a_deleted_capture_coordinator_comes_back_with_its_pod_and_service(trainer, api, capsys):
    from kubernetes import client
    ns, _ = trainer
    custom = client.CustomObjectsApi(api.api_client)
    (cc,) = custom.list_namespaced_custom_object("gpulens.dev", "v1alpha1", ns, "capturecoordinators")["items"]
    name, old = cc["metadata"]["name"], cc["metadata"]["uid"]
    t0 = time.monotonic()
    custom.delete_namespaced_custom_object("gpulens.dev", "v1alpha1", ns, "capturecoordinators", name)

    def new_uid():
        items = custom.list_namespaced_custom_object("gpulens.dev", "v1alpha1", ns, "capturecoordinators")["items"]
        return next((c["metadata"]["uid"] for c in items if c["metadata"]["uid"] != old), None)
    uid = wait_until("the CaptureCoordinator back", new_uid, 300, 0.2)
    t_cc = time.monotonic() - t0

    def ready_pod_of_new():
        pods, svcs = _coordinator_objects(api, ns)
        pod_ok = [p for p in pods if [r.uid for r in p.metadata.owner_references or []] == [uid]
                  and p.status.container_statuses and all(c.ready for c in p.status.container_statuses)]
        svc_ok = [s for s in svcs if [r.uid for r in s.metadata.owner_references or []] == [uid]]
        return pod_ok and svc_ok
    wait_until("its new Pod Ready and the Service owned by it", ready_pod_of_new, 300, 0.5)
    with capsys.disabled():
        print(f"\n[readiness] CaptureCoordinator deleted -> back {t_cc:.1f} s, its Pod Ready and Service handed over "
              f"{time.monotonic() - t0:.1f} s")


#: Someone else's training script, as PyTorch's DDP tutorial writes one: DistributedDataParallel, a
#: DataLoader over a DistributedSampler, AdamW, a print per epoch; no profiler.step(), no marker, no
#: gpulens. ~15 optimizer steps a second (the demo's trainer steps at another rate).
STRANGERS_SCRIPT = """\
import os, time
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = TensorDataset(torch.randn(4096, 64), torch.randint(0, 10, (4096,)))
sampler = DistributedSampler(data)
loader = DataLoader(data, batch_size=32, sampler=sampler)
print(f"rank {rank} of {world} training", flush=True)
epoch = 0
while True:
    sampler.set_epoch(epoch)
    for x, y in loader:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        time.sleep(0.05)
    if rank == 0:
        print(f"epoch {epoch} loss {loss.item():.3f}", flush=True)
    epoch += 1
"""
STRANGER = "ddp-user"
#: issue 47's sequence: a 2 s window, 5 iterations, then a 1 s window and 3 iterations, three times
SEQUENCE = [("window", 2000), ("iterations", 5)] + [("window", 1000), ("iterations", 3)] * 3


def _strangers_job(image: str) -> dict:
    site = torch_site()     # torch from this machine's venv, on the image's own PYTHONPATH (own_pythonpath_image)
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": STRANGER},
            "spec": {"backoffLimit": 0, "template": {"spec": {
                "restartPolicy": "Never", "terminationGracePeriodSeconds": 2,
                "containers": [{
                    "name": "train", "image": image, "imagePullPolicy": "Never",
                    "command": ["python3", "-m", "torch.distributed.run", "--nproc-per-node=2", "/workspace/train.py"],
                    "env": [{"name": "OMP_NUM_THREADS", "value": "1"}, {"name": "HOME", "value": "/tmp"}],
                    "securityContext": {"runAsUser": 0},      # the hook registers into a root-owned host folder
                    "resources": {"requests": {"cpu": "250m"}},
                    "volumeMounts": [{"name": "script", "mountPath": "/workspace", "readOnly": True},
                                     {"name": "site", "mountPath": site, "readOnly": True}]}],
                "volumes": [{"name": "script", "configMap": {"name": STRANGER}},
                            {"name": "site", "hostPath": {"path": site, "type": "Directory"}}]}}}}


@pytest.fixture(scope="module")
def strangers_job(trial, trainer, api, gpulens_image):
    """The stranger's Job in the README's armed namespace, training; the demo trainer's Job goes
    first (the node has two cores), as a team replacing its job would do."""
    from kubernetes import client
    ns, _ = trainer
    batch = client.BatchV1Api(api.api_client)
    batch.delete_namespaced_job(JOB, ns, propagation_policy="Background")
    api.create_namespaced_config_map(ns, client.V1ConfigMap(metadata=client.V1ObjectMeta(name=STRANGER),
                                                            data={"train.py": STRANGERS_SCRIPT}))
    batch.create_namespaced_job(ns, _strangers_job(own_pythonpath_image(gpulens_image)))

    def training():
        pods = api.list_namespaced_pod(ns, label_selector=f"job-name={STRANGER}").items
        if not pods or pods[0].status.phase != "Running":
            assert not pods or pods[0].status.phase not in ("Failed", "Succeeded"), pods[0].status
            return None
        log = api.read_namespaced_pod_log(pods[0].metadata.name, ns, container="train")
        return log.count(" of 2 training") == 2 and pods[0]
    pod = wait_until(f"both ranks of {STRANGER} training", training, 300, 1)
    yield ns, pod
    batch.delete_namespaced_job(STRANGER, ns, propagation_policy="Background")
    api.delete_namespaced_config_map(STRANGER, ns)


def test_a_strangers_ddp_job_gets_eight_captures_in_a_row_each_whole_and_aligned(trial, strangers_job, api, capsys):
    """Issue 47's sequence on a Job the tests did not write, with the README's release and values:
    every capture converges with both ranks archived; each iteration capture traces the same
    optimizer steps on both ranks, as many as asked; each window starts on both ranks within one
    Kineto poll of the instant the coordinator chose, and the two windows overlap."""
    ns, pod = strangers_job
    assert (pod.metadata.annotations or {}).get("gpulens.dev/local-world-size") == "2"    # armed, as torchrun says
    base, token = _gateway(api, trial.helm.args["namespace"])
    seen, cids = [], []
    for kind, amount in SEQUENCE:
        body = {"job_id": STRANGER, "duration_ms": amount} if kind == "window" else \
            {"job_id": STRANGER, "iterations": amount, "duration_ms": 30000}
        started = wait_until(f"{kind} capture accepted", lambda: (lambda r: r[0] in (200, 201, 202) and r[1])(
            call(f"{base}/v1/captures?namespace={ns}", token, body)), 300, 2)
        cid = started["capture_id"]
        cids.append(cid)
        done = wait_until(f"capture {cid} converged", lambda: (lambda st: st.get("phase") in ("converged", "failed") and st)(
            call(f"{base}/v1/captures/{cid}", token)[1]), 300, 1)
        targets = [(t["rank"], t["state"], t.get("reason"), (t.get("detail") or "")[:400]) for t in done.get("targets") or []]
        seen.append((kind, amount, done.get("phase"), done.get("counts")))
        assert done["phase"] == "converged" and done["fully_succeeded"] and done["counts"] == {"archived": 2}, (seen, targets)
        manifest = json.loads(Path(done["manifest_uri"].removeprefix("file://")).read_text())
        arts = sorted(manifest["artifacts"], key=lambda a: a["rank"])
        assert [a["rank"] for a in arts] == [0, 1] and manifest["failures"] == [], (seen, manifest["failures"])
        if kind == "iterations":
            spans = {(a["iterations"]["first"], a["iterations"]["last"]) for a in arts}
            assert len(spans) == 1 and None not in next(iter(spans)), (seen, [a["iterations"] for a in arts])
            assert {a["iterations"]["optimizer_steps"] for a in arts} == {amount}, (seen, [a["iterations"] for a in arts])
            said = f"steps {next(iter(spans))} on both ranks"
        else:
            windows = [a["window"] for a in arts]
            assert all(0 <= w["start_skew_s"] <= 5.0 for w in windows), (seen, windows)
            assert max(w["start"] for w in windows) < min(w["end"] for w in windows), (seen, windows)
            said = f"start skew {[w['start_skew_s'] for w in windows]} s"
        with capsys.disabled():
            print(f"\n[stranger] {kind} {amount}: {cid} archived on both ranks, {said}")
    # each capture's analysis Job (the release's `analysis: job`, 500m CPU requested each) ran to its
    # report: and none is left running or pending on the two-core node for the modules after this one
    for cid in cids:
        st = wait_until(f"capture {cid}'s analysis over", lambda: (lambda s: s.get("analysis", {}).get("state") in (
            "done", "failed", "skipped", "disabled") and s)(call(f"{base}/v1/captures/{cid}", token)[1]), 900, 2)
        assert st["analysis"]["state"] == "done" and st["analysis"].get("exit_code") == 0, (cid, st["analysis"])
