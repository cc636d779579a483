"""The loop in pods: a two-worker torchrun training Job in a namespace opted in to arming is armed
by the webhook at creation, the operator makes its coordinator, the exporter's series for it carry
the real namespace, pod, container and job (from the kubelet's cgroups and the API), and a capture
asked of the gateway Service reaches both ranks through the agent pod and lands in S3 with a
manifest naming both; the coordinator's analysis Job writes the report beside it and the Grafana
annotation links that report.

The trainer and the gateway calls are tests/cluster/workload.py's."""

from __future__ import annotations

import html
import json
import urllib.request

import pytest

from .harness import NS, forbidden_in_logs, pod_log, wait_until
from .workload import JOB, armed_namespace, call, capture_status, gateway, start_capture, start_trainer, torch_site, wait_converged

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
    assert env["PYTHONPATH"].split(":")[0] != torch_site()     # the hook folder was put first
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
    # two workers in one container: one series per worker (issue 29), told apart by `rank`
    mine = wait_until("a launch series for each of the trainer's two workers", lambda: (lambda m: m if len(m) >= 2 else None)(
        [(lbl, v) for lbl, v in _series("gpulens_kernel_launches_total") if lbl.get("namespace") == ns and v > 0]), 180, 1)
    assert sorted(lbl.get("rank") for lbl, _ in mine) == ["0", "1"], mine
    assert len({tuple(sorted((k, v) for k, v in lbl.items() if k != "rank")) for lbl, _ in mine}) == 1, mine
    labels, _ = mine[0]
    assert labels["pod"] == pod.metadata.name
    assert labels["container"] == "trainer"
    assert labels["gpulens_job"] == JOB
    assert labels["node"] == "gpulens-node"
    assert labels["gpulens_workload"] == f"job/{JOB}"


@pytest.fixture(scope="module")
def gateway_capture(trainer, api) -> dict:
    """One capture asked of the gateway Service, waited on until it converged (or failed): its status."""
    ns, _ = trainer
    return wait_converged(api, start_capture(api, ns, 1500))


def test_a_capture_through_the_gateway_service_archives_both_ranks(trainer, s3, gateway_capture):
    ns, pod = trainer
    done = gateway_capture
    cid = done["capture_id"]
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


ANALYSIS = "app.kubernetes.io/component=analysis"


def _analysis_pods(api, ns: str) -> list:
    return api.list_namespaced_pod(ns, label_selector=ANALYSIS).items


