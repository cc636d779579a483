"""`--analysis job`: the analysis as a batch/v1 Job, through the real `kubernetes` client against
the API server double (tests/operator/apiserver.py) and a Job controller + kubelet double that
runs the Job's container command for real (job_controller.py).

The manifest builder is checked as a Kubernetes object (kubernetes-validate) and for what keeps
it safe (not armed, restricted, owned, deterministic); the runner for the outcomes a cluster
produces: done, refused, nothing analysed, never scheduled (timeout, Job deleted), API refusals."""

from __future__ import annotations

import asyncio
import json
import os
import re

import kmock
import kubernetes_validate
import pytest
from kubernetes import client

from gpulens.capture.annotations import FileSink
from gpulens.capture.coordinator import Phase
from gpulens.capture.coordinator.analysis_job import (AnalysisJobRunner, AnalysisJobSpec, OwnerRef, analysis_job,
                                              analysis_job_name, report_uri_of)
from gpulens.capture.coordinator.command import analysis_for
from gpulens.capture.models import CaptureRequest
from gpulens.cli import build_subparser
from tests.operator.apiserver import running_apiserver
from tests.operator.rbac import allowed, attributes

from ..helm.chart import one, render
from .agent_double import AgentDouble, RunningAgent
from .conftest import AGENT_TOKEN, make_coordinator, write_job
from .job_controller import JobControllerDouble

NS = "ml"
DNS_1123_LABEL = re.compile(r"\A[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?\Z")
UA = "gpulens-coordinator-under-test"


def spec(**over) -> AnalysisJobSpec:
    base = dict(namespace=NS, image="ghcr.io/gpulens/gpulens:1.2.3", job_id="train", attempt=0,
                labels={"gpulens.dev/job": "train", "gpulens.dev/attempt": "0",
                        "app.kubernetes.io/managed-by": "gpulens-operator"},
                owner=OwnerRef("gpulens-train-a0", "cc-uid-1"), timeout_s=20.0)
    base.update(over)
    return AnalysisJobSpec(**base)


def status(code: int, reason: str, message: str) -> dict:
    """The body the API server sends with an error (a metav1.Status)."""
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


@pytest.fixture
def apiserver():
    """The API server with this coordinator's CaptureCoordinator in it (`.owner`): a Job owned by an
    object that does not exist is garbage-collected, in the double as in a cluster."""
    with running_apiserver() as api:
        cc = json.loads(client.CustomObjectsApi(api.api_client()).create_namespaced_custom_object(
            "gpulens.dev", "v1alpha1", NS, "capturecoordinators",
            {"apiVersion": "gpulens.dev/v1alpha1", "kind": "CaptureCoordinator",
             "metadata": {"name": "gpulens-train-a0"}, "spec": {"jobId": "train", "attempt": 0}},
            _preload_content=False).data)
        api.owner = OwnerRef(cc["metadata"]["name"], cc["metadata"]["uid"])
        yield api


def runner(api, **over) -> AnalysisJobRunner:
    c = api.api_client()
    c.user_agent = UA
    return AnalysisJobRunner(c, spec(owner=api.owner, **over), poll_interval_s=0.05)


def jobs(api) -> list[dict]:
    return json.loads(client.BatchV1Api(api.api_client()).list_namespaced_job(NS, _preload_content=False).data)["items"]


def pods(api) -> list[dict]:
    return json.loads(client.CoreV1Api(api.api_client()).list_namespaced_pod(NS, _preload_content=False).data)["items"]


# --- the Job manifest ----------------------------------------------------------------------------

