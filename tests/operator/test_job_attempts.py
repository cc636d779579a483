"""A plain batch Job's replacement pod is a new attempt: the webhook counts the Job's failures at
admission (capture/operator/job_attempts.py), against the test API server with the real client.
A failed or slow read never holds a pod up: it is armed as attempt 0 and the webhook says so."""

from __future__ import annotations

import base64
import json
import logging
import threading

import jsonpatch
import pytest

from gpulens.capture.wire import labels as L
from gpulens.capture.operator.config import ArmingConfig
from gpulens.capture.operator.job_attempts import JobAttempts, batch_job_of_pod, failures_of, pods_per_attempt
from gpulens.capture.operator.kube import KubeApi, KubeError
from gpulens.capture.operator.webhook import attempt_for, review_response

from .test_arming import IMAGE, job_pod
from .test_webhook import review


def _job_pod_of(job: dict, **labels: str) -> dict:
    """A pod as the Job controller submits `job`'s next pod: owner reference with the Job's uid."""
    pod = job_pod()
    uid, name = job["metadata"]["uid"], job["metadata"]["name"]
    pod["metadata"]["labels"] = {L.BATCH_JOB_NAME: name, L.LEGACY_JOB_NAME: name, **labels}
    pod["metadata"]["generateName"] = f"{name}-"
    pod["metadata"]["ownerReferences"] = [{"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": uid,
                                           "controller": True, "blockOwnerDeletion": True}]
    return pod


@pytest.fixture
def attempts(apiserver) -> JobAttempts:
    return JobAttempts(KubeApi(apiserver.api_client()))


def test_the_first_pod_is_attempt_0_and_each_failed_pod_bumps_the_next(cluster, attempts):
    job = cluster.job("ml", "llama")
    assert attempts.attempt_of(_job_pod_of(job), "ml") == 0
    cluster.pod("ml", "llama-a", job=job, phase="Failed")
    assert attempts.attempt_of(_job_pod_of(job), "ml") == 1
    cluster.pod("ml", "llama-b", job=job, phase="Running")             # running pods are not failures
    cluster.pod("ml", "llama-c", job=job, phase="Succeeded")
    assert attempts.attempt_of(_job_pod_of(job), "ml") == 1
    cluster.pod("ml", "llama-d", job=job, phase="Failed")
    assert attempts.attempt_of(_job_pod_of(job), "ml") == 2


def test_a_multi_node_jobs_replacements_of_one_restart_share_their_attempt(cluster, attempts):
    """A two-node world (completions == parallelism == 2, as tests/cluster/workload.py's multi-node
    trainer) restarts whole: a node lost fails both pods, and both replacements are attempt 1, one
    coordinator over the whole world, not attempts 1 and 2 over a half each. Its next restart: 2."""
    job = cluster.job("ml", "llama", parallelism=2, completions=2)
    assert attempts.attempt_of(_job_pod_of(job), "ml") == 0
    cluster.pod("ml", "llama-a", job=job, phase="Failed")              # node 2's pod, lost with its node
    assert attempts.attempt_of(_job_pod_of(job), "ml") == 1
    cluster.pod("ml", "llama-b", job=job, phase="Failed")              # node 1's, its collective broken
    assert attempts.attempt_of(_job_pod_of(job), "ml") == 1
    cluster.pod("ml", "llama-c", job=job, phase="Failed")
    assert attempts.attempt_of(_job_pod_of(job), "ml") == 2


@pytest.mark.parametrize("spec, want", [
    ({}, 1), ({"parallelism": 1, "completions": 1}, 1), ({"parallelism": 4, "completions": 4}, 4),
    ({"parallelism": 4}, 1), ({"parallelism": 4, "completions": 100}, 1), ({"parallelism": 2, "completions": 4}, 1),
    ({"parallelism": "4", "completions": "4"}, 1), ({"parallelism": True, "completions": True}, 1)])
def test_only_a_fixed_size_world_counts_its_failures_several_at_a_time(spec, want):
    """A work queue (completions unset or larger) or a malformed spec keeps one pod per attempt."""
    assert pods_per_attempt({"spec": spec}) == want


def test_failed_pods_of_another_job_of_the_same_name_do_not_count(cluster, attempts):
    old = cluster.job("ml", "llama")
    cluster.pod("ml", "llama-a", job=old, phase="Failed")
    cluster.delete_job("ml", "llama")                                   # its pods go with it (GC)...
    new = cluster.job("ml", "llama")
    stray = cluster.pod("ml", "stray", labels={L.LEGACY_JOB_NAME: "llama", L.BATCH_JOB_NAME: "llama"},
                        phase="Failed")                                  # ...a same-labelled pod no Job owns
    assert stray["metadata"]["labels"][L.LEGACY_JOB_NAME] == "llama"
    assert attempts.attempt_of(_job_pod_of(new), "ml") == 0
    assert attempts.attempt_of(_job_pod_of(old), "ml") == 0             # a pod naming a gone Job's uid


def test_the_jobs_status_counts_failures_whose_pods_are_gone(cluster, attempts):
    job = cluster.job("ml", "llama")
    cluster.batch.patch_namespaced_job_status(
        "llama", "ml", {"status": {"failed": 2, "uncountedTerminatedPods": {"failed": ["p-3"]}}},
        _content_type="application/merge-patch+json", _preload_content=False)
    assert attempts.attempt_of(_job_pod_of(job), "ml") == 3