def test_the_capture_is_analysed_by_a_job_and_its_grafana_annotation_links_the_report(
        trainer, api, s3, grafana, gateway_capture):
    """`--analysis job` (the chart's default): the converged capture's `gpulens analyze` runs as a
    Job in the trainer's namespace (unarmed, the coordinator's ServiceAccount, the archive Secret),
    writes its report beside the manifest, and the coordinator's Grafana annotation links it."""
    from kubernetes import client
    from gpulens.capture.annotations.render import capture_tags
    from gpulens.capture.coordinator.analysis_job import analysis_job_name, label_value, report_uri_of
    ns, _ = trainer
    cid, manifest_uri = gateway_capture["capture_id"], gateway_capture["manifest_uri"]
    status = wait_until("the capture's analysis finished", lambda: (
        lambda st: st.get("analysis", {}).get("state") in ("done", "failed", "skipped", "disabled") and st)(
        capture_status(api, cid)), 900, 2)
    analysis = status["analysis"]
    assert analysis["state"] == "done" and analysis.get("exit_code") == 0, json.dumps(status)[:3000]
    # The report sits under the capture's own prefix (beside its manifest), and both files are in S3.
    report = status["report_uri"]
    assert report == analysis["report_uri"] == report_uri_of(manifest_uri), (report, manifest_uri)
    prefix = manifest_uri.rsplit("/", 1)[0] + "/"
    assert report.startswith(prefix) and cid in prefix, (report, prefix)
    bucket, _, key = report.removeprefix("s3://").partition("/")
    cli = s3.client()
    html_body = cli.get_object(Bucket=bucket, Key=key)["Body"].read().decode()
    assert "<html" in html_body.lower() and cid in html_body
    summary = json.loads(cli.get_object(Bucket=bucket, Key=key.replace("report.html", "summary.json"))["Body"].read())
    assert summary["capture"]["capture_id"] == cid, list(summary)[:20]

    # The Job: named for (job, attempt, capture), labelled for this capture, in the trainer's namespace.
    name = analysis_job_name(JOB, int(status["attempt"]), cid)
    assert analysis["job"] == name
    jobs = client.BatchV1Api(api.api_client).list_namespaced_job(
        ns, label_selector=f"{ANALYSIS},gpulens.dev/capture-id={label_value(cid)}").items
    assert [j.metadata.name for j in jobs] == [name]
    (job,) = jobs
    assert job.status.succeeded == 1 and not job.status.failed, job.status
    assert any(c.type == "Complete" and c.status == "True" for c in job.status.conditions or []), job.status
    assert job.metadata.owner_references and job.metadata.owner_references[0].kind == "CaptureCoordinator"
    # Its pod: not armed (no hook, the webhook's selector skipped it), the coordinator's ServiceAccount.
    pods = [p for p in _analysis_pods(api, ns) if (p.metadata.labels or {}).get("job-name") == name]
    assert len(pods) == 1, [p.metadata.name for p in _analysis_pods(api, ns)]
    (pod,) = pods
    assert pod.status.phase == "Succeeded", pod.status
    assert pod.metadata.labels.get("gpulens.dev/armed") == "false", pod.metadata.labels
    assert not pod.spec.init_containers, [c.name for c in pod.spec.init_containers]
    assert all("GPULENS_REGISTRY_DIR" not in {e.name for e in c.env or []} for c in pod.spec.containers)
    (coord,) = api.list_namespaced_pod(ns, label_selector="app.kubernetes.io/component=coordinator").items
    assert pod.spec.service_account_name == coord.spec.service_account_name
    job_log = pod_log(api, ns, pod.metadata.name, "analyze")
    assert report in job_log.splitlines(), job_log[-3000:]        # `gpulens analyze` printed the report URI

    # The coordinator only made the Job: its log has the Job's events, never an analysis child process.
    coord_log = pod_log(api, ns, coord.metadata.name, "coordinator")
    mine = [line for line in coord_log.splitlines() if f"capture_id={cid}" in line and "event=analysis." in line]
    assert any("event=analysis.job_created" in line for line in mine), mine
    assert any("event=analysis.finished" in line and "state=done" in line for line in mine), mine
    assert all(f"job={name}" in line for line in mine), mine      # the child-process runner names no Job

    # Grafana (the double, which checked the README's token on every call): one annotation for the
    # capture, with the coordinator's tags, its text naming and linking the report.
    tags = capture_tags(status)
    assert f"capture:{cid}" in tags and f"namespace:{ns}" in tags
    href = f'href="{html.escape(report, quote=True)}"'
    found = wait_until("the annotation links the report", lambda: (
        lambda anns: anns and any(href in a["text"] for a in anns) and anns)(grafana.search(f"capture:{cid}")), 120, 1)
    assert len(found) == 1, found
    (ann,) = found
    assert set(tags) <= set(ann["tags"]), (tags, ann["tags"])
    assert cid in ann["text"] and ann["timeEnd"] >= ann["time"] > 0, ann


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
    """With the chart's ServiceAccounts: the release's pods and the job's coordinator and analysis Pods."""
    ns, _ = trainer
    assert _analysis_pods(api, ns), "no analysis Job pod in the namespace: its log would go unchecked"
    assert {**forbidden_in_logs(api, NS), **forbidden_in_logs(api, ns)} == {}
