"""Arming a trainer pod: the JSON Patch the webhook returns, applied with a real RFC 6902
implementation (jsonpatch), gives a valid Pod with the hook, its environment, volumes and labels,
and leaves everything the pod already had in place."""

from __future__ import annotations

import copy

import jsonpatch
import kubernetes_validate
import pytest

from gpulens.capture.wire import labels as L
from gpulens.capture.operator.arming import IMAGE_ENV_CONTAINER, INIT_CONTAINER, arm_pod
from gpulens.capture.operator.config import ArmingConfig
from gpulens.capture.operator.jobs import job_of_pod

CFG = ArmingConfig()
IMAGE = "registry.example.com/gpulens:0.1.0"
HOOK_ENV = {"PYTHONPATH", "GPULENS_JOB_ID", "GPULENS_ATTEMPT", "GPULENS_REGISTRY_DIR", "GPULENS_TRACE_DIR",
            "GPULENS_SOCKET_DIR", "GPULENS_POD_NAME", "GPULENS_NAMESPACE", "GPULENS_POD_UID", "GPULENS_NODE_NAME",
            "GPULENS_CONTAINER_NAME"}


def job_pod(**over) -> dict:
    """A pod as the Job controller submits it (generateName, owner reference, job labels)."""
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"generateName": "llama-", "namespace": "ml",
                        "labels": {"batch.kubernetes.io/job-name": "llama", "job-name": "llama",
                                   "batch.kubernetes.io/controller-uid": "u-1"},
                        "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": "llama", "uid": "u-1",
                                             "controller": True, "blockOwnerDeletion": True}]},
           "spec": {"restartPolicy": "Never",
                    "containers": [{"name": "trainer", "image": "pytorch:2.13",
                                    "command": ["torchrun", "--nproc-per-node=8", "train.py"],
                                    "resources": {"limits": {"nvidia.com/gpu": "8"}},
                                    "env": [{"name": "PYTHONPATH", "value": "/workspace/src"}]},
                                   {"name": "log-shipper", "image": "fluent-bit:3"}]}}
    for k, v in over.items():
        pod[k] = v
    return pod


def armed(pod: dict) -> dict:
    result = arm_pod(pod, "ml", CFG, IMAGE)
    assert result.patch, result.reason
    return jsonpatch.apply_patch(pod, result.patch)


def _env(container: dict) -> dict:
    return {e["name"]: e for e in container.get("env", [])}


def test_arming_a_job_pod_adds_exactly_the_hook_pieces():
    pod = job_pod()
    original = copy.deepcopy(pod)
    out = armed(pod)
    assert pod == original                                      # the input is not mutated
    meta = out["metadata"]
    assert meta["labels"][L.ARMED] == "true"
    assert meta["labels"][L.JOB] == "llama" and meta["labels"][L.ATTEMPT] == "0"
    assert meta["annotations"][L.LOCAL_WORLD_SIZE] == "8"       # from --nproc-per-node=8
    trainer, shipper = out["spec"]["containers"]
    assert set(_env(trainer)) == HOOK_ENV
    assert _env(trainer)["PYTHONPATH"]["value"] == "/opt/gpulens/hook:/workspace/src"
    assert _env(trainer)["GPULENS_JOB_ID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.labels['gpulens.dev/job']"}}
    assert _env(trainer)["GPULENS_POD_UID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.uid"}}
    assert _env(trainer)["GPULENS_CONTAINER_NAME"]["value"] == "trainer"
    assert shipper == original["spec"]["containers"][1]         # only the first container by default
    mounts = {m["mountPath"]: m["name"] for m in trainer["volumeMounts"]}
    assert mounts == {"/opt/gpulens/hook": "gpulens-hook", "/var/lib/gpulens/registry": "gpulens-registry",
                      "/var/lib/gpulens/traces": "gpulens-traces", "/run/gpulens": "gpulens-sockets"}
    vols = {v["name"]: v for v in out["spec"]["volumes"]}
    assert vols["gpulens-hook"] == {"name": "gpulens-hook", "emptyDir": {}}
    assert vols["gpulens-sockets"]["hostPath"] == {"path": "/run/gpulens", "type": "DirectoryOrCreate"}
    (init,) = out["spec"]["initContainers"]
    assert init["image"] == IMAGE and "gpulens hook-path" in init["command"][-1]
    assert init["securityContext"]["runAsNonRoot"] is True
    # Everything else is unchanged.
    for key in ("restartPolicy",):
        assert out["spec"][key] == original["spec"][key]
    assert trainer["command"] == original["spec"]["containers"][0]["command"]
    out["metadata"]["name"] = "llama-x7k2p"
    kubernetes_validate.validate(out, "1.30", strict=True)


