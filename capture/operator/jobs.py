"""Which training job (and attempt) a pod belongs to: pure functions over pod dicts.

The webhook and the operator both call `job_of_pod`, so the job id a trainer writes into its
registration record (GPULENS_JOB_ID) is the same id the operator groups pods by and names the
coordinator after. Precedence: an explicit `gpulens.dev/job` label, then PyTorchJob, JobSet and
Job, recognised by the labels and owner references their controllers set.

Serving workloads (Deployment, StatefulSet, LeaderWorkerSet) are grouped per *revision*:
`serving_of_pod` names the revision's job id (the ReplicaSet's name `<deployment>-<pod-template-hash>`,
the StatefulSet's ControllerRevision name, `<lws>-<template-revision-hash>`); the webhook stamps it
as `gpulens.dev/job` with `gpulens.dev/serving=<Kind>`, so from then on the pod is grouped like a
labelled training pod, and a rolling update's new revision is a new job with its own coordinator.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from ..wire import labels as L

__all__ = ["OwnerRef", "JobRef", "job_of_pod", "serving_of_pod", "attempt_of_pod", "is_armed", "is_live", "local_world_size_of_pod",
           "world_size_of_pod"]

_PYTORCHJOB = ("kubeflow.org/v1", "PyTorchJob")
_JOBSET = ("jobset.x-k8s.io/v1alpha2", "JobSet")
_JOB = ("batch/v1", "Job")
_REPLICASET = ("apps/v1", "ReplicaSet")
_STATEFULSET = ("apps/v1", "StatefulSet")


@dataclass(frozen=True)
class OwnerRef:
    """The Kubernetes object whose deletion must take the coordinator with it."""
    api_version: str
    kind: str
    name: str
    uid: str | None = None     # None: known by name only (resolved with a GET before use)

    def to_owner_reference(self) -> dict[str, Any]:
        assert self.uid, "an owner reference needs the owner's uid"
        return {"apiVersion": self.api_version, "kind": self.kind, "name": self.name, "uid": self.uid,
                "controller": False, "blockOwnerDeletion": False}


@dataclass(frozen=True)
class JobRef:
    namespace: str
    job_id: str
    kind: str                                   # Label, PyTorchJob, JobSet, Job, or a serving kind (labels.SERVING_KINDS)
    selector: Mapping[str, str] = field(default_factory=dict)   # labels every pod of the job carries
    owner: OwnerRef | None = None
    workload: str | None = None                 # serving: "<Kind>/<name>" (the exporter's gpulens_workload)

    @property
    def serving(self) -> bool:
        return self.kind in L.SERVING_KINDS

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.job_id)


def _meta(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    return pod.get("metadata") or {}


def _owner(pod: Mapping[str, Any], api_kind: tuple[str, str]) -> OwnerRef | None:
    for ref in _meta(pod).get("ownerReferences") or []:
        if (ref.get("apiVersion"), ref.get("kind")) == api_kind and ref.get("name"):
            return OwnerRef(ref["apiVersion"], ref["kind"], ref["name"], ref.get("uid"))
    return None


def job_of_pod(pod: Mapping[str, Any], namespace: str | None = None) -> JobRef | None:
    """The job this pod belongs to, or None for a pod that is not part of a recognisable job."""
    meta = _meta(pod)
    lbl: Mapping[str, str] = meta.get("labels") or {}
    ns = meta.get("namespace") or namespace or "default"
    pytorchjob = _owner(pod, _PYTORCHJOB)
    job = _owner(pod, _JOB)
    jobset_name = lbl.get(L.JOBSET_NAME)
    jobset = OwnerRef(*_JOBSET, jobset_name, lbl.get(L.JOBSET_UID)) if jobset_name else None

    explicit = lbl.get(L.JOB)
    serving = lbl.get(L.SERVING)
    if explicit and L.is_label_value(explicit) and serving in L.SERVING_KINDS:
        # An armed serving pod: one job per revision, no owner (its ReplicaSet or revision
        # outlives its pods); the coordinator goes when the revision has no live pod left.
        return JobRef(ns, explicit, serving, {L.JOB: explicit})
    if explicit and L.is_label_value(explicit):
        # The owner for garbage collection is still the real job object when there is one.
        return JobRef(ns, explicit, "Label", {L.JOB: explicit}, pytorchjob or jobset or job)
    if pytorchjob and lbl.get(L.PYTORCHJOB_NAME) == pytorchjob.name:
        return JobRef(ns, pytorchjob.name, "PyTorchJob", {L.PYTORCHJOB_NAME: pytorchjob.name}, pytorchjob)
    if pytorchjob:
        return JobRef(ns, pytorchjob.name, "PyTorchJob", {}, pytorchjob)
    if jobset:
        return JobRef(ns, jobset.name, "JobSet", {L.JOBSET_NAME: jobset.name}, jobset)
    name = lbl.get(L.BATCH_JOB_NAME) or lbl.get(L.LEGACY_JOB_NAME) or (job.name if job else None)
    if name and L.is_label_value(name):
        key = L.BATCH_JOB_NAME if L.BATCH_JOB_NAME in lbl else L.LEGACY_JOB_NAME if L.LEGACY_JOB_NAME in lbl else None
        owner = job if job and job.name == name else OwnerRef(*_JOB, name)
        return JobRef(ns, name, "Job", {key: name} if key else {}, owner)
    return None


def _controller_owner(pod: Mapping[str, Any], api_kind: tuple[str, str]) -> OwnerRef | None:
    for ref in _meta(pod).get("ownerReferences") or []:
        if (ref.get("apiVersion"), ref.get("kind")) == api_kind and ref.get("name") and ref.get("controller"):
            return OwnerRef(ref["apiVersion"], ref["kind"], ref["name"], ref.get("uid"))
    return None


def serving_of_pod(pod: Mapping[str, Any], namespace: str | None = None) -> JobRef | None:
    """The serving workload revision of a pod its controller just created, or None.

    Read at admission from what the controllers set before they create a pod: the ReplicaSet
    owner and `pod-template-hash` (Deployment), the StatefulSet owner and `controller-revision-hash`,
    the LeaderWorkerSet name and template revision labels. A bare ReplicaSet (no Deployment's
    hash in its name) is not a serving workload here.
    """
    meta = _meta(pod)
    lbl: Mapping[str, str] = meta.get("labels") or {}
    ns = meta.get("namespace") or namespace or "default"
    lws, lws_rev = lbl.get(L.LWS_NAME), lbl.get(L.LWS_REVISION)
    if lws and lws_rev:
        job_id = L.dns_name(lws, lws_rev)
        return JobRef(ns, job_id, "LeaderWorkerSet", {L.JOB: job_id}, workload=f"LeaderWorkerSet/{lws}")
    rs, template_hash = _controller_owner(pod, _REPLICASET), lbl.get(L.POD_TEMPLATE_HASH)
    if rs and template_hash and rs.name.endswith(f"-{template_hash}") and len(rs.name) > len(template_hash) + 1:
        job_id = rs.name if L.is_label_value(rs.name) else L.dns_name(rs.name)
        return JobRef(ns, job_id, "Deployment", {L.JOB: job_id},
                      workload=f"Deployment/{rs.name[:-len(template_hash) - 1]}")
    sts, revision = _controller_owner(pod, _STATEFULSET), lbl.get(L.CONTROLLER_REVISION_HASH)
    if sts and revision:
        raw = revision if revision.startswith(f"{sts.name}-") else f"{sts.name}-{revision}"
        job_id = raw if L.is_label_value(raw) else L.dns_name(raw)
        return JobRef(ns, job_id, "StatefulSet", {L.JOB: job_id}, workload=f"StatefulSet/{sts.name}")
    return None


def attempt_of_pod(pod: Mapping[str, Any]) -> int:
    """`gpulens.dev/attempt`, else JobSet's restart counter, else 0. Malformed values count as 0."""
    lbl = _meta(pod).get("labels") or {}
    for key in (L.ATTEMPT, L.JOBSET_RESTART):
        value = str(lbl.get(key, "")).strip()
        if value.isdigit():
            return int(value)
    return 0


def local_world_size_of_pod(pod: Mapping[str, Any]) -> int | None:
    value = str((_meta(pod).get("annotations") or {}).get(L.LOCAL_WORLD_SIZE, "")).strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def world_size_of_pod(pod: Mapping[str, Any]) -> int | None:
    value = str((_meta(pod).get("annotations") or {}).get(L.WORLD_SIZE, "")).strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def is_armed(pod: Mapping[str, Any]) -> bool:
    return (_meta(pod).get("labels") or {}).get(L.ARMED) == "true"


def is_live(pod: Mapping[str, Any]) -> bool:
    """Still part of a running attempt: not finished and not being deleted."""
    if _meta(pod).get("deletionTimestamp"):
        return False
    return (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
