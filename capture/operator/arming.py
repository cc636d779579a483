"""What arming a trainer pod means, as one pure function: pod in, JSON Patch out.

The mutating webhook applies it; docs/kubernetes.md shows the same additions as a snippet for
people who arm by hand, and a test checks the two agree. Arming adds the trainer hook (copied by
an init container into an emptyDir on PYTHONPATH), its environment (job id and attempt through
the downward API from the pod's own labels, so the snippet needs them written only once), the
hostPath registry/trace/socket folders the node agent shares, and the labels the operator groups
by. It never removes or overrides anything the pod already sets (except prefixing PYTHONPATH);
a PYTHONPATH the trainer's image sets is read by an init container of that image and put back
after the hook's folder by the hook itself (`image_env_container`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..wire import labels as L
from .config import ArmingConfig
from .jobs import attempt_of_pod, job_of_pod, serving_of_pod
from .launcher import local_world_size

__all__ = ["HOOK_VOLUME", "IMAGE_ENV_CONTAINER", "IMAGE_ENV_DIR", "INIT_CONTAINER", "ArmingResult", "arm_pod",
           "armed_pod", "image_env_container"]

HOOK_VOLUME = "gpulens-hook"
INIT_CONTAINER = "gpulens-hook"
IMAGE_ENV_CONTAINER = "gpulens-image-env"     # + "-<n>": one per armed container whose PYTHONPATH the image sets
IMAGE_ENV_DIR = "image-env"                   # <hook>/image-env/<container>/PYTHONPATH (hooks/site/_gpulens_imagepath.py)
BUSYBOX = ".bin/busybox"                      # <hook>/.bin/busybox: a static shell for the image-env container
_VOLUMES = ("registry", "traces", "sockets")


@dataclass(frozen=True)
class ArmingResult:
    patch: list[dict[str, Any]] = field(default_factory=list)   # RFC 6902 operations; empty: leave the pod alone
    reason: str = ""
    warnings: tuple[str, ...] = ()
    job_id: str | None = None


def _host_dirs(cfg: ArmingConfig) -> dict[str, str]:
    return {"registry": cfg.registry_dir, "traces": cfg.trace_dir, "sockets": cfg.socket_dir}


def hook_env(container_name: str, cfg: ArmingConfig) -> list[dict[str, Any]]:
    """The trainer hook's environment (docs/ARCHITECTURE.md, "The trainer hook")."""
    def field_ref(path: str) -> dict[str, Any]:
        return {"valueFrom": {"fieldRef": {"fieldPath": path}}}

    return [
        {"name": "GPULENS_JOB_ID", **field_ref(f"metadata.labels['{L.JOB}']")},
        {"name": "GPULENS_ATTEMPT", **field_ref(f"metadata.labels['{L.ATTEMPT}']")},
        {"name": "GPULENS_REGISTRY_DIR", "value": cfg.registry_dir},
        {"name": "GPULENS_TRACE_DIR", "value": cfg.trace_dir},
        {"name": "GPULENS_SOCKET_DIR", "value": cfg.socket_dir},
        {"name": "GPULENS_POD_NAME", **field_ref("metadata.name")},
        {"name": "GPULENS_NAMESPACE", **field_ref("metadata.namespace")},
        {"name": "GPULENS_POD_UID", **field_ref("metadata.uid")},
        {"name": "GPULENS_NODE_NAME", **field_ref("spec.nodeName")},
        {"name": "GPULENS_CONTAINER_NAME", "value": container_name},
    ]


def hook_volumes(cfg: ArmingConfig) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"name": HOOK_VOLUME, "emptyDir": {}}]
    for key, path in _host_dirs(cfg).items():
        out.append({"name": f"gpulens-{key}", "hostPath": {"path": path, "type": "DirectoryOrCreate"}})
    return out


def hook_mounts(cfg: ArmingConfig) -> list[dict[str, Any]]:
    """Host folders are mounted at the same paths as in the agent: trace paths then mean the same on both sides."""
    out: list[dict[str, Any]] = [{"name": HOOK_VOLUME, "mountPath": cfg.hook_mount_path, "readOnly": True}]
    for key, path in _host_dirs(cfg).items():
        out.append({"name": f"gpulens-{key}", "mountPath": path})
    return out


