"""This node's pods, by UID, kept current by list + watch on the Kubernetes API.

Only pods scheduled here matter, so the list and the watch carry the field selector
`spec.nodeName=<node>` (the API server filters; the index checks again, so a server that ignores
the selector cannot fill it with other nodes' pods). The official client is synchronous; the
loop runs in one thread and publishes an immutable dict, so readers never lock. Any failure
(API down, 410 Gone, a broken stream) is recorded and followed by a relist after a backoff.

Each pod also yields its job id (label `gpulens_job`), by the operator's own rule, so that alerts
name the job whose coordinator the gateway must call, and its workload (label `gpulens_workload`),
which the alert rules keep baselines for.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from gpulens.ground.logs import get_logger

__all__ = ["PodInfo", "PodIndex", "make_api_client", "pod_info", "job_of_pod", "workload_of_pod"]

log = get_logger("exporter")

# Pod label names as the operator uses them (capture/wire/labels.py: JOB, BATCH_JOB_NAME,
# LEGACY_JOB_NAME, JOBSET_NAME, PYTORCHJOB_NAME). Duplicated on purpose: exporter and capture never
# import each other; tests/exporter/test_kube.py checks that both agree.
JOB_LABEL = "gpulens.dev/job"
BATCH_JOB_NAME = "batch.kubernetes.io/job-name"
LEGACY_JOB_NAME = "job-name"
JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
PYTORCHJOB_NAME = "training.kubeflow.org/job-name"
# Set by the arming webhook on serving pods (issue 30): their gpulens.dev/job names the revision
# (which the gateway routes by), while the workload stays the Deployment/StatefulSet it always was.
SERVING_LABEL = "gpulens.dev/serving"
SERVING_KINDS = ("Deployment", "StatefulSet", "LeaderWorkerSet")
_PYTORCHJOB = ("kubeflow.org/v1", "PyTorchJob")
_BATCH_JOB = ("batch/v1", "Job")
_LABEL_VALUE = re.compile(r"\A(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?\Z")
# A Deployment's ReplicaSet is named <deployment>-<pod-template-hash>; the pods carry the hash.
POD_TEMPLATE_HASH = "pod-template-hash"
# The CronJob controller names each run's Job <cronjob>-<scheduled time in minutes since the epoch>.
_CRONJOB_RUN = re.compile(r"\A(?P<cronjob>.+)-\d{8,10}\Z")


@dataclass(frozen=True)
class PodInfo:
    uid: str
    namespace: str
    name: str
    node: str
    containers: Mapping[str, str] = field(default_factory=dict)   # container id (hex) -> name
    job: str = ""                                                  # job id, "" when the pod names none
    workload: str = ""                                             # label gpulens_workload (workload_of_pod)


def make_api_client(kubeconfig: str | None = None):
    """An ApiClient from a kubeconfig file, else the in-cluster service account."""
    from kubernetes import client, config

    if kubeconfig:
        cfg = client.Configuration()
        config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    else:
        config.load_incluster_config()
        cfg = client.Configuration.get_default_copy()
    return client.ApiClient(cfg)


def _get(obj: Any, attr: str, key: str):
    if obj is None:
        return None
    if isinstance(obj, dict):
        return obj.get(key)
    return getattr(obj, attr, None)


def _is_label_value(value: object) -> bool:
    return isinstance(value, str) and 0 < len(value) <= 63 and bool(_LABEL_VALUE.match(value))


def _owner_name(meta: Any, api_kind: tuple[str, str]) -> str | None:
    for ref in _get(meta, "owner_references", "ownerReferences") or []:
        if (_get(ref, "api_version", "apiVersion"), _get(ref, "kind", "kind")) == api_kind:
            name = _get(ref, "name", "name")
            if name:
                return str(name)
    return None


def job_of_pod(meta: Any) -> str:
    """The job id of a pod (from its metadata), in the operator's order (capture/operator/jobs.py
    `job_of_pod`), so the gateway finds the coordinator the operator made: the `gpulens.dev/job`
    label; a PyTorchJob owner; the JobSet name; the batch Job name (labels or owner); else the
    PyTorchJob name label; else "".
    """
    labels = _get(meta, "labels", "labels") or {}
    if not isinstance(labels, Mapping):
        labels = {}
    explicit = labels.get(JOB_LABEL)
    if _is_label_value(explicit):
        return explicit
    pytorchjob = _owner_name(meta, _PYTORCHJOB)
    if pytorchjob:
        return pytorchjob
    if labels.get(JOBSET_NAME):
        return str(labels[JOBSET_NAME])
    batch = labels.get(BATCH_JOB_NAME) or labels.get(LEGACY_JOB_NAME) or _owner_name(meta, _BATCH_JOB)
    if _is_label_value(batch):
        return batch
    fallback = labels.get(PYTORCHJOB_NAME)
    return fallback if _is_label_value(fallback) else ""


def _controller(meta: Any) -> tuple[str, str] | None:
    """(kind, name) of the pod's controlling owner (the reference with controller: true, else the first)."""
    refs = [r for r in (_get(meta, "owner_references", "ownerReferences") or [])
            if _get(r, "kind", "kind") and _get(r, "name", "name")]
    if not refs:
        return None
    ref = next((r for r in refs if _get(r, "controller", "controller")), refs[0])
    return str(_get(ref, "kind", "kind")), str(_get(ref, "name", "name"))