def test_the_job_is_a_valid_restricted_unarmed_job_owned_by_the_capture_coordinator():
    s = spec(s3_endpoint="http://minio:9000", env_from_secret="gpulens-train-a0-archive",
             service_account="gpulens-train-a0", image_pull_secrets=("regcred",),
             resources={"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "8Gi"}})
    job = analysis_job(s, "s3://b/p/ml/train/0/c-1/manifest.json", "c-1")
    for version in ("1.27", "1.36"):
        kubernetes_validate.validate(job, version, strict=True)
    meta, jspec = job["metadata"], job["spec"]
    tmpl = jspec["template"]
    pod, (c,) = tmpl["spec"], tmpl["spec"]["containers"]
    # left alone by the arming webhook and never taken for a rank of the job it analyses
    assert tmpl["metadata"]["labels"]["gpulens.dev/armed"] == "false"
    assert tmpl["metadata"]["labels"]["gpulens.dev/arm"] == "false"
    assert "gpulens.dev/coordinator" not in tmpl["metadata"]["labels"]      # the job Service selects on it
    for labels in (meta["labels"], tmpl["metadata"]["labels"]):
        assert labels["app.kubernetes.io/component"] == "analysis" and labels["gpulens.dev/capture-id"] == "c-1"
        assert labels["gpulens.dev/job"] == "train" and labels["app.kubernetes.io/managed-by"] == "gpulens-operator"
    assert meta["ownerReferences"] == [{"apiVersion": "gpulens.dev/v1alpha1", "kind": "CaptureCoordinator",
                                        "name": "gpulens-train-a0", "uid": "cc-uid-1", "controller": False,
                                        "blockOwnerDeletion": False}]
    assert meta["namespace"] == NS
    assert jspec["backoffLimit"] == 0 and jspec["ttlSecondsAfterFinished"] == 3600
    assert jspec["activeDeadlineSeconds"] == 20 + 60        # after the coordinator's own deadline (backstop)
    assert c["command"] == ["gpulens"]
    assert c["args"] == ["analyze", "s3://b/p/ml/train/0/c-1/manifest.json", "--s3-endpoint", "http://minio:9000"]
    assert c["image"] == "ghcr.io/gpulens/gpulens:1.2.3"
    assert c["envFrom"] == [{"secretRef": {"name": "gpulens-train-a0-archive"}}]
    assert c["resources"] == {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "8Gi"}}
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}}
    assert {"name": "HOME", "value": "/tmp"} in c["env"]
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"] and {"name": "tmp", "emptyDir": {}} in pod["volumes"]
    assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532,
                                      "fsGroup": 65532, "seccompProfile": {"type": "RuntimeDefault"}}
    assert pod["restartPolicy"] == "Never" and pod["automountServiceAccountToken"] is False
    assert pod["serviceAccountName"] == "gpulens-train-a0"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]


def test_without_options_the_job_has_no_secret_no_endpoint_and_no_owner():
    job = analysis_job(spec(owner=None), "file:///a/manifest.json", "c-1")
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert c["args"] == ["analyze", "file:///a/manifest.json"]
    assert "envFrom" not in c and "resources" not in c and "ownerReferences" not in job["metadata"]
    assert "serviceAccountName" not in job["spec"]["template"]["spec"]


@pytest.mark.parametrize("capture_id", ["c-20261202t004500-0a1b2c3d", "Incident_42/ÄÖ..", "x" * 200, "-"])
def test_the_job_name_is_a_deterministic_dns_label_distinct_per_job_and_attempt(capture_id):
    name = analysis_job_name("train", 0, capture_id)
    assert DNS_1123_LABEL.fullmatch(name) and len(name) <= 63, name
    assert name == analysis_job_name("train", 0, capture_id)               # a restarted coordinator finds it
    assert name != analysis_job_name("train", 1, capture_id)
    assert name != analysis_job_name("eval", 0, capture_id)
    kubernetes_validate.validate(analysis_job(spec(), "file:///a/manifest.json", capture_id), "1.36", strict=True)


def test_the_report_uri_is_where_gpulens_analyze_writes_it():
    from gpulens.capture.analysis import REPORT_KEY
    from gpulens.capture.analysis.manifest_reading import capture_prefix_of
    for uri in ("s3://b/p/ml/train/0/c-1/manifest.json", "file:///var/archive/ml/train/0/c-1/manifest.json"):
        assert report_uri_of(uri) == f"{capture_prefix_of(uri)}/{REPORT_KEY}"


# --- the runner against the API ------------------------------------------------------------------

async def test_a_converged_capture_is_analysed_by_a_job_and_its_report_is_linked(tmp_path, http, apiserver):
    """The coordinator service records the Job's outcome as it did the child process's; the Job's
    own command line (run for real by the kubelet double) wrote the report it links."""
    write_job(tmp_path / "registry", pods={"train-0": ("node-a", 0)}, local_world_size=2)
    annotations = tmp_path / "state" / "annotations.json"
    with JobControllerDouble(apiserver, NS) as controller:
        async with RunningAgent(AgentDouble("node-a", AGENT_TOKEN)) as a:
            c = make_coordinator(tmp_path, http, {"node-a": a.url}, analysis=runner(apiserver, timeout_s=300),
                                 annotations=FileSink(annotations))
            rec, _ = c.start(CaptureRequest(job_id="train", duration_ms=200))
            await c.wait(rec.capture_id)
            assert await c._syncs[rec.capture_id].wait_synced(5)
            await c.close()
    assert rec.phase == Phase.CONVERGED
    assert rec.analysis["state"] == "done", rec.analysis["reason"]
    assert rec.report_uri == rec.manifest_uri.replace("manifest.json", "analysis/report.html")
    assert os.path.exists(rec.report_uri.removeprefix("file://"))
    (job,) = jobs(apiserver)
    assert job["metadata"]["name"] == rec.analysis["job"] == analysis_job_name("train", 0, rec.capture_id)
    assert [argv[3:] for argv in controller.ran] == [["analyze", rec.manifest_uri]]
    (ann,) = json.loads(annotations.read_text())["annotations"]
    assert rec.report_uri in ann["text"]                      # the annotation links to the Job's report