def init_container(cfg: ArmingConfig, image: str) -> dict[str, Any]:
    return {
        "name": INIT_CONTAINER,
        "image": image,
        "command": ["sh", "-c", (f'cp -R "$(gpulens hook-path)/." {cfg.hook_mount_path}/ && '
                                 f'mkdir -p {cfg.hook_mount_path}/.bin && '
                                 f'cp "$(command -v busybox)" {cfg.hook_mount_path}/{BUSYBOX}')],
        "volumeMounts": [{"name": HOOK_VOLUME, "mountPath": cfg.hook_mount_path}],
        "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "128Mi"}},
        "securityContext": {"runAsNonRoot": True, "runAsUser": 65534, "allowPrivilegeEscalation": False,
                            "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}},
    }


def image_env_container(cfg: ArmingConfig, container: Mapping[str, Any], n: int) -> dict[str, Any]:
    """An init container of the trainer's own image that writes the `PYTHONPATH` that image's
    `ENV` (or the container's `envFrom`) gives, for the hook to put back on sys.path after its own
    folder: the pod's `PYTHONPATH`, which arming must set to load the hook, replaces the image's
    (Kubernetes lets a container's `env` win over its image's), and a trainer importing from a
    folder only its image names would break. It runs the static busybox the hook container copied
    (`sh` need not exist in the image), as nobody, without the image's entrypoint."""
    out_dir = f"{cfg.hook_mount_path}/{IMAGE_ENV_DIR}/{container.get('name', '')}"
    c: dict[str, Any] = {
        "name": f"{IMAGE_ENV_CONTAINER}-{n}",
        "image": container.get("image"),
        "command": [f"{cfg.hook_mount_path}/{BUSYBOX}", "sh", "-c",
                    f'mkdir -p "{out_dir}" && printf %s "${{PYTHONPATH-}}" > "{out_dir}/PYTHONPATH"'],
        "volumeMounts": [{"name": HOOK_VOLUME, "mountPath": cfg.hook_mount_path}],
        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}},
        "securityContext": {"runAsNonRoot": True, "runAsUser": 65534, "allowPrivilegeEscalation": False,
                            "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}},
    }
    for key in ("imagePullPolicy", "envFrom"):
        if container.get(key):
            c[key] = copy.deepcopy(container[key])
    return c


def _gpu_count(container: Mapping[str, Any]) -> int | None:
    limits = (container.get("resources") or {}).get("limits") or {}
    value = str(limits.get("nvidia.com/gpu", "")).strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def _arm_container(container: dict[str, Any], cfg: ArmingConfig, warnings: list[str]) -> None:
    env = container.setdefault("env", [])
    names = {e.get("name") for e in env}
    py = next((e for e in env if e.get("name") == "PYTHONPATH"), None)
    if py is None:
        env.append({"name": "PYTHONPATH", "value": cfg.hook_mount_path})
    elif "valueFrom" in py:
        warnings.append(f"container {container.get('name')}: PYTHONPATH comes from valueFrom; "
                        f"add {cfg.hook_mount_path} to it yourself or the hook will not load")
    elif cfg.hook_mount_path not in str(py.get("value", "")).split(":"):
        py["value"] = f"{cfg.hook_mount_path}:{py['value']}" if py.get("value") else cfg.hook_mount_path
    env.extend(e for e in hook_env(container.get("name", ""), cfg) if e["name"] not in names)
    mounts = container.setdefault("volumeMounts", [])
    taken = {m.get("mountPath") for m in mounts}
    for m in hook_mounts(cfg):
        if m["mountPath"] in taken:
            warnings.append(f"container {container.get('name')}: {m['mountPath']} is already mounted; kept yours")
        else:
            mounts.append(m)


