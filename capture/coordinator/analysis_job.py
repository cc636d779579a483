"""Run `gpulens analyze MANIFEST_URI` as a Kubernetes Job once a capture has converged.

Why a Job and not a child process (analysis_runner.py, `--analysis local`): HTA and pandas need
gigabytes and minutes of CPU, which must not count against the coordinator Pod (it serves the
capture hot path), and an analysis must outlive a coordinator restart. So the coordinator only
creates the Job, waits for it (bounded) and reads its outcome; Kubernetes runs, limits, bounds
(`activeDeadlineSeconds`) and garbage-collects (`ttlSecondsAfterFinished`, and the ownerReference
to the CaptureCoordinator) it.

The Job's name is a pure function of (job, attempt, capture id), so a restarted coordinator that
analyses the same capture finds the Job already there (409 on create) and waits for that one
instead of starting a second. The outcome means what the child process's does (exit codes of
`gpulens analyze`): 0 -> done, 3 -> done with a reason (the report says nothing was analysed),
2 -> failed "refused the manifest", anything else -> failed. The exit code comes from the Job's pod
(its terminated container state); the container's termination message (the kubelet fills it from
the log tail on error, `FallbackToLogsOnError`) gives the failure's last line, so no `pods/log`
access is needed. The report URI is the deterministic `<capture prefix>/analysis/report.html` that
`gpulens analyze` writes without `--out` (gpulens.capture.archive REPORT_KEY): the pod's log interleaves
stderr after the URI line (exit 3), needs one more RBAC verb, and is gone once the pod is collected.

The API is reached with the same `kubernetes` client (in-cluster ServiceAccount token and CA)
that Kubernetes discovery uses, calls run in a thread; nothing here blocks the event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from gpulens.capture.archive import REPORT_KEY
from gpulens.ground.logs import get_logger

__all__ = ["AnalysisJobRunner", "AnalysisJobSpec", "OwnerRef", "analysis_job", "analysis_job_name", "report_uri_of",
           "CONTAINER", "DEADLINE_GRACE_S", "REPORT_KEY"]

log = get_logger("coordinator")

CONTAINER = "analyze"
TMP_MOUNT = "/tmp"
# Kubernetes's own deadline is the backstop (a coordinator that is gone): it comes later than the
# coordinator's, which still sees the pod and can say why it never finished. With equal deadlines
# the Job controller deleted the pod first (seen on the 1.20.2 cluster: "no pod was created").
DEADLINE_GRACE_S = 60
_MEANING = {2: "refused the manifest", 3: "nothing could be analysed"}
_PERMANENT = {401, 403, 404, 422}        # retrying the same call cannot help
_LABEL_VALUE = re.compile(r"\A(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?\Z")


@dataclass(frozen=True)
class OwnerRef:
    """The CaptureCoordinator this coordinator serves: deleting it deletes its analysis Jobs."""
    name: str
    uid: str
    api_version: str = "gpulens.dev/v1alpha1"
    kind: str = "CaptureCoordinator"


@dataclass(frozen=True)
class AnalysisJobSpec:
    """Everything about the Job that does not depend on the capture (from `gpulens coordinator` flags)."""
    namespace: str
    image: str
    job_id: str
    attempt: int
    s3_endpoint: str | None = None
    image_pull_policy: str = "IfNotPresent"
    image_pull_secrets: tuple[str, ...] = ()
    service_account: str | None = None
    env_from_secret: str | None = None
    resources: Mapping[str, Any] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    owner: OwnerRef | None = None
    timeout_s: float = 1800.0
    ttl_s: int = 3600
    #: file:// archive (one node): its host folder, mounted at the same path; the Job then runs as
    #: uid 0 (no capabilities), the owner of what the node agent wrote there.
    host_archive_dir: str | None = None
    #: a Dask scheduler (the chart's dask.enabled): the Job is then only the driver (submits ranks,
    #: reduces their summaries); the ranks are analysed on that cluster's workers.
    scheduler: str | None = None


def _dns(text: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")


def analysis_job_name(job_id: str, attempt: int, capture_id: str) -> str:
    """`gpulens-analysis-<capture id>-<hash>`: a DNS-1123 label (<= 63), the same on every call.

    The hash of (job, attempt, capture id) keeps two jobs in one namespace apart even when their
    capture ids are equal (a caller may choose the id), and a name that had to be cut still unique.
    """
    digest = hashlib.sha256(f"{job_id}\0{attempt}\0{capture_id}".encode()).hexdigest()[:8]
    stem = f"gpulens-analysis-{_dns(capture_id)}"[: 63 - 9].rstrip("-")
    return f"{stem}-{digest}"


def label_value(text: str) -> str:
    if len(text) <= 63 and _LABEL_VALUE.fullmatch(text):
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:8]
    clean = re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-_.")
    return f"{clean[:54].rstrip('-_.')}-{digest}".lstrip("-")


def report_uri_of(manifest_uri: str) -> str:
    """Where `gpulens analyze` (no --out) writes the report: beside the manifest, under analysis/."""
    head, _, _name = manifest_uri.rpartition("/")
    return f"{head}/{REPORT_KEY}"


def analysis_job(spec: AnalysisJobSpec, manifest_uri: str, capture_id: str) -> dict[str, Any]:
    """The batch/v1 Job for one capture (pure)."""
    name = analysis_job_name(spec.job_id, spec.attempt, capture_id)
    args = ["analyze", manifest_uri]
    if spec.s3_endpoint:
        args += ["--s3-endpoint", spec.s3_endpoint]
    if spec.scheduler:
        args += ["--scheduler", spec.scheduler]
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["gpulens"],
        "args": args,
        "env": [{"name": "HOME", "value": TMP_MOUNT}],   # read-only root: libraries that cache under ~ write here
        "volumeMounts": [{"name": "tmp", "mountPath": TMP_MOUNT}],
        "terminationMessagePolicy": "FallbackToLogsOnError",   # the failure's last line, without pods/log
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
    }
    if spec.resources:
        container["resources"] = json.loads(json.dumps(dict(spec.resources)))
    if spec.env_from_secret:
        container["envFrom"] = [{"secretRef": {"name": spec.env_from_secret}}]
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,   # the analysis never talks to the Kubernetes API
        "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532, "fsGroup": 65532,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": [{"name": "tmp", "emptyDir": {}}],   # traces are copied here: no sizeLimit guess
    }
    if spec.host_archive_dir:
        container["volumeMounts"].append({"name": "archive", "mountPath": spec.host_archive_dir})
        pod_spec["volumes"].append({"name": "archive",
                                    "hostPath": {"path": spec.host_archive_dir, "type": "DirectoryOrCreate"}})
        pod_spec["securityContext"].update(runAsNonRoot=False, runAsUser=0, runAsGroup=0)
    if spec.service_account:
        pod_spec["serviceAccountName"] = spec.service_account   # the coordinator's: same archive identity
    if spec.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in spec.image_pull_secrets]
    labels = {**spec.labels, "app.kubernetes.io/component": "analysis",
              "gpulens.dev/capture-id": label_value(capture_id)}
    # `gpulens.dev/armed: "false"` and `gpulens.dev/arm: "false"`: the arming webhook never sees the
    # pod (its objectSelector) and the operator's watch treats it like a coordinator Pod, never a rank.
    pod_labels = {**labels, "gpulens.dev/armed": "false", "gpulens.dev/arm": "false"}
    meta: dict[str, Any] = {"name": name, "namespace": spec.namespace, "labels": labels,
                            "annotations": {"gpulens.dev/capture-id": capture_id,
                                            "gpulens.dev/manifest-uri": manifest_uri}}
    if spec.owner:
        meta["ownerReferences"] = [{"apiVersion": spec.owner.api_version, "kind": spec.owner.kind,
                                    "name": spec.owner.name, "uid": spec.owner.uid,
                                    "controller": False, "blockOwnerDeletion": False}]
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta,
            "spec": {"backoffLimit": 0, "ttlSecondsAfterFinished": spec.ttl_s,
                     "activeDeadlineSeconds": max(1, int(spec.timeout_s)) + DEADLINE_GRACE_S,
                     "template": {"metadata": {"labels": pod_labels,
                                               "annotations": {"gpulens.dev/capture-id": capture_id}},
                                  "spec": pod_spec}}}


class _ApiFailed(Exception):
    def __init__(self, action: str, status: int | None, detail: str):
        super().__init__(f"{action}: HTTP {status} {detail}".strip() if status else f"{action}: {detail}")
        self.status = status


def _api_error(action: str, exc: Exception) -> _ApiFailed:
    status = getattr(exc, "status", None)
    detail = getattr(exc, "reason", None) or str(exc) or type(exc).__name__
    body = getattr(exc, "body", None)
    try:
        message = json.loads(body).get("message") if body else None
    except (ValueError, AttributeError):
        message = None
    if message:
        detail = f"{detail}: {message}"
    return _ApiFailed(action, status, str(detail)[:300])


def _finished(job: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The Job's Complete or Failed condition once it is true, else None."""
    for c in (job.get("status") or {}).get("conditions") or []:
        if c.get("type") in ("Complete", "Failed") and c.get("status") == "True":
            return c
    return None


