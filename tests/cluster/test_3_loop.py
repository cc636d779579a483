"""The loop in pods: a two-worker torchrun training Job in a namespace opted in to arming is armed
by the webhook at creation, the operator makes its coordinator, the exporter's series for it carry
the real namespace, pod, container and job (from the kubelet's cgroups and the API), and a capture
asked of the gateway Service reaches both ranks through the agent pod and lands in S3 with a
manifest naming both.

The trainer runs Debian's python3 from the gpulens image (bookworm + python3 + bcc, no torch):
torch comes from this machine's venv and the demo trainer from the repository, both hostPath
read-only (no registry here to pull a torch image from); it drives the CUDA driver stand-in
(exporter/stub, also by hostPath), so the exporter's uprobes count its launches."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from exporter.stub import build_stub

from .harness import NS, REPO, STATE, forbidden_in_logs, wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(3600)]

NODE_IP = "10.244.0.1"
EXPORTER, JOB = f"http://{NODE_IP}:9450/metrics", "trainer"


def _job(image: str, libcuda: Path, site: str) -> dict:
    stub_root = str(libcuda.parents[1])
    mounts = [("repo", str(REPO)), ("site", site), ("stub", stub_root)]
    return {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": JOB},
        "spec": {"backoffLimit": 0, "template": {"spec": {
            "restartPolicy": "Never", "terminationGracePeriodSeconds": 2,
            "containers": [{
                "name": "trainer", "image": image, "imagePullPolicy": "Never",
                "command": ["python3", "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-port=29500",
                            "-m", "gpulens.up.demo_trainer", "--libcuda", str(libcuda), "--control", "/tmp/incident",
                            "--kernels", "10", "--h2d-bytes", "65536", "--copy-floats", "1024"],
                "env": [{"name": "PYTHONPATH", "value": f"{REPO}:{site}"},
                        {"name": "LD_LIBRARY_PATH", "value": str(libcuda.parent)},
                        {"name": "OMP_NUM_THREADS", "value": "1"}, {"name": "HOME", "value": "/tmp"}],
                "securityContext": {"runAsUser": 0},
                "volumeMounts": [{"name": n, "mountPath": p, "readOnly": True} for n, p in mounts]}],
            "volumes": [{"name": n, "hostPath": {"path": p, "type": "Directory"}} for n, p in mounts]}}}}


@pytest.fixture(scope="module")
def trainer(release, api, gpulens_image):
    """The training Job, running in its own armed namespace; yields (namespace, pod)."""
    import torch
    from kubernetes import client
    stub = build_stub(STATE / "stub")
    site = str(Path(torch.__file__).parents[1])
    ns = f"ml-{uuid.uuid4().hex[:6]}"
    api.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(
        name=ns, labels={"gpulens.dev/arming": "enabled"})))
    client.BatchV1Api(api.api_client).create_namespaced_job(ns, _job(gpulens_image, stub.libcuda, site))
    pod = wait_until("trainer pod", lambda: api.list_namespaced_pod(ns, label_selector=f"job-name={JOB}").items, 60)[0]
    name = pod.metadata.name

    def running():
        p = api.read_namespaced_pod(name, ns)
        assert p.status.phase not in ("Failed", "Succeeded"), api.read_namespaced_pod_log(name, ns)[-4000:]
        return p.status.phase == "Running" and p
    wait_until("trainer pod Running", running, 300)
    # Both workers have imported torch and stepped: each prints one "started" line.
    wait_until("both workers started", lambda: running() and api.read_namespaced_pod_log(
        name, ns, container="trainer").count("demo-trainer rank=") >= 2, 300, 1)
    yield ns, api.read_namespaced_pod(name, ns)
    api.delete_namespace(ns)


def test_the_trainer_pod_is_armed_at_creation(trainer):
    ns, pod = trainer
    assert (pod.metadata.labels or {}).get("gpulens.dev/armed") == "true", pod.metadata.labels
    assert [c.name for c in pod.spec.init_containers or []] == ["gpulens-hook"]
    (main,) = pod.spec.containers
    env = {e.name: e.value for e in main.env}
    assert env["PYTHONPATH"].split(":")[0] != str(REPO)        # the hook folder was put first
    assert "GPULENS_REGISTRY_DIR" in env and "GPULENS_SOCKET_DIR" in env


def test_the_operator_makes_the_jobs_coordinator(trainer, api):
    from kubernetes import client
    ns, _ = trainer
    custom = client.CustomObjectsApi(api.api_client)
    ccs = wait_until("CaptureCoordinator", lambda: custom.list_namespaced_custom_object(
        "gpulens.dev", "v1alpha1", ns, "capturecoordinators")["items"], 120)
    assert [c["spec"].get("jobId", c["spec"].get("job_id")) for c in ccs] == [JOB], [c["spec"] for c in ccs]
    (coord,) = wait_until("coordinator pod Ready", lambda: [
        p for p in api.list_namespaced_pod(ns, label_selector="app.kubernetes.io/component=coordinator").items
        if p.status.container_statuses and all(c.ready for c in p.status.container_statuses)], 300)
    # The webhook left the operator's own pod alone (armed, it counted as one more rank).
    assert not coord.spec.init_containers and coord.metadata.labels.get("gpulens.dev/armed") == "false"


def _series(name: str) -> list[tuple[dict, float]]:
    from prometheus_client.parser import text_string_to_metric_families
    text = urllib.request.urlopen(EXPORTER, timeout=10).read().decode()
    return [(s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == name]


def test_exporter_series_carry_the_trainers_pod_container_and_job(trainer):
    ns, pod = trainer
    mine = wait_until("launch series for the trainer", lambda: [
        (lbl, v) for lbl, v in _series("gpulens_kernel_launches_total") if lbl.get("namespace") == ns and v > 0], 180, 1)
    assert len(mine) == 1, mine                                 # two workers, one container: one series
    labels, _ = mine[0]
    assert labels["pod"] == pod.metadata.name
    assert labels["container"] == "trainer"
    assert labels["gpulens_job"] == JOB
    assert labels["node"] == "gpulens-node"
    assert labels["gpulens_workload"] == f"job/{JOB}"


def _gateway(api) -> tuple[str, str]:
    (svc,) = [s for s in api.list_namespaced_service(NS).items
              if (s.metadata.labels or {}).get("app.kubernetes.io/component") == "gateway"]
    secret = next(s for s in api.list_namespaced_secret(NS).items if s.data and "gateway" in s.data)
    return f"http://{svc.spec.cluster_ip}:{svc.spec.ports[0].port}", base64.b64decode(secret.data["gateway"]).decode()


def _call(url: str, token: str, body: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, method="POST" if body is not None else "GET",
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def test_a_capture_through_the_gateway_service_archives_both_ranks(trainer, api, s3):
    ns, pod = trainer
    base, token = _gateway(api)
    # The coordinator learns the workers from the API and the agent; retry until it is ready.
    started = wait_until("capture accepted by the gateway", lambda: (lambda r: r[0] in (200, 201, 202) and r[1])(
        _call(f"{base}/v1/captures?namespace={ns}", token, {"job_id": JOB, "duration_ms": 1500})), 240, 2)
    cid = started["capture_id"]
    done = wait_until("capture converged", lambda: (lambda r: r[1].get("phase") in ("converged", "failed") and r[1])(
        _call(f"{base}/v1/captures/{cid}", token)), 300, 1)
    assert done["phase"] == "converged" and done["fully_succeeded"], json.dumps(done)[:3000]
    assert done["counts"] == {"archived": 2}, done["counts"]
    uri = done["manifest_uri"]
    assert uri.startswith(f"s3://{s3.bucket}/"), uri
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    cli = s3.client()
    manifest = json.loads(cli.get_object(Bucket=bucket, Key=key)["Body"].read())
    assert manifest["capture_id"] == cid and manifest["job_id"] == JOB
    assert sorted(a["rank"] for a in manifest["artifacts"]) == [0, 1]
    assert manifest["failures"] == []
    for art in manifest["artifacts"]:
        assert art["pod"] == pod.metadata.name
        b, _, k = art["uri"].removeprefix("s3://").partition("/")
        assert cli.head_object(Bucket=b, Key=k)["ContentLength"] == art["size"]


def test_a_coordinator_pod_deleted_mid_capture_is_recreated_and_nothing_is_lost(trainer, api, s3):
    """The operator brings the coordinator Pod back; the new one does not know the old capture
    (`unknown`), the agent still archives both ranks' traces, and the trainer never notices."""
    ns, pod = trainer
    base, token = _gateway(api)
    sel = "app.kubernetes.io/component=coordinator"
    (old,) = api.list_namespaced_pod(ns, label_selector=sel).items
    status, started = _call(f"{base}/v1/captures?namespace={ns}", token, {"job_id": JOB, "duration_ms": 8000})
    assert status in (200, 201, 202), started
    cid = started["capture_id"]
    # Delete it once both ranks are dispatched to the agent (the capture is then the agent's too).
    def dispatched():
        targets = _call(f"{base}/v1/captures/{cid}", token)[1].get("targets") or []
        return len(targets) == 2 and all(t["state"] != "pending" for t in targets)
    wait_until("both ranks dispatched", dispatched, 120, 0.5)
    api.delete_namespaced_pod(old.metadata.name, ns, grace_period_seconds=0)
    new = wait_until("a new coordinator pod Ready", lambda: [
        p for p in api.list_namespaced_pod(ns, label_selector=sel).items
        if p.metadata.uid != old.metadata.uid and p.status.container_statuses
        and all(c.ready for c in p.status.container_statuses)], 300)
    assert len(new) == 1
    status, answer = wait_until("the gateway answers for the old capture", lambda: (
        lambda r: r[0] != 502 and r)(_call(f"{base}/v1/captures/{cid}", token)), 120, 1)
    assert (status, answer.get("phase")) == (404, "unknown"), (status, answer)
    # Nothing lost: the agent archived both ranks' traces under the capture's prefix.
    cli = s3.client()
    keys = wait_until("both ranks' traces in S3", lambda: (lambda ks: len(ks) >= 2 and ks)([
        o["Key"] for o in cli.list_objects_v2(Bucket=s3.bucket, Prefix="captures/").get("Contents", [])
        if cid in o["Key"] and not o["Key"].endswith("manifest.json")]), 120, 1)
    assert len(keys) == 2, keys
    p = api.read_namespaced_pod(pod.metadata.name, ns)
    assert p.status.phase == "Running" and p.status.container_statuses[0].restart_count == 0


def test_the_whole_loop_ran_without_a_403(trainer, api):
    """With the chart's ServiceAccounts: the release's pods and the job's coordinator Pods."""
    ns, _ = trainer
    assert {**forbidden_in_logs(api, NS), **forbidden_in_logs(api, ns)} == {}