def test_the_job_id_the_hook_reads_is_the_one_the_operator_groups_by():
    out = armed(job_pod())
    job = job_of_pod(out)
    assert job.job_id == out["metadata"]["labels"][L.JOB] == "llama"
    assert job.owner.kind == "Job" and job.owner.uid == "u-1"     # still garbage-collected with the Job


@pytest.mark.parametrize("kind", ["pytorchjob", "jobset", "label"])
def test_other_job_kinds_are_recognised(kind):
    pod = job_pod()
    meta = pod["metadata"]
    meta["labels"] = {}
    if kind == "pytorchjob":
        meta["ownerReferences"] = [{"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": "bert", "uid": "p"}]
        meta["labels"] = {"training.kubeflow.org/job-name": "bert", "training.kubeflow.org/replica-type": "worker"}
        want = "bert"
    elif kind == "jobset":
        meta["ownerReferences"] = [{"apiVersion": "batch/v1", "kind": "Job", "name": "gpt-workers-0", "uid": "c"}]
        meta["labels"] = {"jobset.sigs.k8s.io/jobset-name": "gpt", "jobset.sigs.k8s.io/jobset-uid": "js",
                          "jobset.sigs.k8s.io/restart-attempt": "2", "batch.kubernetes.io/job-name": "gpt-workers-0"}
        want = "gpt"
    else:
        del meta["ownerReferences"]
        meta["labels"] = {L.JOB: "sweep-17"}
        want = "sweep-17"
    out = armed(pod)
    assert out["metadata"]["labels"][L.JOB] == want
    if kind == "jobset":
        assert out["metadata"]["labels"][L.ATTEMPT] == "2"          # JobSet restarts are attempts
        assert job_of_pod(out).owner.kind == "JobSet" and job_of_pod(out).owner.uid == "js"


def test_a_long_job_name_becomes_a_valid_label_value():
    pod = job_pod()
    long = "x" * 70
    pod["metadata"]["labels"] = {}
    pod["metadata"]["ownerReferences"] = [{"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": long, "uid": "p"}]
    out = armed(pod)
    value = out["metadata"]["labels"][L.JOB]
    assert L.is_label_value(value) and value != long
    assert job_of_pod(out).job_id == value


@pytest.mark.parametrize("case", ["not-a-job", "opted-out", "already-armed", "no-containers"])
def test_pods_left_alone(case):
    pod = job_pod()
    if case == "not-a-job":
        pod["metadata"] = {"name": "web", "labels": {"app": "web"}}
    elif case == "opted-out":
        pod["metadata"]["labels"][L.ARM_OPT_OUT] = "false"
    elif case == "already-armed":
        pod = armed(pod)
    else:
        pod["spec"]["containers"] = []
    result = arm_pod(pod, "ml", CFG, IMAGE)
    assert result.patch == []
    assert result.reason in {"not part of a job", "opted out", "already armed", "no containers"}


def test_the_operators_own_coordinator_pod_is_left_alone():
    """It lives in the job's namespace with the job's label; armed, it became a rank of its own job
    (seen in the real cluster: rank 2 `not_registered`, the capture never fully succeeded)."""
    from gpulens.capture.operator.manifests import coordinator_pod, coordinator_resource

    from .conftest import operator_config
    config = operator_config()
    trainer = armed(job_pod())
    trainer["metadata"]["name"] = "llama-0"
    cc = coordinator_resource(job_of_pod(trainer, "ml"), 0, [trainer], config)
    cc["metadata"]["uid"] = "cc-uid"
    pod = coordinator_pod(cc, config)
    assert job_of_pod(pod, "ml") is not None           # it does name the job: only the new rule spares it
    result = arm_pod(pod, "ml", CFG, IMAGE)
    assert (result.patch, result.reason) == ([], "a gpulens pod")