def armed_pod(pod: Mapping[str, Any], namespace: str, cfg: ArmingConfig, image: str,
              attempt: int | None = None, serving: bool = False) -> tuple[dict[str, Any] | None, ArmingResult]:
    """The armed copy of `pod` (None when it is left alone) and the reason, warnings and job id.

    `attempt` is the number the webhook read from the pod's batch Job (job_attempts.py); a
    `gpulens.dev/attempt` label on the pod still wins, and without either the pod's own labels
    decide (`jobs.attempt_of_pod`).

    A serving pod (Deployment, StatefulSet, LeaderWorkerSet: `jobs.serving_of_pod`) is armed when
    its namespace opted in to serving (`serving`, the webhook's serving entry) or its workload did
    (`gpulens.dev/arm=true` on the pod template); it gets its revision's job id and
    `gpulens.dev/serving=<Kind>`.
    """
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    spec = pod.get("spec") or {}
    if labels.get(L.ARM_OPT_OUT) == "false":
        return None, ArmingResult(reason="opted out")
    if labels.get(L.MANAGED_BY) == L.MANAGER:
        # Our own coordinator Pods carry the job label (to be found by job) and live in the job's
        # namespace: armed, they would count as one more rank of the job they serve.
        return None, ArmingResult(reason="a gpulens pod")
    if any(v.get("name") == HOOK_VOLUME for v in spec.get("volumes") or []):
        return None, ArmingResult(reason="already armed")
    job = job_of_pod(pod, namespace)
    if job is None:
        job = serving_of_pod(pod, namespace)
        if job is not None and not (serving or labels.get(L.ARM_OPT_OUT) == L.ARM_OPT_IN):
            return None, ArmingResult(reason=f"a {job.kind} pod, and neither its namespace ({L.NAMESPACE_SERVING}="
                                             f"enabled) nor its workload ({L.ARM_OPT_OUT}=true) opted in to serving",
                                      job_id=job.job_id)
    if job is None:
        return None, ArmingResult(reason="not part of a job")
    containers = spec.get("containers") or []
    if not containers:
        return None, ArmingResult(reason="no containers")
    wanted = [n.strip() for n in str((meta.get("annotations") or {}).get(L.CONTAINERS, "")).split(",") if n.strip()]
    warnings: list[str] = []
    known = {c.get("name") for c in containers}
    for name in wanted:
        if name not in known:
            warnings.append(f"{L.CONTAINERS}: no container named {name!r}")
    targets = [n for n in wanted if n in known] if wanted else [containers[0].get("name")]
    if not targets:
        return None, ArmingResult(reason="no container to arm", warnings=tuple(warnings), job_id=job.job_id)

    out = copy.deepcopy(dict(pod))
    m = out.setdefault("metadata", {})
    lbl = m.setdefault("labels", {})
    lbl[L.ARMED] = "true"
    lbl.setdefault(L.JOB, job.job_id if L.is_label_value(job.job_id) else L.dns_name(job.job_id))
    if job.serving:
        lbl[L.SERVING] = job.kind
    lbl.setdefault(L.ATTEMPT, str(attempt_of_pod(pod) if attempt is None else attempt))
    ann = m.setdefault("annotations", {})
    if L.LOCAL_WORLD_SIZE not in ann:
        # Only a number the pod's launch states; unknown: not written (the coordinator then
        # counts the workers' registration records).
        first = next(c for c in containers if c.get("name") == targets[0])
        lws = local_world_size(first, _gpu_count(first))
        if lws is not None:
            ann[L.LOCAL_WORLD_SIZE] = str(lws)
    s = out.setdefault("spec", {})
    have = {v.get("name") for v in s.get("volumes") or []}
    s["volumes"] = list(s.get("volumes") or []) + [v for v in hook_volumes(cfg) if v["name"] not in have]
    inits = [init_container(cfg, image)]
    for c in s["containers"]:
        if c.get("name") in targets:
            if not any(e.get("name") == "PYTHONPATH" for e in c.get("env") or []):
                inits.append(image_env_container(cfg, c, len(inits)))
            _arm_container(c, cfg, warnings)
    s["initContainers"] = list(s.get("initContainers") or []) + inits
    return out, ArmingResult(reason="armed", warnings=tuple(warnings), job_id=job.job_id)


def arm_pod(pod: Mapping[str, Any], namespace: str, cfg: ArmingConfig, image: str,
            attempt: int | None = None, serving: bool = False) -> ArmingResult:
    """The JSON Patch that arms `pod` (empty when it must be left alone).

    Whole members are replaced with `add` (which also creates absent ones), so the patch applies
    cleanly whatever other webhooks did before us.
    """
    new, result = armed_pod(pod, namespace, cfg, image, attempt, serving)
    if new is None:
        return result
    ops: list[dict[str, Any]] = []
    if "metadata" not in pod:
        ops.append({"op": "add", "path": "/metadata", "value": {}})
    for key in ("labels", "annotations"):
        ops.append({"op": "add", "path": f"/metadata/{key}", "value": new["metadata"][key]})
    for key in ("volumes", "initContainers", "containers"):
        ops.append({"op": "add", "path": f"/spec/{key}", "value": new["spec"][key]})
    return ArmingResult(patch=ops, reason=result.reason, warnings=result.warnings, job_id=result.job_id)
