"""What should exist, given what does: pure functions from observed objects to a plan.

The operator is level-triggered: every pod event and every periodic resync recomputes the whole
plan for the affected jobs from the current objects, so a missed event, a restart or a second
replica never leaves anything behind. These functions do no I/O, which is what the tests pin down:
exactly one coordinator per live (job, attempt), the newest attempt wins, a gone job has none.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from ..wire import labels as L
from .config import OperatorConfig
from .jobs import JobRef, attempt_of_pod, is_armed, is_live, job_of_pod
from .manifests import coordinator_resource, endpoint_of

__all__ = ["JobPlan", "group_pods", "plan_job", "coordinators_by_job", "coordinator_status", "summarize_captures"]

JobKey = tuple[str, str]   # (namespace, job id)


@dataclass(frozen=True)
class JobPlan:
    key: JobKey
    job: JobRef | None
    create: dict[str, Any] | None = None                 # a CaptureCoordinator body
    keep: str | None = None                              # the name that should exist afterwards
    delete: tuple[str, ...] = ()                         # CaptureCoordinator names to delete
    reason: str = ""

    @property
    def is_noop(self) -> bool:
        return self.create is None and not self.delete


@dataclass
class _Group:
    job: JobRef | None = None
    pods: list[Mapping[str, Any]] = field(default_factory=list)


def group_pods(pods: Iterable[Mapping[str, Any]]) -> dict[JobKey, tuple[JobRef, list[Mapping[str, Any]]]]:
    """Armed pods by job. Pods that are not armed, or belong to no recognisable job, are dropped."""
    groups: dict[JobKey, _Group] = defaultdict(_Group)
    for pod in pods:
        if not is_armed(pod):
            continue
        job = job_of_pod(pod)
        if job is None:
            continue
        g = groups[job.key]
        if g.job is None or (g.job.owner is None and job.owner is not None) or (
                g.job.owner is not None and not g.job.owner.uid and job.owner is not None and job.owner.uid):
            g.job = job   # prefer the most complete owner information any pod of the job carries
        g.pods.append(pod)
    return {k: (g.job, g.pods) for k, g in groups.items() if g.job is not None}


def _cc_key(cc: Mapping[str, Any]) -> JobKey:
    return (cc["metadata"].get("namespace", ""), (cc.get("spec") or {}).get("jobId", ""))


def plan_job(key: JobKey, job: JobRef | None, pods: list[Mapping[str, Any]],
             coordinators: list[Mapping[str, Any]], owner_exists: bool | None,
             config: OperatorConfig) -> JobPlan:
    """The plan for one job.

    `owner_exists` is False when the job object (Job, JobSet, PyTorchJob) is known to be gone,
    None when there is no owner to ask about. Coordinators already being deleted are ignored.
    """
    present = [cc for cc in coordinators if not cc["metadata"].get("deletionTimestamp")]
    names = sorted(cc["metadata"]["name"] for cc in present)
    live = [p for p in pods if is_live(p)]
    if owner_exists is False or job is None or not live:
        why = "job gone" if owner_exists is False else "no live armed pods"
        return JobPlan(key, job, delete=tuple(names), reason=why)
    current = max(attempt_of_pod(p) for p in live)
    want = L.coordinator_name(job.job_id, current)
    stale = tuple(n for n in names if n != want)
    if want in names:
        return JobPlan(key, job, keep=want, delete=stale, reason="newer attempt" if stale else "up to date")
    body = coordinator_resource(job, current, [p for p in live if attempt_of_pod(p) == current], config)
    return JobPlan(key, job, create=body, keep=want, delete=stale,
                   reason="new attempt" if stale else "new job")


def coordinators_by_job(coordinators: Iterable[Mapping[str, Any]]) -> dict[JobKey, list[Mapping[str, Any]]]:
    by_job: dict[JobKey, list[Mapping[str, Any]]] = defaultdict(list)
    for cc in coordinators:
        by_job[_cc_key(cc)].append(cc)
    return dict(by_job)


def _ready(pod: Mapping[str, Any]) -> bool:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return cond.get("status") == "True"
    return False


def coordinator_status(cc: Mapping[str, Any], pod: Mapping[str, Any] | None, config: OperatorConfig,
                       now: float | None = None) -> dict[str, Any]:
    """The CaptureCoordinator's status from its Pod; `conditions` keep their transition times."""
    if pod is None:
        phase, ready, reason = "Pending", False, "PodMissing"
    elif (pod.get("metadata") or {}).get("deletionTimestamp"):
        phase, ready, reason = "Terminating", False, "PodTerminating"
    elif (pod.get("status") or {}).get("phase") == "Failed":
        phase, ready, reason = "Failed", False, "PodFailed"
    elif _ready(pod):
        phase, ready, reason = "Ready", True, "PodReady"
    else:
        phase, ready, reason = "Starting", False, "PodNotReady"
    old = {c.get("type"): c for c in ((cc.get("status") or {}).get("conditions") or [])}
    status = "True" if ready else "False"
    prev = old.get("Ready")
    stamp = (prev or {}).get("lastTransitionTime") if prev and prev.get("status") == status else \
        time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() if now is None else now))
    return {
        "phase": phase,
        "endpoint": endpoint_of(cc, config),
        # None, not "": the status goes out as a JSON merge patch, where null removes the field,
        # and Kubernetes 1.20 stores a merge-patched "" as null, which the CRD's string schema
        # refuses (422: every status update of a coordinator whose Pod was gone failed).
        "podName": (pod or {}).get("metadata", {}).get("name") or None,
        "observedGeneration": cc["metadata"].get("generation", 0),
        "conditions": [{"type": "Ready", "status": status, "reason": reason,
                        "message": f"coordinator pod {phase.lower()}", "lastTransitionTime": stamp}],
    }


def summarize_captures(listing: Mapping[str, Any], limit: int = 5) -> list[dict[str, Any]]:
    """The newest `limit` captures of a coordinator's `GET /v1/captures` answer, for the CR status.

    Unknown or malformed entries are skipped: the status is informative, never a contract.
    """
    out = []
    for item in listing.get("captures") or []:
        if not isinstance(item, Mapping) or not isinstance(item.get("capture_id"), str):
            continue
        entry = {"captureId": item["capture_id"], "phase": str(item.get("phase", "unknown"))}
        if isinstance(item.get("fully_succeeded"), bool):
            entry["fullySucceeded"] = item["fully_succeeded"]
        if isinstance(item.get("manifest_uri"), str):
            entry["manifestUri"] = item["manifest_uri"]
        out.append(entry)
    out.sort(key=lambda e: e["captureId"], reverse=True)   # capture ids sort by creation time
    return out[:limit]