def test_arming_twice_changes_nothing_the_second_time():
    once = armed(job_pod())
    assert arm_pod(once, "ml", CFG, IMAGE).patch == []


def test_user_settings_win_over_ours():
    pod = job_pod()
    c = pod["spec"]["containers"][0]
    c["env"] += [{"name": "GPULENS_TRACE_DIR", "value": "/scratch/traces"}]
    pod["metadata"]["labels"][L.ATTEMPT] = "3"
    pod["metadata"]["annotations"] = {L.LOCAL_WORLD_SIZE: "4"}
    out = armed(pod)
    env = _env(out["spec"]["containers"][0])
    assert env["GPULENS_TRACE_DIR"]["value"] == "/scratch/traces"
    assert [e["name"] for e in out["spec"]["containers"][0]["env"]].count("GPULENS_TRACE_DIR") == 1
    assert out["metadata"]["labels"][L.ATTEMPT] == "3"
    assert out["metadata"]["annotations"][L.LOCAL_WORLD_SIZE] == "4"


def test_chosen_containers_and_warnings():
    pod = job_pod()
    pod["metadata"]["annotations"] = {L.CONTAINERS: "log-shipper, ghost"}
    result = arm_pod(pod, "ml", CFG, IMAGE)
    out = jsonpatch.apply_patch(pod, result.patch)
    assert "GPULENS_JOB_ID" not in _env(out["spec"]["containers"][0])
    assert "GPULENS_JOB_ID" in _env(out["spec"]["containers"][1])
    assert any("ghost" in w for w in result.warnings)


def test_an_image_that_sets_pythonpath_itself_gets_an_init_container_of_that_image_to_save_it():
    """The pod sets no PYTHONPATH (the image's ENV does): arming's PYTHONPATH would replace it, so an
    init container of the trainer's own image, after the hook copy, saves it for the hook."""
    pod = job_pod()
    trainer = pod["spec"]["containers"][0]
    del trainer["env"]
    trainer["imagePullPolicy"] = "Always"
    trainer["envFrom"] = [{"configMapRef": {"name": "paths"}}]
    out = armed(pod)
    hook, reader = out["spec"]["initContainers"]
    assert hook["name"] == INIT_CONTAINER and "busybox" in hook["command"][-1]
    assert reader["name"] == f"{IMAGE_ENV_CONTAINER}-1" and reader["image"] == "pytorch:2.13"
    assert reader["command"][:3] == ["/opt/gpulens/hook/.bin/busybox", "sh", "-c"]
    assert '"${PYTHONPATH-}" > "/opt/gpulens/hook/image-env/trainer/PYTHONPATH"' in reader["command"][3]
    assert reader["imagePullPolicy"] == "Always" and reader["envFrom"] == trainer["envFrom"]
    assert reader["securityContext"]["runAsUser"] == 65534 and "env" not in reader
    assert {"name": "gpulens-hook", "mountPath": "/opt/gpulens/hook"} in reader["volumeMounts"]
    assert _env(out["spec"]["containers"][0])["PYTHONPATH"]["value"] == "/opt/gpulens/hook"
    out["metadata"]["name"] = "llama-x7k2p"
    kubernetes_validate.validate(out, "1.30", strict=True)


def test_each_armed_container_without_pythonpath_gets_its_own_reader():
    pod = job_pod()
    pod["metadata"]["annotations"] = {L.CONTAINERS: "trainer,log-shipper"}
    out = armed(pod)
    readers = [c for c in out["spec"]["initContainers"] if c["name"].startswith(IMAGE_ENV_CONTAINER)]
    # the trainer sets PYTHONPATH in the pod (prefixed, nothing to save); the shipper's image may
    assert [(c["name"], c["image"]) for c in readers] == [(f"{IMAGE_ENV_CONTAINER}-1", "fluent-bit:3")]
    assert "image-env/log-shipper/PYTHONPATH" in readers[0]["command"][3]


def test_pythonpath_from_a_reference_is_reported_not_broken():
    pod = job_pod()
    pod["spec"]["containers"][0]["env"] = [{"name": "PYTHONPATH", "valueFrom": {"configMapKeyRef": {"name": "c",
                                                                                                 "key": "p"}}}]
    result = arm_pod(pod, "ml", CFG, IMAGE)
    out = jsonpatch.apply_patch(pod, result.patch)
    assert _env(out["spec"]["containers"][0])["PYTHONPATH"] == pod["spec"]["containers"][0]["env"][0]
    assert any("PYTHONPATH" in w for w in result.warnings)


