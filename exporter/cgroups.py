"""Pod UID and container ID from a process's /proc/<pid>/cgroup.

The forms differ by cgroup version, cgroup driver and runtime (reference: ebpf-gpu-signals.md §4):

    0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_>.slice/cri-containerd-<id>.scope
    0::/kubepods.slice/kubepods-pod<uid_>.slice/crio-<id>.scope                 (Guaranteed QoS, CRI-O)
    11:devices:/kubepods/besteffort/pod<uid>/<id>                               (cgroupfs driver, v1)
    0::/system.slice/containerd.service/kubepods-burstable-pod<uid_>.slice:cri-containerd:<id>
    0::/../../pod<32 hex>/<id>                                                  (private cgroup namespace)
    2:cpuacct,cpu:/system.slice/docker-<id>.scope   4:memory:/docker/<id>       (Docker, no Kubernetes)

In systemd slice names the pod UID's dashes are underscores; static pods have 32-hex UIDs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["CgroupIdentity", "parse_cgroup"]

_UUID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"
_POD = re.compile(r"pod(" + _UUID + r"|[0-9a-f]{32})(?=\.slice|/|:|$)")
_CONTAINER = re.compile(r"^(?:(cri-containerd|crio|docker|libpod|containerd)-)?([0-9a-f]{64})(?:\.scope)?$")
_CONTAINER_COLON = re.compile(r":(cri-containerd|crio|docker|containerd):([0-9a-f]{64})$")
_RUNTIME = {"cri-containerd": "containerd", "containerd": "containerd", "crio": "cri-o",
            "docker": "docker", "libpod": "podman"}


@dataclass(frozen=True)
class CgroupIdentity:
    path: str
    version: int                      # 2 for the unified hierarchy, 1 otherwise, 0 if unknown
    pod_uid: str | None = None        # with dashes, as the Kubernetes API spells it
    container_id: str | None = None   # 64 hex, without the runtime prefix
    runtime: str | None = None        # containerd | cri-o | docker | podman, when the path says


def _from_path(path: str, version: int) -> CgroupIdentity:
    pod = None
    m = _POD.search(path)
    if m:
        pod = m.group(1).replace("_", "-")
    container = runtime = None
    for part in reversed([p for p in path.split("/") if p]):
        m = _CONTAINER.match(part) or _CONTAINER_COLON.search(part)
        if m:
            container = m.group(2)
            runtime = _RUNTIME.get(m.group(1) or "")
            break
    if container and runtime is None:
        if "/docker/" in path:
            runtime = "docker"
        elif "/k8s.io/" in path:
            runtime = "containerd"
    return CgroupIdentity(path=path, version=version, pod_uid=pod, container_id=container, runtime=runtime)


def parse_cgroup(text: str) -> CgroupIdentity:
    """Parse /proc/<pid>/cgroup; prefers the unified (v2) line, else the v1 line naming a container."""
    v2: CgroupIdentity | None = None
    v1: list[CgroupIdentity] = []
    for line in text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2 = _from_path(path, 2)
        else:
            v1.append(_from_path(path, 1))
    for ident in ([v2] if v2 else []) + v1:
        if ident.pod_uid or ident.container_id:
            return ident
    if v2:
        return v2
    return v1[0] if v1 else CgroupIdentity(path="", version=0)