async def test_a_restarted_coordinator_reuses_the_running_job_instead_of_starting_a_second(apiserver):
    first = asyncio.create_task(runner(apiserver).run("file:///a/ml/train/0/c-1/manifest.json", "c-1"))
    await _until(lambda: len(jobs(apiserver)) == 1)
    first.cancel()                                  # the coordinator stops mid-wait (restart, eviction)
    with pytest.raises(asyncio.CancelledError):
        await first
    assert len(jobs(apiserver)) == 1                # ... and the Job (the analysis) lives on
    with JobControllerDouble(apiserver, NS, behaviour=("exit", 0, "file:///a/ml/train/0/c-1/analysis/report.html")):
        result = await runner(apiserver).run("file:///a/ml/train/0/c-1/manifest.json", "c-1")
    assert result == {"state": "done", "report_uri": "file:///a/ml/train/0/c-1/analysis/report.html", "exit_code": 0,
                      "job": analysis_job_name("train", 0, "c-1")}
    creates = [r for r in apiserver.requests() if r[0] == "POST" and r[1].endswith("/jobs")]
    assert len(creates) == 2 and len(jobs(apiserver)) == 1        # the second create met 409, no second Job


async def test_a_finished_job_found_after_a_restart_gives_its_outcome_without_running_again(apiserver):
    with JobControllerDouble(apiserver, NS, behaviour=("exit", 0, "")) as controller:
        one_ = await runner(apiserver).run("file:///a/c-1/manifest.json", "c-1")
        two = await runner(apiserver).run("file:///a/c-1/manifest.json", "c-1")
    assert one_ == two and one_["state"] == "done"
    assert len(controller.seen) == 1


async def test_deleting_the_capture_coordinator_deletes_its_analysis_job_and_pod(apiserver):
    with JobControllerDouble(apiserver, NS, behaviour=("exit", 0, "")):
        await runner(apiserver).run("file:///a/c-1/manifest.json", "c-1")
    assert len(jobs(apiserver)) == 1 and len(pods(apiserver)) == 1
    client.CustomObjectsApi(apiserver.api_client()).delete_namespaced_custom_object(
        "gpulens.dev", "v1alpha1", NS, "capturecoordinators", apiserver.owner.name)
    await _until(lambda: jobs(apiserver) == [] and pods(apiserver) == [])


async def test_a_refused_manifest_is_a_failed_analysis_with_the_reason(apiserver, tmp_path):
    missing = (tmp_path / "nowhere" / "manifest.json").as_uri()
    with JobControllerDouble(apiserver, NS):                     # runs the real `gpulens analyze`
        result = await runner(apiserver).run(missing, "c-2")
    assert result["state"] == "failed" and result["exit_code"] == 2, result
    assert result["reason"].startswith("gpulens analyze refused the manifest: "), result
    assert "nowhere/manifest.json" in result["reason"] and "No such file" in result["reason"]
    assert "report_uri" not in result


async def test_nothing_analysed_is_done_with_the_reason_and_a_crash_is_failed(apiserver):
    with JobControllerDouble(apiserver, NS, behaviour=("exit", 3, "file:///a/c-3/analysis/report.html\nnothing")):
        result = await runner(apiserver).run("file:///a/c-3/manifest.json", "c-3")
    assert result == {"state": "done", "report_uri": "file:///a/c-3/analysis/report.html", "exit_code": 3,
                      "reason": "nothing could be analysed", "job": analysis_job_name("train", 0, "c-3")}
    with JobControllerDouble(apiserver, NS, behaviour=("exit", 137, "level=info msg=x\nKilled: out of memory")):
        result = await runner(apiserver).run("file:///a/c-4/manifest.json", "c-4")
    assert result["state"] == "failed" and result["exit_code"] == 137
    assert result["reason"] == "gpulens analyze exit code 137: Killed: out of memory"


