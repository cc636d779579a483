"""Arming serving workloads: Deployment, StatefulSet and LeaderWorkerSet pods, shaped as their
controllers submit them, are armed only when their namespace (the webhook's serving entry,
`/mutate-serving`) or their workload (`gpulens.dev/arm=true`) opted in; each gets its revision's
job id, so a rolling update's pods are another job than the old revision's."""

from __future__ import annotations

import base64
import json

import jsonpatch
import kubernetes_validate
import pytest

from gpulens.capture.wire import labels as L
from gpulens.capture.operator.arming import arm_pod
from gpulens.capture.operator.config import ArmingConfig
from gpulens.capture.operator.jobs import job_of_pod, serving_of_pod

from .test_arming import IMAGE
from .test_webhook import review, webhook  # noqa: F401 - the fixture

CFG = ArmingConfig()


def deployment_pod(name: str = "web", template_hash: str = "7f9c8d5b4", *, labels: dict | None = None,
                   command: list | None = None) -> dict:
    """A pod as the ReplicaSet controller submits it for Deployment `name` at revision `template_hash`."""
    rs = f"{name}-{template_hash}"
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"generateName": f"{rs}-", "namespace": "serve",
                         "labels": {"app": name, L.POD_TEMPLATE_HASH: template_hash, **(labels or {})},
                         "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": rs,
                                              "uid": f"uid-{rs}", "controller": True, "blockOwnerDeletion": True}]},
            "spec": {"containers": [{"name": "server", "image": "model-server:1",
                                     "command": command or ["python", "serve.py"]}]}}


def statefulset_pod(name: str = "llm", ordinal: int = 0, revision: str = "llm-5d8f7c9b6") -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"{name}-{ordinal}", "namespace": "serve",
                         "labels": {"app": name, L.CONTROLLER_REVISION_HASH: revision,
                                    "statefulset.kubernetes.io/pod-name": f"{name}-{ordinal}"},
                         "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": name,
                                              "uid": "uid-sts", "controller": True, "blockOwnerDeletion": True}]},
            "spec": {"containers": [{"name": "server", "image": "model-server:1",
                                     "command": ["torchrun", "--nproc-per-node=4", "serve.py"]}]}}


def armed(pod: dict, **kw) -> dict:
    result = arm_pod(pod, "serve", CFG, IMAGE, **kw)
    assert result.patch, result.reason
    return jsonpatch.apply_patch(pod, result.patch)


def test_a_deployment_pod_is_left_alone_unless_someone_opted_in():
    result = arm_pod(deployment_pod(), "serve", CFG, IMAGE)
    assert result.patch == [] and "opted in" in result.reason
    # ... its workload opts in with gpulens.dev/arm=true on the pod template, its namespace via the serving entry
    assert arm_pod(deployment_pod(labels={L.ARM_OPT_OUT: "true"}), "serve", CFG, IMAGE).patch
    assert arm_pod(deployment_pod(), "serve", CFG, IMAGE, serving=True).patch
    # ... and an opted-out pod stays out even in a serving namespace
    assert arm_pod(deployment_pod(labels={L.ARM_OPT_OUT: "false"}), "serve", CFG, IMAGE, serving=True).patch == []


