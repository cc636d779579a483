"""Find the dcgm-exporter on this node, with no URL given, and follow it when it restarts or moves.

dcgm-exporter runs in one of two well-known shapes (reference: scale-2026.md §C): the GPU
Operator's DaemonSet (pods labelled `app=nvidia-dcgm-exporter`) and the standalone chart's
(`app.kubernetes.io/name=dcgm-exporter`); both name the container port `metrics`. One label
selector cannot say "either", so each label set gets its own list + watch (a PodIndex) with the
field selector `spec.nodeName=<node>`, in all namespaces or in each named one (what RBAC grants).
A pod is a target when it is Ready, not terminating, and has a `metrics` port; its address is
`status.podIP`, or `status.hostIP` when it runs on the host network. The watches keep the choice
current, so a restarted or rescheduled pod is followed within one DCGM poll.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .health import DISABLED, FAILING, OK, WAITING
from .kube import PodIndex, _get

__all__ = ["LABEL_SETS", "DcgmEndpoint", "Finding", "DcgmFinder", "endpoint_of_pod"]

#: label selectors, in order of preference when a node runs both
LABEL_SETS: tuple[str, ...] = ("app=nvidia-dcgm-exporter", "app.kubernetes.io/name=dcgm-exporter")
PORT_NAME = "metrics"


@dataclass(frozen=True)
class DcgmEndpoint:
    """One dcgm-exporter pod as seen in the API; `url` is None when it has no `metrics` port or address."""
    uid: str
    namespace: str
    name: str
    node: str
    labels: tuple[tuple[str, str], ...]
    ready: bool
    host_network: bool
    url: str | None

    def matches(self, selector: str) -> bool:
        key, _, value = selector.partition("=")
        return (key, value) in self.labels

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class Finding:
    """What discovery says now: a URL to scrape, or why there is none (state: health word)."""
    url: str | None
    state: str
    reason: str


def _url(ip: object, port: object) -> str | None:
    if not ip or not isinstance(port, int) or not 0 < port < 65536:
        return None
    host = f"[{ip}]" if ":" in str(ip) else str(ip)
    return f"http://{host}:{port}/metrics"


def _metrics_port(spec: Any) -> int | None:
    for c in _get(spec, "containers", "containers") or []:
        for p in _get(c, "ports", "ports") or []:
            if _get(p, "name", "name") == PORT_NAME:
                port = _get(p, "container_port", "containerPort")
                return port if isinstance(port, int) else None
    return None


def _ready(status: Any) -> bool:
    for cond in _get(status, "conditions", "conditions") or []:
        if _get(cond, "type", "type") == "Ready":
            return _get(cond, "status", "status") == "True"
    return False


def endpoint_of_pod(pod: Any) -> DcgmEndpoint | None:
    """DcgmEndpoint from a V1Pod or a raw dict; None without a uid."""
    meta, spec, status = _get(pod, "metadata", "metadata"), _get(pod, "spec", "spec"), _get(pod, "status", "status")
    uid = _get(meta, "uid", "uid")
    if not uid:
        return None
    labels = _get(meta, "labels", "labels") or {}
    labels = tuple(sorted((str(k), str(v)) for k, v in labels.items())) if isinstance(labels, dict) else ()
    host_network = bool(_get(spec, "host_network", "hostNetwork"))
    ip = _get(status, "host_ip", "hostIP") if host_network else _get(status, "pod_ip", "podIP")
    terminating = _get(meta, "deletion_timestamp", "deletionTimestamp") is not None
    return DcgmEndpoint(uid=str(uid), namespace=str(_get(meta, "namespace", "namespace") or ""),
                        name=str(_get(meta, "name", "name") or ""),
                        node=str(_get(spec, "node_name", "nodeName") or ""), labels=labels,
                        ready=_ready(status) and not terminating, host_network=host_network,
                        url=_url(ip, _metrics_port(spec)))


class DcgmFinder:
    """One PodIndex per (namespace scope, label set); `find()` picks the target from all of them."""

    def __init__(self, api_client_factory: Callable[[], Any], node: str, *, namespaces: Sequence[str] = (),
                 label_sets: Sequence[str] = LABEL_SETS, index_factory: Callable[..., PodIndex] = PodIndex,
                 **index_kwargs: Any):
        self.node = node
        self.namespaces = tuple(namespaces)
        self.label_sets = tuple(label_sets)
        scopes: tuple[str | None, ...] = self.namespaces or (None,)
        self._indexes = [(selector, index_factory(api_client_factory, node, namespace=ns, label_selector=selector,
                                                  parse=endpoint_of_pod, **index_kwargs))
                         for selector in self.label_sets for ns in scopes]

    def start(self) -> None:
        for _, idx in self._indexes:
            idx.start()

    def request_stop(self) -> None:
        for _, idx in self._indexes:
            idx.request_stop()

    def stop(self) -> None:
        self.request_stop()          # all at once: each thread may be waiting on its watch stream
        for _, idx in self._indexes:
            idx.stop()

    @property
    def errors(self) -> int:
        return sum(idx.errors for _, idx in self._indexes)

    def _where(self) -> str:
        labels = " or ".join(self.label_sets)
        scope = f"namespaces {', '.join(self.namespaces)}" if self.namespaces else "all namespaces"
        return f"labels {labels}, {scope}"

    def find(self) -> Finding:
        seen: dict[str, tuple[int, DcgmEndpoint]] = {}
        for rank, (selector, idx) in enumerate(self._indexes):
            for ep in idx.values():
                # the index keeps only this node's pods; the labels are checked again here, so an
                # API server (or double) that ignores the selector cannot slip another pod in
                if ep.node == self.node and ep.matches(selector) and ep.uid not in seen:
                    seen[ep.uid] = (rank, ep)
        usable = sorted(((rank, ep.namespace, ep.name), ep) for rank, ep in seen.values() if ep.ready and ep.url)
        if usable:
            ep = usable[0][1]
            via = "host network, status.hostIP" if ep.host_network else "status.podIP"
            return Finding(ep.url, OK, f"found {ep.ref} on {self.node} ({via})")
        errors = [idx.last_error for _, idx in self._indexes if idx.last_error]
        if errors:
            return Finding(None, FAILING, f"finding dcgm-exporter: Kubernetes API: {errors[0]}")
        if not all(idx.synced.is_set() for _, idx in self._indexes):
            return Finding(None, WAITING, f"looking for a dcgm-exporter pod on {self.node}")
        if seen:
            ep = min((e for _, e in seen.values()), key=lambda e: (e.namespace, e.name))
            why = "not ready" if not ep.ready else f"has no container port named {PORT_NAME!r} or no address"
            return Finding(None, WAITING, f"dcgm-exporter pod {ep.ref} on {self.node} {why}")
        return Finding(None, DISABLED, f"no dcgm-exporter pod on {self.node} ({self._where()}); "
                                       "set --dcgm-url if it runs otherwise")