async def test_a_job_stopped_at_its_deadline_says_so_rather_than_exit_137(apiserver):
    with JobControllerDouble(apiserver, NS, behaviour=("exit", 137, "", "DeadlineExceeded")):
        result = await runner(apiserver).run("file:///a/c-14/manifest.json", "c-14")
    name = analysis_job_name("train", 0, "c-14")
    assert result == {"state": "failed", "job": name,
                      "reason": f"analysis Job {name} ran longer than its deadline (80 s): DeadlineExceeded"}


async def test_a_pod_never_scheduled_times_out_and_the_job_is_deleted(apiserver):
    with JobControllerDouble(apiserver, NS, behaviour="unschedulable"):
        result = await runner(apiserver, timeout_s=3.0).run("file:///a/c-5/manifest.json", "c-5")
    name = analysis_job_name("train", 0, "c-5")
    assert result["state"] == "failed", result
    assert f"analysis Job {name} did not finish within 3 s" in result["reason"]
    assert "not scheduled: Unschedulable 0/3 nodes are available: 3 Insufficient memory." in result["reason"]
    assert ("DELETE", f"/apis/batch/v1/namespaces/{NS}/jobs/{name}", "propagationPolicy=Background") in \
        apiserver.requests()
    assert jobs(apiserver) == [] and pods(apiserver) == []          # background propagation took the pod too


async def test_a_job_that_never_gets_a_pod_says_so(apiserver):
    with JobControllerDouble(apiserver, NS, behaviour="no-pod"):
        result = await runner(apiserver, timeout_s=0.5).run("file:///a/c-6/manifest.json", "c-6")
    assert result["state"] == "failed" and "no pod was created" in result["reason"], result
    assert jobs(apiserver) == []


async def test_a_job_failed_before_its_container_exited_names_the_job_condition(apiserver):
    name = analysis_job_name("train", 0, "c-7")
    task = asyncio.create_task(runner(apiserver).run("file:///a/c-7/manifest.json", "c-7"))
    await _until(lambda: len(jobs(apiserver)) == 1)
    client.BatchV1Api(apiserver.api_client()).patch_namespaced_job_status(
        name, NS, {"status": {"conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
                                              "message": "Job has reached the specified backoff limit"}]}},
        _preload_content=False, _content_type="application/merge-patch+json")
    result = await asyncio.wait_for(task, 20)
    assert result["state"] == "failed"
    assert result["reason"] == (f"analysis Job {name} failed before gpulens analyze exited: BackoffLimitExceeded "
                                "Job has reached the specified backoff limit (no pod was created)")


@pytest.mark.parametrize("code,reason,message", [
    (403, "Forbidden", 'jobs.batch is forbidden: User "system:serviceaccount:ml:gpulens-train-a0" cannot create '
                       'resource "jobs" in API group "batch" in the namespace "ml"'),
    (500, "InternalError", "Internal error occurred: etcdserver: request timed out"),
    (422, "Invalid", 'Job.batch "x" is invalid: spec.template.spec.containers[0].image: Required value')])
async def test_an_api_refusal_to_create_the_job_is_a_failed_analysis_not_a_crash(apiserver, code, reason, message):
    apiserver.server[kmock.resource("batch/v1/jobs"), kmock.action.CREATE] << code << status(code, reason, message)
    result = await runner(apiserver).run("file:///a/c-8/manifest.json", "c-8")
    name = analysis_job_name("train", 0, "c-8")
    assert result["state"] == "failed", result
    assert result["reason"].startswith(f"analysis Job {name}: create Job {name}: HTTP {code} ")
    assert message in result["reason"]
    # one refused create, then nothing: no poll of a Job that does not exist, no retry storm
    assert [r[0] for r in apiserver.requests_by(UA)] == ["POST"]


async def test_a_forbidden_read_fails_at_once_and_a_failing_api_server_at_the_deadline(apiserver):
    apiserver.server[kmock.resource("batch/v1/jobs"), kmock.action.FETCH] << 403 << status(
        403, "Forbidden", "jobs.batch \"x\" is forbidden")
    result = await runner(apiserver, timeout_s=60).run("file:///a/c-9/manifest.json", "c-9")
    assert result["state"] == "failed" and "get Job" in result["reason"] and "HTTP 403" in result["reason"]


async def test_an_api_server_failing_every_read_gives_up_at_the_deadline_and_deletes_the_job(apiserver):
    apiserver.server[kmock.resource("batch/v1/jobs"), kmock.action.FETCH] << 503 << status(
        503, "ServiceUnavailable", "the server is currently unable to handle the request")
    result = await runner(apiserver, timeout_s=1.0).run("file:///a/c-10/manifest.json", "c-10")
    assert result["state"] == "failed"
    assert "did not finish within 1 s (get Job" in result["reason"] and "HTTP 503" in result["reason"]
    assert "unable to handle the request" in result["reason"] and result["reason"].endswith("; deleted")
    assert jobs(apiserver) == []