def test_an_armed_deployment_pod_names_its_revision_and_stays_a_valid_pod():
    out = armed(deployment_pod(), serving=True)
    lbl = out["metadata"]["labels"]
    assert lbl[L.ARMED] == "true" and lbl[L.JOB] == "web-7f9c8d5b4" and lbl[L.SERVING] == "Deployment"
    assert lbl[L.ATTEMPT] == "0"
    env = {e["name"]: e for e in out["spec"]["containers"][0]["env"]}
    assert env["GPULENS_JOB_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == f"metadata.labels['{L.JOB}']"
    kubernetes_validate.validate(out, "1.30", strict=True)
    # Once armed, the operator groups it as its revision's serving job (no owner: the ReplicaSet
    # outlives its pods, so the coordinator goes with the pods, not with an owner).
    job = job_of_pod(out, "serve")
    assert (job.job_id, job.kind, job.owner, job.serving) == ("web-7f9c8d5b4", "Deployment", None, True)
    assert job.selector == {L.JOB: "web-7f9c8d5b4"}


def test_a_rolling_update_is_another_job():
    old, new = armed(deployment_pod(template_hash="aaaa1"), serving=True), \
        armed(deployment_pod(template_hash="bbbb2"), serving=True)
    assert job_of_pod(old).job_id == "web-aaaa1" and job_of_pod(new).job_id == "web-bbbb2"
    assert serving_of_pod(deployment_pod(template_hash="bbbb2")).workload == "Deployment/web"


def test_a_statefulset_pod_with_several_model_workers_is_several_targets():
    out = armed(statefulset_pod(), serving=True)
    lbl, ann = out["metadata"]["labels"], out["metadata"]["annotations"]
    assert lbl[L.JOB] == "llm-5d8f7c9b6" and lbl[L.SERVING] == "StatefulSet"
    assert ann[L.LOCAL_WORLD_SIZE] == "4"             # tensor-parallel workers: four targets in this pod
    assert serving_of_pod(statefulset_pod(revision="abc123")).job_id == "llm-abc123"


def test_a_leaderworkerset_group_is_its_revisions_job():
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "lws-0-1", "labels": {L.LWS_NAME: "lws", L.LWS_REVISION: "66c9f",
                                                      "leaderworkerset.sigs.k8s.io/group-index": "0"}},
           "spec": {"containers": [{"name": "w", "image": "vllm:1"}]}}
    out = armed(pod, serving=True)
    assert out["metadata"]["labels"][L.JOB] == "lws-66c9f" and out["metadata"]["labels"][L.SERVING] == "LeaderWorkerSet"


@pytest.mark.parametrize("pod", [
    # a bare ReplicaSet whose name carries no template hash, a DaemonSet pod, an unowned pod
    {"metadata": {"labels": {L.POD_TEMPLATE_HASH: "x1"}, "ownerReferences": [
        {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "bare", "uid": "u", "controller": True}]},
     "spec": {"containers": [{"name": "c", "image": "i"}]}},
    {"metadata": {"labels": {L.CONTROLLER_REVISION_HASH: "ds-1"}, "ownerReferences": [
        {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "ds", "uid": "u", "controller": True}]},
     "spec": {"containers": [{"name": "c", "image": "i"}]}},
    {"metadata": {"name": "loner"}, "spec": {"containers": [{"name": "c", "image": "i"}]}},
])
def test_pods_of_no_serving_workload_are_not_armed_even_in_a_serving_namespace(pod):
    assert arm_pod(pod, "serve", CFG, IMAGE, serving=True).patch == []


def test_a_training_pod_is_armed_as_before_in_a_serving_namespace():
    from .test_arming import job_pod
    plain, serving = arm_pod(job_pod(), "ml", CFG, IMAGE), arm_pod(job_pod(), "ml", CFG, IMAGE, serving=True)
    assert plain.patch == serving.patch and plain.job_id == "llama"
    assert L.SERVING not in jsonpatch.apply_patch(job_pod(), plain.patch)["metadata"]["labels"]


async def test_the_serving_entry_arms_what_the_training_entry_leaves(webhook):  # noqa: F811
    pod = deployment_pod()
    answers = {}
    for path in ("/mutate", "/mutate-serving"):
        async with webhook.post(path, json=review(pod)) as resp:
            assert resp.status == 200
            answers[path] = (await resp.json())["response"]
    assert answers["/mutate"]["allowed"] is True and "patch" not in answers["/mutate"]
    out = jsonpatch.apply_patch(pod, json.loads(base64.b64decode(answers["/mutate-serving"]["patch"])))
    assert out["metadata"]["labels"][L.JOB] == "web-7f9c8d5b4"
