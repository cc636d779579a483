"""Pure builders for everything the operator creates for one (job, attempt).

Owner references are the garbage-collection story: the CaptureCoordinator is owned by the job
object (Job, JobSet, PyTorchJob), and the coordinator's Pod, ServiceAccount, RoleBinding and
Secrets are owned by the CaptureCoordinator, so deleting the job removes all of it even while the
operator is down. The per-job Service is owned by the *current* attempt's CaptureCoordinator and
is handed over on an attempt bump, so the gateway's URL for a job never changes.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Mapping

from gpulens.capture.archive.paths import host_dir

from ..wire import labels as L
from .config import OperatorConfig
from .jobs import JobRef

__all__ = ["TOKENS_MOUNT", "analysis_job_args", "coordinator_resource", "coordinator_pod", "coordinator_service",
           "coordinator_service_account", "coordinator_role_binding", "copied_secret", "children_of",
           "endpoint_of", "owner_reference_to", "label_value"]

TOKENS_MOUNT = "/var/run/gpulens/tokens"
STATE_DIR = "/var/lib/gpulens/coordinator"
TOKEN_KEYS = ("agent", "coordinator", "grafana")


def label_value(text: str) -> str:
    return text if L.is_label_value(text) else L.dns_name(text)


def _labels(job_id: str, attempt: int | None, cc_name: str | None) -> dict[str, str]:
    out = {L.APP_NAME: "gpulens", L.COMPONENT: "coordinator", L.MANAGED_BY: L.MANAGER, L.JOB: label_value(job_id)}
    if attempt is not None:
        out[L.ATTEMPT] = str(attempt)
    if cc_name is not None:
        out[L.COORDINATOR_OF] = cc_name
    return out


def owner_reference_to(cc: Mapping[str, Any], controller: bool = True) -> dict[str, Any]:
    meta = cc["metadata"]
    return {"apiVersion": L.API_VERSION, "kind": L.KIND, "name": meta["name"], "uid": meta["uid"],
            "controller": controller, "blockOwnerDeletion": False}


def coordinator_resource(job: JobRef, attempt: int, pods: Iterable[Mapping[str, Any]],
                         config: OperatorConfig) -> dict[str, Any]:
    """The CaptureCoordinator for (job, attempt), built from the job's armed pods."""
    from .jobs import local_world_size_of_pod, world_size_of_pod  # local: keeps the import graph flat

    pods = list(pods)
    lws = next((v for v in map(local_world_size_of_pod, pods) if v), 1)
    ws = next((v for v in map(world_size_of_pod, pods) if v), None)
    c = config.coordinator
    selector = {**job.selector, L.ARMED: "true"}
    if any(L.ATTEMPT in ((p.get("metadata") or {}).get("labels") or {}) for p in pods):
        selector[L.ATTEMPT] = str(attempt)
    spec: dict[str, Any] = {
        "jobId": job.job_id,
        "attempt": attempt,
        "job": {"groupedBy": job.kind, "name": job.job_id},
        "selector": {"matchLabels": selector},
        "localWorldSize": lws,
        "archive": {"root": c.archive_root},
    }
    if job.owner:
        spec["job"]["owner"] = {"apiVersion": job.owner.api_version, "kind": job.owner.kind, "name": job.owner.name}
        if job.owner.uid:
            spec["job"]["owner"]["uid"] = job.owner.uid
    if ws:
        spec["worldSize"] = ws
    if c.s3_endpoint:
        spec["archive"]["s3Endpoint"] = c.s3_endpoint
    if c.archive_secret:
        spec["archive"]["secretName"] = c.archive_secret
    if c.grafana_url:
        spec["grafana"] = {"url": c.grafana_url}
    if c.capture_defaults:
        spec["captureDefaults"] = {k: v for k, v in (("durationMs", c.capture_defaults.get("duration_ms")),
                                                     ("activities", c.capture_defaults.get("activities"))) if v}
    name = L.coordinator_name(job.job_id, attempt)
    meta: dict[str, Any] = {"name": name, "namespace": job.namespace, "labels": _labels(job.job_id, attempt, None)}
    if job.owner and job.owner.uid:
        meta["ownerReferences"] = [job.owner.to_owner_reference()]
    return {"apiVersion": L.API_VERSION, "kind": L.KIND, "metadata": meta, "spec": spec}


def _selector_string(match_labels: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(match_labels.items()))