def workload_of_pod(meta: Any, job: str | None = None) -> str:
    """The workload a pod belongs to, which the alert baselines are kept for, so that a new pod of
    the same workload inherits its baseline: `job/<job id>` when the pod names a job (job_of_pod),
    except a CronJob's run, whose Job name changes every run (`CronJob/<name>`); else its
    controlling owner: `Deployment/<name>` for a ReplicaSet named `<deployment>-<pod-template-hash>`,
    else `<Kind>/<name>` (StatefulSet, DaemonSet, ReplicaSet, any custom resource); else
    `Pod/<pod name>` for an unowned pod. An armed serving pod (`gpulens.dev/serving`) names its
    revision as its job but keeps its owner's workload, so a rollout keeps the workload's baseline.
    """
    labels = _get(meta, "labels", "labels") or {}
    if not isinstance(labels, Mapping):
        labels = {}
    job = job_of_pod(meta) if job is None else job
    if job and labels.get(SERVING_LABEL) not in SERVING_KINDS:
        batch = labels.get(BATCH_JOB_NAME) or labels.get(LEGACY_JOB_NAME) or _owner_name(meta, _BATCH_JOB)
        explicit = _is_label_value(labels.get(JOB_LABEL)) or _owner_name(meta, _PYTORCHJOB) or labels.get(JOBSET_NAME)
        run = _CRONJOB_RUN.fullmatch(job)
        if job == batch and not explicit and run:
            return f"CronJob/{run.group('cronjob')}"
        return f"job/{job}"
    owner = _controller(meta)
    if owner is not None:
        kind, name = owner
        template_hash = labels.get(POD_TEMPLATE_HASH)
        if kind == "ReplicaSet" and template_hash and name.endswith(f"-{template_hash}") \
                and len(name) > len(template_hash) + 1:
            return f"Deployment/{name[:-len(template_hash) - 1]}"
        return f"{kind}/{name}"
    return f"Pod/{_get(meta, 'name', 'name') or ''}"


def pod_info(pod: Any) -> PodInfo | None:
    """PodInfo from a V1Pod or a raw dict; None if it lacks a uid."""
    meta, spec, status = _get(pod, "metadata", "metadata"), _get(pod, "spec", "spec"), _get(pod, "status", "status")
    uid = _get(meta, "uid", "uid")
    if not uid:
        return None
    containers: dict[str, str] = {}
    for attr, key in (("container_statuses", "containerStatuses"),
                      ("init_container_statuses", "initContainerStatuses"),
                      ("ephemeral_container_statuses", "ephemeralContainerStatuses")):
        for cs in _get(status, attr, key) or []:
            cid, name = _get(cs, "container_id", "containerID"), _get(cs, "name", "name")
            if cid and name:
                containers[str(cid).split("://", 1)[-1]] = str(name)
    job = job_of_pod(meta)
    return PodInfo(uid=str(uid), namespace=str(_get(meta, "namespace", "namespace") or ""),
                   name=str(_get(meta, "name", "name") or ""), node=str(_get(spec, "node_name", "nodeName") or ""),
                   containers=containers, job=job, workload=workload_of_pod(meta, job))