def _terminated(pod: Mapping[str, Any]) -> Mapping[str, Any] | None:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        if cs.get("name") == CONTAINER:
            state = (cs.get("state") or {}).get("terminated") or (cs.get("lastState") or {}).get("terminated")
            if state and isinstance(state.get("exitCode"), int):
                return state
    return None


def _pod_hint(pods: list[Mapping[str, Any]]) -> str:
    """Why a pod has not finished, in a few words (unschedulable, image pull, still running)."""
    if not pods:
        return "no pod was created"
    pod = pods[-1]
    name, status = (pod.get("metadata") or {}).get("name", "?"), pod.get("status") or {}
    for c in status.get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False":
            return f"pod {name} not scheduled: {c.get('reason', '')} {c.get('message', '')}".strip()
    for cs in status.get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting")
        if waiting:
            return f"pod {name} waiting: {waiting.get('reason', '')} {waiting.get('message', '')}".strip()
    return f"pod {name} {status.get('phase', 'Unknown')}"


class AnalysisJobRunner:
    """`run(manifest_uri, capture_id)` like AnalysisRunner's, with the work done by a Job."""

    def __init__(self, api_client, spec: AnalysisJobSpec, *, poll_interval_s: float = 2.0,
                 request_timeout_s: float = 15.0):
        self.api_client, self.spec = api_client, spec
        self.poll_interval_s, self.request_timeout_s = poll_interval_s, request_timeout_s
        self._one_at_a_time = asyncio.Semaphore(1)

    # --- the API calls (synchronous client, run in a thread) ---------------------------------
    def _call(self, action: str, fn, *args, **kw) -> Any:
        from kubernetes.client.exceptions import ApiException
        try:
            raw = fn(*args, _preload_content=False, _request_timeout=self.request_timeout_s, **kw)
            return json.loads(raw.data) if raw.data else {}
        except ApiException as exc:
            raise _api_error(action, exc) from None
        except Exception as exc:  # urllib3 raises many types for network faults
            raise _api_error(action, exc) from None

    async def _api(self, action: str, fn, *args, **kw) -> Any:
        return await asyncio.to_thread(self._call, action, fn, *args, **kw)

    def _batch(self):
        from kubernetes import client
        return client.BatchV1Api(self.api_client)

    def _core(self):
        from kubernetes import client
        return client.CoreV1Api(self.api_client)

    async def _pods(self, job: Mapping[str, Any]) -> list[dict[str, Any]]:
        match = ((job.get("spec") or {}).get("selector") or {}).get("matchLabels") or \
            {"batch.kubernetes.io/job-name": job["metadata"]["name"]}
        selector = ",".join(f"{k}={v}" for k, v in sorted(match.items()))
        out = await self._api(f"list pods of Job {job['metadata']['name']}", self._core().list_namespaced_pod,
                              self.spec.namespace, label_selector=selector)
        items = list(out.get("items") or [])
        return sorted(items, key=lambda p: (p.get("metadata") or {}).get("creationTimestamp") or "")

    # --- the run -----------------------------------------------------------------------------
    async def run(self, manifest_uri: str, capture_id: str) -> dict[str, Any]:
        async with self._one_at_a_time:
            name = analysis_job_name(self.spec.job_id, self.spec.attempt, capture_id)
            log.info("analysis.started", capture_id=capture_id, job=name, manifest_uri=manifest_uri)
            try:
                result = await self._run(manifest_uri, capture_id, name)
            except _ApiFailed as exc:
                result = {"state": "failed", "reason": f"analysis Job {name}: {exc}", "job": name}
            log.info("analysis.finished", capture_id=capture_id, job=name, state=result["state"],
                     exit_code=result.get("exit_code"), reason=result.get("reason"))
            return result

    async def _run(self, manifest_uri: str, capture_id: str, name: str) -> dict[str, Any]:
        body = analysis_job(self.spec, manifest_uri, capture_id)
        try:
            await self._api(f"create Job {name}", self._batch().create_namespaced_job, self.spec.namespace, body)
            log.info("analysis.job_created", capture_id=capture_id, job=name, manifest_uri=manifest_uri)
        except _ApiFailed as exc:
            if exc.status != 409:
                raise
            log.info("analysis.job_found", capture_id=capture_id, job=name)   # a coordinator restart: same Job
        deadline = time.monotonic() + self.spec.timeout_s
        last_error: _ApiFailed | None = None
        while True:
            try:
                job = await self._api(f"get Job {name}", self._batch().read_namespaced_job, name, self.spec.namespace)
                condition = _finished(job)
                if condition is not None:
                    return await self._outcome(job, condition, manifest_uri, name)
                last_error = None
            except _ApiFailed as exc:
                if exc.status in _PERMANENT:
                    raise
                last_error = exc                     # 5xx, network: retried until the deadline
                log.warning("analysis.api_retry", capture_id=capture_id, job=name, error=str(exc))
            if time.monotonic() >= deadline:
                return await self._give_up(name, capture_id, last_error)
            await asyncio.sleep(min(self.poll_interval_s, max(0.0, deadline - time.monotonic())))

    async def _outcome(self, job: Mapping[str, Any], condition: Mapping[str, Any], manifest_uri: str,
                       name: str) -> dict[str, Any]:
        pods = await self._pods(job)
        state = next((s for s in map(_terminated, reversed(pods)) if s), None)
        if condition.get("reason") == "DeadlineExceeded":
            # Kubernetes stopped it at activeDeadlineSeconds: its exit code (137) would only say "killed"
            return {"state": "failed", "job": name,
                    "reason": f"analysis Job {name} ran longer than its deadline "
                              f"({job.get('spec', {}).get('activeDeadlineSeconds', '?')} s): DeadlineExceeded"}
        if state is None:
            why = f"{condition.get('reason', '')} {condition.get('message', '')}".strip() or condition["type"]
            return {"state": "failed", "job": name,
                    "reason": f"analysis Job {name} failed before gpulens analyze exited: {why} ({_pod_hint(pods)})"}
        code = state["exitCode"]
        if code in (0, 3):
            result = {"state": "done", "report_uri": report_uri_of(manifest_uri), "exit_code": code, "job": name}
            if code == 3:
                result["reason"] = _MEANING[3]
            return result
        meaning = _MEANING.get(code, f"exit code {code}")
        lines = str(state.get("message") or "").strip().splitlines()
        tail = lines[-1].strip()[-300:] if lines else ""
        return {"state": "failed", "reason": f"gpulens analyze {meaning}: {tail}".rstrip(": "), "exit_code": code,
                "job": name}

    async def _give_up(self, name: str, capture_id: str, last_error: _ApiFailed | None) -> dict[str, Any]:
        hint = str(last_error) if last_error else None
        if hint is None:
            try:
                job = await self._api(f"get Job {name}", self._batch().read_namespaced_job, name, self.spec.namespace)
                hint = _pod_hint(await self._pods(job))
            except _ApiFailed as exc:
                hint = str(exc)
        try:
            await self._api(f"delete Job {name}", self._batch().delete_namespaced_job, name, self.spec.namespace,
                            propagation_policy="Background")
            deleted = "deleted"
        except _ApiFailed as exc:
            deleted = "deleted already" if exc.status == 404 else f"not deleted ({exc})"
        log.warning("analysis.timeout", capture_id=capture_id, job=name, hint=hint, deleted=deleted)
        return {"state": "failed", "job": name,
                "reason": f"analysis Job {name} did not finish within {self.spec.timeout_s:.0f} s ({hint}); {deleted}"}