def coordinator_args(cc: Mapping[str, Any], config: OperatorConfig) -> list[str]:
    """The `gpulens coordinator` command line (docs/ARCHITECTURE.md, "Command-line contract")."""
    spec, meta, c = cc["spec"], cc["metadata"], config.coordinator
    args = ["gpulens", "coordinator",
            "--listen", f"0.0.0.0:{c.port}",
            "--job", spec["jobId"],
            "--attempt", str(spec["attempt"]),
            "--namespace", meta["namespace"],
            "--discovery", "kubernetes",
            "--selector", _selector_string(spec["selector"]["matchLabels"]),
            "--agent-url-template", c.agent_url_template,
            "--archive-root", spec["archive"]["root"],
            "--token-file", f"{TOKENS_MOUNT}/coordinator",
            "--agent-token-file", f"{TOKENS_MOUNT}/agent",
            "--analysis", c.analysis,
            "--budget-mb", str(c.budget_mb),
            "--start-lead-s", f"{c.start_lead_s:g}",
            "--wall-start-lead-s", f"{c.wall_start_lead_s:g}",
            "--state-dir", STATE_DIR]
    if spec["archive"].get("s3Endpoint"):
        args += ["--s3-endpoint", spec["archive"]["s3Endpoint"]]
    if (spec.get("grafana") or {}).get("url"):
        args += ["--grafana-url", spec["grafana"]["url"], "--grafana-token-file", f"{TOKENS_MOUNT}/grafana"]
    if (spec.get("job") or {}).get("groupedBy") in L.SERVING_KINDS:
        args += ["--serving"]   # replicas, not ranks of one world: each pod's workers are its own ranks
    if c.analysis == "job":
        args += analysis_job_args(cc, config)
    return args


def analysis_job_args(cc: Mapping[str, Any], config: OperatorConfig) -> list[str]:
    """What `gpulens coordinator --analysis job` needs to create its analysis Jobs.

    The Job runs the operator's image as the coordinator's ServiceAccount (the same archive
    identity, e.g. an IAM role annotation) with the same archive Secret, is owned by the
    CaptureCoordinator (`--coordinator-name/-uid`: deleting it deletes its Jobs) and carries the
    job's labels but not `gpulens.dev/coordinator`, which the job's Service selects on.
    """
    spec, meta, c = cc["spec"], cc["metadata"], config.coordinator
    names = _names(cc)
    args = ["--analysis-image", config.image, "--analysis-image-pull-policy", config.image_pull_policy,
            "--analysis-service-account", names["sa"],
            "--analysis-timeout-s", f"{c.analysis_timeout_s:g}", "--analysis-ttl-s", str(c.analysis_ttl_s)]
    for secret in config.image_pull_secrets:
        args += ["--analysis-image-pull-secret", secret]
    if spec["archive"].get("secretName"):
        args += ["--analysis-env-from-secret", names["archive"]]
    if c.analysis_scheduler:
        args += ["--analysis-scheduler", c.analysis_scheduler]
    if c.analysis_resources:
        args += ["--analysis-resources", json.dumps(dict(c.analysis_resources), sort_keys=True, separators=(",", ":"))]
    labels = _labels(spec["jobId"], spec["attempt"], None)
    labels.pop(L.COMPONENT)                      # the runner sets `analysis`
    for key, value in sorted(labels.items()):
        args += ["--analysis-label", f"{key}={value}"]
    if meta.get("uid"):
        args += ["--coordinator-name", meta["name"], "--coordinator-uid", meta["uid"]]
    return args


def _names(cc: Mapping[str, Any]) -> dict[str, str]:
    name = cc["metadata"]["name"]
    return {"pod": name, "sa": name, "rolebinding": name,
            "tokens": L.dns_name(name, "tokens", max_len=253), "archive": L.dns_name(name, "archive", max_len=253)}


