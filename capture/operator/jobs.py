"""Which training job (and attempt) a pod belongs to: pure functions over pod dicts.

The webhook and the operator both call `job_of_pod`, so the job id a trainer writes into its
registration record (GPULENS_JOB_ID) is the same id the operator groups pods by and names the
coordinator after. Precedence: an explicit `gpulens.dev/job` label, then PyTorchJob, JobSet and
Job, recognised by the labels and owner references their controllers set.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from . import labels as L

__all__ = ["OwnerRef", "JobRef", "job_of_pod", "attempt_of_pod", "is_armed", "is_live", "local_world_size_of_pod",
           "world_size_of_pod"]

_PYTORCHJOB = ("kubeflow.org/v1", "PyTorchJob")
_JOBSET = ("jobset.x-k8s.io/v1alpha2", "JobSet")
_JOB = ("batch/v1", "Job")


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
    kind: str                                   # Label, PyTorchJob, JobSet or Job
    selector: Mapping[str, str] = field(default_factory=dict)   # labels every pod of the job carries
    owner: OwnerRef | None = None

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