def test_pods_that_say_their_attempt_or_have_no_batch_job_are_not_read(apiserver, cluster, attempts):
    job = cluster.job("ml", "llama")
    cluster.pod("ml", "llama-a", job=job, phase="Failed")
    before = len(apiserver.requests())
    assert attempts.attempt_of(_job_pod_of(job, **{L.ATTEMPT: "7"}), "ml") is None
    assert attempts.attempt_of(_job_pod_of(job, **{L.JOBSET_NAME: "js", L.JOBSET_RESTART: "2"}), "ml") is None
    bare = job_pod()
    bare["metadata"]["ownerReferences"] = []
    assert attempts.attempt_of(bare, "ml") is None
    assert len(apiserver.requests()) == before


@pytest.mark.parametrize("status, failed_pods, want", [
    ({}, 0, 0), ({"failed": 1}, 0, 1), ({"failed": 1}, 3, 3), ({"failed": "2"}, 0, 0), ({"failed": -1}, 0, 0),
    ({"failed": True}, 0, 0), ({"failed": 1, "uncountedTerminatedPods": {"failed": ["a", "b"]}}, 0, 3),
    ({"uncountedTerminatedPods": {"failed": "ab"}}, 0, 0), ({"uncountedTerminatedPods": None}, 1, 1)])
def test_failures_of_a_malformed_status_count_only_what_is_well_formed(status, failed_pods, want):
    assert failures_of({"status": status}, failed_pods) == want


def test_only_a_controlling_batch_job_with_a_uid_is_the_owner():
    pod = job_pod()
    assert batch_job_of_pod(pod).name == "llama"
    pod["metadata"]["ownerReferences"][0]["controller"] = False
    assert batch_job_of_pod(pod) is None
    pod = job_pod()
    del pod["metadata"]["ownerReferences"][0]["uid"]
    assert batch_job_of_pod(pod) is None


def _labels_after(review_obj: dict, attempt) -> dict:
    resp = review_response(review_obj, ArmingConfig(), IMAGE, attempt)["response"]
    pod = review_obj["request"]["object"]
    return jsonpatch.apply_patch(pod, json.loads(base64.b64decode(resp["patch"])))["metadata"]["labels"]


async def test_the_webhook_arms_a_replacement_pod_as_the_next_attempt(cluster, attempts):
    job = cluster.job("ml", "llama")
    first = review(_job_pod_of(job))
    assert _labels_after(first, await attempt_for(first, attempts.attempt_of))[L.ATTEMPT] == "0"
    cluster.pod("ml", "llama-a", job=job, phase="Failed")
    second = review(_job_pod_of(job))
    assert _labels_after(second, await attempt_for(second, attempts.attempt_of))[L.ATTEMPT] == "1"
    # A label set by hand still wins over the count.
    pinned = review(_job_pod_of(job, **{L.ATTEMPT: "5"}))
    assert _labels_after(pinned, await attempt_for(pinned, attempts.attempt_of))[L.ATTEMPT] == "5"


async def test_an_unreachable_api_arms_the_pod_as_attempt_0_and_logs_it(cluster, caplog):
    from kubernetes import client
    from tests.conftest import free_port
    cfg = client.Configuration()
    cfg.host = f"http://127.0.0.1:{free_port()}"                         # nothing listens there
    reader = JobAttempts(KubeApi(client.ApiClient(cfg)))
    job = cluster.job("ml", "llama")
    cluster.pod("ml", "llama-a", job=job, phase="Failed")
    pod = _job_pod_of(job)
    with pytest.raises(KubeError):
        reader.attempt_of(pod, "ml")
    rev = review(pod)
    with caplog.at_level(logging.WARNING, logger="gpulens.webhook"):
        attempt = await attempt_for(rev, reader.attempt_of)
    assert attempt is None
    resp = review_response(rev, ArmingConfig(), IMAGE, attempt)["response"]
    assert resp["allowed"] is True and resp["patchType"] == "JSONPatch"
    assert _labels_after(rev, attempt)[L.ATTEMPT] == "0"
    (line,) = [r.gpulens_fields for r in caplog.records if getattr(r, "gpulens_fields", {}).get("event") == "attempt.unread"]
    assert line["attempt"] == 0 and "KubeError" in line["reason"] and line["uid"] == rev["request"]["uid"]


async def test_a_read_past_the_budget_is_given_up_not_waited_for(caplog):
    release = threading.Event()

    def stuck(pod, namespace):
        release.wait(30)
        return 4
    rev = review(job_pod())
    try:
        with caplog.at_level(logging.WARNING, logger="gpulens.webhook"):
            assert await attempt_for(rev, stuck, budget_s=0.2) is None
    finally:
        release.set()
    assert [r.gpulens_fields["reason"] for r in caplog.records
            if getattr(r, "gpulens_fields", {}).get("event") == "attempt.unread"] == ["timeout"]


async def test_no_read_for_what_is_not_a_pod_creation():
    calls = []

    def reader(pod, namespace):
        calls.append(pod)
        return 9
    for rev in (review(job_pod(), operation="UPDATE"), review({"metadata": {}}, kind="Service"),
                review(job_pod(), group="apps")):
        assert await attempt_for(rev, reader) is None
    assert calls == []
    with pytest.raises(ValueError):
        await attempt_for({"kind": "AdmissionReview"}, reader)