async def test_an_unreachable_api_server_is_a_failed_analysis():
    cfg = client.Configuration()
    cfg.host, cfg.retries = "http://127.0.0.1:9", 0                 # discard port: nothing listens
    result = await AnalysisJobRunner(client.ApiClient(cfg), spec()).run("file:///a/manifest.json", "c-11")
    assert result["state"] == "failed" and "create Job" in result["reason"]


# --- what the coordinator's RBAC grants is what the runner uses -----------------------------------

async def test_every_runner_request_is_allowed_by_the_chart_coordinator_role_and_uses_all_of_it(apiserver):
    rules = one(render({}), "ClusterRole", "-coordinator")["rules"]
    with JobControllerDouble(apiserver, NS, behaviour=("exit", 0, "")):
        await runner(apiserver).run("file:///a/c-12/manifest.json", "c-12")
        await runner(apiserver).run("file:///a/c-12/manifest.json", "c-12")          # 409: found
    with JobControllerDouble(apiserver, NS, behaviour="unschedulable"):
        await runner(apiserver, timeout_s=0.3).run("file:///a/c-13/manifest.json", "c-13")
    made = [attributes(*r) for r in apiserver.requests_by(UA)]
    assert all(a is not None for a in made)
    denied = [a for a in made if not allowed(a, [], {NS: rules})]
    assert denied == []
    used = {(a.group, a.resource, a.verb) for a in made}
    granted_jobs = {("batch", "jobs", v) for r in rules if r["apiGroups"] == ["batch"] for v in r["verbs"]}
    assert granted_jobs == {u for u in used if u[:2] == ("batch", "jobs")}     # nothing granted that is not used


# --- the command line ----------------------------------------------------------------------------

def _args(*extra: str):
    parser, _ = build_subparser("coordinator")
    return parser.parse_args(["--job", "train", "--attempt", "1", "--namespace", NS, "--discovery", "kubernetes",
                              "--selector", "a=b", "--agent-url-template", "http://{node_ip}:9451",
                              "--archive-root", "s3://b/p", "--token-file", "/t", "--agent-token-file", "/a",
                              "--s3-endpoint", "http://minio:9000", *extra])


def test_analysis_job_on_the_command_line_builds_the_job_runner_from_its_flags():
    args = _args("--analysis", "job", "--analysis-image", "img:1", "--analysis-service-account", "sa",
                 "--analysis-env-from-secret", "arch", "--analysis-resources", '{"limits": {"memory": "8Gi"}}',
                 "--analysis-label", "gpulens.dev/job=train", "--analysis-image-pull-secret", "regcred",
                 "--analysis-timeout-s", "600", "--analysis-ttl-s", "60",
                 "--coordinator-name", "gpulens-train-a1", "--coordinator-uid", "u-1")
    r = analysis_for(args, api_client=client.ApiClient())
    assert isinstance(r, AnalysisJobRunner)
    assert r.spec == AnalysisJobSpec(namespace=NS, image="img:1", job_id="train", attempt=1,
                                     s3_endpoint="http://minio:9000", image_pull_secrets=("regcred",),
                                     service_account="sa", env_from_secret="arch",
                                     resources={"limits": {"memory": "8Gi"}}, labels={"gpulens.dev/job": "train"},
                                     owner=OwnerRef("gpulens-train-a1", "u-1"), timeout_s=600.0, ttl_s=60)
    assert not isinstance(analysis_for(_args("--analysis", "local")), AnalysisJobRunner)
    assert analysis_for(_args()) is None


@pytest.mark.parametrize("extra,problem", [
    (("--analysis", "job"), "--analysis job needs --analysis-image"),
    (("--analysis", "job", "--analysis-image", "i", "--coordinator-uid", "u"), "together"),
])
def test_an_incomplete_analysis_job_command_line_is_refused(extra, problem, capsys):
    from gpulens.capture.coordinator.command import run
    assert run(_args(*extra)) == 2
    assert problem in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["not json", '["limits"]', '{"limit": {}}', '{"limits": 3}'])
def test_bad_analysis_resources_are_refused_by_the_parser(bad, capsys):
    with pytest.raises(SystemExit):
        _args("--analysis", "job", "--analysis-image", "i", "--analysis-resources", bad)
    assert "--analysis-resources" in capsys.readouterr().err


async def _until(predicate, timeout_s: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not await asyncio.to_thread(predicate):
        assert loop.time() < end, "condition not met in time"
        await asyncio.sleep(0.02)