def coordinator_pod(cc: Mapping[str, Any], config: OperatorConfig) -> dict[str, Any]:
    spec, meta, c = cc["spec"], cc["metadata"], config.coordinator
    names = _names(cc)
    container: dict[str, Any] = {
        "name": "coordinator",
        "image": config.image,
        "imagePullPolicy": config.image_pull_policy,
        "command": ["gpulens"],
        "args": coordinator_args(cc, config)[1:],
        "ports": [{"name": "http", "containerPort": c.port, "protocol": "TCP"}],
        "readinessProbe": {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 20,
                          "failureThreshold": 6},
        "volumeMounts": [{"name": "tokens", "mountPath": TOKENS_MOUNT, "readOnly": True},
                         {"name": "state", "mountPath": STATE_DIR},
                         {"name": "tmp", "mountPath": "/tmp"}],
        "env": [{"name": "GPULENS_NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                {"name": "HOME", "value": "/tmp"}],   # read-only root: libraries that cache under ~ write here
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
    }
    if c.resources:
        container["resources"] = dict(c.resources)
    if spec["archive"].get("secretName"):
        container["envFrom"] = [{"secretRef": {"name": names["archive"]}}]
    pod_spec: dict[str, Any] = {
        "serviceAccountName": names["sa"],
        "restartPolicy": "Always",
        "enableServiceLinks": False,
        "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532, "fsGroup": 65532,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
        "volumes": [{"name": "tokens", "secret": {"secretName": names["tokens"], "defaultMode": 0o440}},
                    {"name": "state", "emptyDir": {}},
                    {"name": "tmp", "emptyDir": {}}],
    }
    if config.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": n} for n in config.image_pull_secrets]
    archive_dir = host_dir(spec["archive"]["root"])
    if archive_dir:
        # file:// (one node): the host folder the node agent writes, at the same path. The agent
        # runs as root and owns the folders it makes there, so the coordinator, which writes the
        # manifest into them, runs as uid 0 too (still no capabilities, no escalation).
        container["volumeMounts"].append({"name": "archive", "mountPath": archive_dir})
        pod_spec["volumes"].append({"name": "archive", "hostPath": {"path": archive_dir, "type": "DirectoryOrCreate"}})
        pod_spec["securityContext"].update(runAsNonRoot=False, runAsUser=0, runAsGroup=0)
    if c.node_selector:
        pod_spec["nodeSelector"] = dict(c.node_selector)
    if c.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in c.tolerations]
    if c.priority_class_name:
        pod_spec["priorityClassName"] = c.priority_class_name
    # `gpulens.dev/armed: "false"`: the operator watches pods with a server-side selector on that
    # label's existence, so it sees armed trainers and its own coordinators and no other pod.
    pod_labels = {**_labels(spec["jobId"], spec["attempt"], meta["name"]), L.ARMED: "false"}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": names["pod"], "namespace": meta["namespace"],
                         "labels": pod_labels,
                         "ownerReferences": [owner_reference_to(cc)]},
            "spec": pod_spec}


def coordinator_service(cc: Mapping[str, Any], config: OperatorConfig) -> dict[str, Any]:
    """The job's stable Service, pointing at this attempt's coordinator Pod."""
    spec, meta = cc["spec"], cc["metadata"]
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": L.service_name(spec["jobId"]), "namespace": meta["namespace"],
                         "labels": _labels(spec["jobId"], None, None),
                         "ownerReferences": [owner_reference_to(cc, controller=False)]},
            "spec": {"type": "ClusterIP", "selector": {L.COORDINATOR_OF: meta["name"]},
                     "ports": [{"name": "http", "port": config.coordinator.port, "targetPort": "http",
                                "protocol": "TCP"}]}}


def coordinator_service_account(cc: Mapping[str, Any], config: OperatorConfig) -> dict[str, Any]:
    spec, meta = cc["spec"], cc["metadata"]
    out: dict[str, Any] = {"apiVersion": "v1", "kind": "ServiceAccount",
                           "metadata": {"name": _names(cc)["sa"], "namespace": meta["namespace"],
                                        "labels": _labels(spec["jobId"], spec["attempt"], meta["name"]),
                                        "ownerReferences": [owner_reference_to(cc)]}}
    if config.coordinator.service_account_annotations:
        out["metadata"]["annotations"] = dict(config.coordinator.service_account_annotations)
    return out


def coordinator_role_binding(cc: Mapping[str, Any], config: OperatorConfig) -> dict[str, Any]:
    """Binds the chart's read-only ClusterRole in the job's namespace only (least privilege)."""
    spec, meta = cc["spec"], cc["metadata"]
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": {"name": _names(cc)["rolebinding"], "namespace": meta["namespace"],
                         "labels": _labels(spec["jobId"], spec["attempt"], meta["name"]),
                         "ownerReferences": [owner_reference_to(cc)]},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": config.coordinator.cluster_role},
            "subjects": [{"kind": "ServiceAccount", "name": _names(cc)["sa"], "namespace": meta["namespace"]}]}


def copied_secret(cc: Mapping[str, Any], which: str, data: Mapping[str, str]) -> dict[str, Any]:
    """A copy of a Secret from the operator's namespace next to the coordinator (Secrets are namespaced)."""
    spec, meta = cc["spec"], cc["metadata"]
    if which == "tokens":
        data = {k: v for k, v in data.items() if k in TOKEN_KEYS}
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": _names(cc)[which], "namespace": meta["namespace"],
                         "labels": _labels(spec["jobId"], spec["attempt"], meta["name"]),
                         "ownerReferences": [owner_reference_to(cc)]},
            "data": dict(data)}


def children_of(cc: Mapping[str, Any]) -> dict[str, str]:
    """Names of the objects a CaptureCoordinator owns, by kind."""
    return _names(cc)


def endpoint_of(cc: Mapping[str, Any], config: OperatorConfig) -> str:
    meta = cc["metadata"]
    return f"http://{L.service_name(cc['spec']['jobId'])}.{meta['namespace']}.svc:{config.coordinator.port}"