def test_patch_applies_to_a_pod_without_labels_or_volumes():
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "ml",
                                                          "labels": {L.JOB: "adhoc"}},
           "spec": {"containers": [{"name": "c", "image": "i"}]}}
    del pod["metadata"]["namespace"]
    out = armed(pod)
    assert [v["name"] for v in out["spec"]["volumes"]] == ["gpulens-hook", "gpulens-registry", "gpulens-traces",
                                                            "gpulens-sockets"]
    # Nothing says how many workers it starts (no launcher, no GPU): no number is made up.
    assert L.LOCAL_WORLD_SIZE not in out["metadata"]["annotations"]


@pytest.mark.parametrize("container, gpus, want", [
    # torchrun's own setting wins over the GPU limit, in every spelling torchrun accepts
    ({"command": ["torchrun", "--nproc-per-node=2", "train.py"]}, None, 2),
    ({"command": ["/usr/local/bin/torchrun"], "args": ["--nproc_per_node", "2", "train.py"]}, 8, 2),
    ({"command": ["python3", "-m", "torch.distributed.run", "--nproc-per-node=2", "-m", "pkg.train"]}, None, 2),
    ({"command": ["python", "-mtorch.distributed.launch", "--nproc_per_node=4", "t.py"]}, None, 4),
    ({"command": ["torchrun", "--nnodes=2", "--nproc-per-node", "gpu", "t.py"]}, 4, 4),
    # in a shell script, also as "$@" after `sh -c SCRIPT sh`
    ({"command": ["bash", "-lc", "pip list >/dev/null && torchrun --nproc-per-node=3 t.py"]}, None, 3),
    ({"command": ["sh", "-c", 'test -f /x || exit 1; exec "$@"', "sh", "python3", "-m",
                  "torch.distributed.run", "--nproc-per-node=2", "t.py"]}, None, 2),
    # torchrun without the flag starts one worker; PyTorchJob's PET_NPROC_PER_NODE is read too
    ({"command": ["torchrun", "t.py"]}, 8, 1),
    ({"command": ["torchrun", "t.py"], "env": [{"name": "PET_NPROC_PER_NODE", "value": "2"}]}, None, 2),
    ({"command": ["python", "t.py"], "env": [{"name": "PET_NPROC_PER_NODE", "value": "6"}]}, 8, 6),
    # decided on the node, or not stated: unknown, never a guess of 1
    ({"command": ["torchrun", "--nproc-per-node=auto", "t.py"]}, None, None),
    ({"command": ["torchrun", "--nproc-per-node=gpu", "t.py"]}, None, None),
    ({"command": ["sh", "-c", "torchrun --nproc-per-node=$N t.py"]}, None, None),
    ({"command": ["python", "t.py"], "env": [{"name": "PET_NPROC_PER_NODE", "valueFrom": {}}]}, None, None),
    ({"command": ["python", "train.py"]}, None, None),
    ({}, None, None),
    # no launcher named, GPUs requested: one worker per GPU (mpirun-style launchers)
    ({"command": ["python", "train.py"]}, 8, 8),
])
def test_local_world_size_from_the_launch(container, gpus, want):
    from gpulens.capture.operator.launcher import local_world_size
    assert local_world_size({"name": "trainer", **container}, gpus) == want


def test_torchrun_with_two_workers_on_a_cpu_node_is_annotated_2():
    """Issue 31: `torchrun --nproc-per-node=2` without a GPU limit was annotated "1"."""
    pod = job_pod()
    c = pod["spec"]["containers"][0]
    c["command"] = ["python3", "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-port=29500",
                    "-m", "gpulens.up.demo_trainer"]
    del c["resources"]
    assert armed(pod)["metadata"]["annotations"][L.LOCAL_WORLD_SIZE] == "2"
    c["command"] = ["torchrun", "--nproc-per-node=auto", "t.py"]
    assert L.LOCAL_WORLD_SIZE not in armed(pod)["metadata"].get("annotations", {})
