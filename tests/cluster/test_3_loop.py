"""The loop in pods: a two-worker torchrun training Job in a namespace opted in to arming is armed
by the webhook at creation, the operator makes its coordinator, the exporter's series for it carry
the real namespace, pod, container and job (from the kubelet's cgroups and the API), and a capture
asked of the gateway Service reaches both ranks through the agent pod and lands in S3 with a
manifest naming both.

The trainer and the gateway calls are tests/cluster/workload.py's."""

from __future__ import annotations

import json
import urllib.request

import pytest

from .harness import NS, REPO, forbidden_in_logs, wait_until
from .workload import JOB, armed_namespace, call, gateway, start_trainer

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(3600)]

NODE_IP = "10.244.0.1"
EXPORTER = f"http://{NODE_IP}:9450/metrics"


@pytest.fixture(scope="module")
def trainer(release, api, gpulens_image):
    """The training Job, running in its own armed namespace; yields (namespace, pod)."""
    ns = armed_namespace(api)
    yield ns, start_trainer(api, ns, gpulens_image)
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


def test_a_capture_through_the_gateway_service_archives_both_ranks(trainer, api, s3):
    ns, pod = trainer
    base, token = gateway(api)
    # The coordinator learns the workers from the API and the agent; retry until it is ready.
    started = wait_until("capture accepted by the gateway", lambda: (lambda r: r[0] in (200, 201, 202) and r[1])(
        call(f"{base}/v1/captures?namespace={ns}", token, {"job_id": JOB, "duration_ms": 1500})), 240, 2)
    cid = started["capture_id"]
    done = wait_until("capture converged", lambda: (lambda r: r[1].get("phase") in ("converged", "failed") and r[1])(
        call(f"{base}/v1/captures/{cid}", token)), 300, 1)
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
    base, token = gateway(api)
    sel = "app.kubernetes.io/component=coordinator"
    (old,) = api.list_namespaced_pod(ns, label_selector=sel).items
    status, started = call(f"{base}/v1/captures?namespace={ns}", token, {"job_id": JOB, "duration_ms": 8000})
    assert status in (200, 201, 202), started
    cid = started["capture_id"]
    # Delete it once both ranks are dispatched to the agent (the capture is then the agent's too).
    def dispatched():
        targets = call(f"{base}/v1/captures/{cid}", token)[1].get("targets") or []
        return len(targets) == 2 and all(t["state"] != "pending" for t in targets)
    wait_until("both ranks dispatched", dispatched, 120, 0.5)
    api.delete_namespaced_pod(old.metadata.name, ns, grace_period_seconds=0)
    new = wait_until("a new coordinator pod Ready", lambda: [
        p for p in api.list_namespaced_pod(ns, label_selector=sel).items
        if p.metadata.uid != old.metadata.uid and p.status.container_statuses
        and all(c.ready for c in p.status.container_statuses)], 300)
    assert len(new) == 1
    status, answer = wait_until("the gateway answers for the old capture", lambda: (
        lambda r: r[0] != 502 and r)(call(f"{base}/v1/captures/{cid}", token)), 120, 1)
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
