"""The attempt of a plain batch Job's pod, read from its Job when the pod is admitted.

A batch Job replaces a failed pod with a new pod of the same template: without a number of its
own the replacement would be attempt 0 again, join the old attempt's coordinator and mix its
ranks with the dead pod's. JobSet says its restarts in a label, PyTorchJob restarts in place;
a plain Job says them only in its status, so the webhook counts the Job's failures at admission:
the replacement of the first failed pod is attempt 1, of the second 2, and so on.

The count is the larger of the Job's `status.failed` (plus failures not yet folded into it,
`status.uncountedTerminatedPods.failed`) and the Job's pods in phase Failed: the Job controller
of Kubernetes 1.20 (the cluster tests') creates the replacement in the same sync that counts the
failure and writes the status only afterwards, so at admission only the failed pod itself shows
it; a controller that writes the count first, or pods deleted since, show in the status.

A Job of a fixed-size world (`completions` == `parallelism` = N > 1: a multi-node torchrun, one
pod per node) restarts whole: one pod lost (its node gone, its process killed) breaks the others'
collectives, every pod fails and each is replaced, N replacements for one restart. Numbered one
failure each, the replacements of one restart would be attempts 1 and 2, each with a coordinator
of its own over half a world; so such a Job's attempt counts its failures N at a time (rounded up).
"""

from __future__ import annotations

from typing import Any, Mapping

from ..wire import labels as L
from .jobs import OwnerRef, job_of_pod
from .kube import KubeApi

__all__ = ["batch_job_of_pod", "failures_of", "pods_per_attempt", "JobAttempts"]


def batch_job_of_pod(pod: Mapping[str, Any]) -> OwnerRef | None:
    """The controlling batch/v1 Job of a pod whose attempt nothing else says, else None.

    None for a pod with `gpulens.dev/attempt` (set by hand: it wins), for JobSet pods (their
    restart label counts) and for pods no Job controls.
    """
    meta = pod.get("metadata") or {}
    lbl = meta.get("labels") or {}
    if L.ATTEMPT in lbl or L.JOBSET_RESTART in lbl or L.JOBSET_NAME in lbl:
        return None
    for ref in meta.get("ownerReferences") or []:
        if (ref.get("apiVersion"), ref.get("kind")) == ("batch/v1", "Job") and ref.get("controller") \
                and ref.get("name") and ref.get("uid"):
            return OwnerRef("batch/v1", "Job", ref["name"], ref["uid"])
    return None


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def pods_per_attempt(job: Mapping[str, Any]) -> int:
    """N for a Job of a fixed-size world (completions == parallelism = N > 1), else 1 (module docstring)."""
    spec = job.get("spec") or {}
    n = _count(spec.get("parallelism"))
    return n if n > 1 and _count(spec.get("completions")) == n else 1


def failures_of(job: Mapping[str, Any], failed_pods: int) -> int:
    """How many of the Job's pods have failed: the status's count or the failed pods seen, the larger."""
    status = job.get("status") or {}
    uncounted = (status.get("uncountedTerminatedPods") or {}).get("failed") or []
    counted = _count(status.get("failed")) + (len(uncounted) if isinstance(uncounted, list) else 0)
    return max(counted, failed_pods)


class JobAttempts:
    """Reads a pod's owner Job (one GET, one filtered LIST) to number the pod's attempt.

    `attempt_of` raises KubeError when the API does not answer within `timeout_s`; the webhook
    then arms the pod as attempt 0 (a pod is never held or refused for this).
    """

    def __init__(self, api: KubeApi, timeout_s: float = 2.0):
        self.api = api
        self.timeout_s = timeout_s

    def attempt_of(self, pod: Mapping[str, Any], namespace: str) -> int | None:
        """The attempt for `pod`, or None when the batch Job rule does not apply to it."""
        owner = batch_job_of_pod(pod)
        if owner is None:
            return None
        job = self.api.get_job(namespace, owner.name, timeout_s=self.timeout_s)
        if job is None or (job.get("metadata") or {}).get("uid") != owner.uid:
            return 0                                        # gone (or a namesake): nothing failed before
        ref = job_of_pod(pod, namespace)
        selector = ",".join(f"{k}={v}" for k, v in (ref.selector if ref else {}).items()) \
            or f"{L.LEGACY_JOB_NAME}={owner.name}"
        pods = self.api.list_pods(namespace, selector, field_selector="status.phase=Failed",
                                  timeout_s=self.timeout_s)
        failed = sum(1 for p in pods if (p.get("status") or {}).get("phase") == "Failed"
                     and any(r.get("uid") == owner.uid for r in (p.get("metadata") or {}).get("ownerReferences") or []))
        return -(-failures_of(job, failed) // pods_per_attempt(job))     # rounded up