class PodIndex:
    """This node's pods by UID, as `parse` reads them (default: PodInfo). `namespace` narrows the
    list and watch to one namespace (RBAC may grant no more), `label_selector` to matching pods;
    a parsed value needs `.uid` and `.node`."""

    def __init__(self, api_client_factory: Callable[[], Any], node: str, *, watch_timeout_s: int = 300,
                 read_timeout_s: float | None = None, backoff_s: tuple[float, ...] = (1, 2, 5, 10, 30),
                 namespace: str | None = None, label_selector: str | None = None,
                 parse: Callable[[Any], Any] = pod_info):
        self._factory = api_client_factory
        self.node = node
        self.namespace = namespace
        self.label_selector = label_selector
        self._parse = parse
        self._watch_timeout = watch_timeout_s
        self._read_timeout = read_timeout_s if read_timeout_s is not None else watch_timeout_s + 30
        self._backoff = backoff_s
        self._pods: Mapping[str, Any] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.synced = threading.Event()     # set after the first successful list
        self.last_error: str | None = None
        self.errors = 0
        self.lists = 0
        self.events = 0

    def get(self, uid: str) -> PodInfo | None:
        return self._pods.get(uid)

    def __len__(self) -> int:
        return len(self._pods)

    def values(self) -> list:
        return list(self._pods.values())

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="gpulens-pod-watch", daemon=True)
            self._thread.start()

    def request_stop(self) -> None:
        """Ask the watch thread to end, without waiting (stop several indexes at once)."""
        self._stop.set()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _selector(self) -> str:
        return f"spec.nodeName={self.node}"

    def _query(self, v1) -> tuple[Callable[..., Any], dict[str, Any]]:
        """The list call and its arguments (the watch streams the same call)."""
        kwargs: dict[str, Any] = {"field_selector": self._selector()}
        if self.label_selector:
            kwargs["label_selector"] = self.label_selector
        if self.namespace:
            return v1.list_namespaced_pod, {"namespace": self.namespace, **kwargs}
        return v1.list_pod_for_all_namespaces, kwargs

    def _run(self) -> None:
        from kubernetes import client, watch
        from kubernetes.client.exceptions import ApiException

        failures = 0
        api_client = None
        while not self._stop.is_set():
            try:
                if api_client is None:
                    api_client = self._factory()
                v1 = client.CoreV1Api(api_client)
                call, query = self._query(v1)
                listing = call(**query, _request_timeout=self._read_timeout)
                pods = {}
                for pod in listing.items or []:
                    info = self._parse(pod)
                    if info and info.node == self.node:
                        pods[info.uid] = info
                self._pods = pods
                self.lists += 1
                self.synced.set()
                self.last_error = None
                failures = 0
                log.info("pods.listed", node=self.node, pods=len(pods), namespace=self.namespace or "*",
                         labels=self.label_selector or "")
                w = watch.Watch()
                stream = w.stream(call, **query, resource_version=listing.metadata.resource_version,
                                  timeout_seconds=self._watch_timeout, allow_watch_bookmarks=True,
                                  _request_timeout=self._read_timeout)
                for event in stream:
                    if self._stop.is_set():
                        w.stop()
                        break
                    if not self._apply(event):
                        w.stop()
                        break
            except ApiException as exc:
                if exc.status == 410:          # our resourceVersion is too old: relist at once
                    log.info("pods.relist", node=self.node, reason="410 Gone")
                    continue
                failures = self._failed(f"Kubernetes API answered {exc.status} {exc.reason}", failures)
            except Exception as exc:  # connection refused, timeouts, broken streams, bad JSON
                failures = self._failed(f"{type(exc).__name__}: {exc}", failures)
        if api_client is not None:
            try:
                api_client.close()
            except Exception:
                pass

    def _failed(self, message: str, failures: int) -> int:
        self.errors += 1
        self.last_error = message
        delay = self._backoff[min(failures, len(self._backoff) - 1)]
        log.warning("pods.watch_failed", node=self.node, error=message, retry_in_s=delay)
        self._stop.wait(delay)
        return failures + 1

    def _apply(self, event: dict | None) -> bool:
        """Apply one watch event; False means the watch must be restarted with a fresh list."""
        if not isinstance(event, dict):      # a line that was not JSON: skip it
            return True
        kind = event.get("type")
        if kind == "ERROR":
            raw = event.get("raw_object") or {}
            code = raw.get("code") if isinstance(raw, dict) else None
            self.last_error = f"watch error {code}: {raw.get('message') if isinstance(raw, dict) else raw}"
            return False
        if kind == "BOOKMARK":
            return True
        info = self._parse(event.get("object"))
        if info is None:
            return True
        self.events += 1
        pods = dict(self._pods)
        if kind == "DELETED" or info.node != self.node:
            pods.pop(info.uid, None)
        elif kind in ("ADDED", "MODIFIED"):
            pods[info.uid] = info
        self._pods = pods
        return True
