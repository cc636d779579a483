"""Pod discovery for Debian's Prometheus, which has none: an HTTP SD endpoint backed by the API.

Debian builds Prometheus without its Kubernetes discovery ("Kubernetes support has been completely
removed", NEWS.Debian, 1.5.0+ds-1; `kubernetes_sd_configs` is an unknown field to its 2.42). This
stands in for `kubernetes_sd_configs: [{role: pod}]`: on each refresh Prometheus GETs
`/v1/pods?namespace=NS` (its `http_sd_configs`, the real client), and this lists that namespace's
pods from the API as Prometheus's ServiceAccount (read-only RBAC, the same token a
`kubernetes_sd_configs` would use) and answers target groups carrying exactly the labels the
upstream pod role sets (discovery/kubernetes/pod.go): one target per container port at
`<podIP>:<port>`, one per port-less container at `<podIP>`, `__meta_kubernetes_namespace`,
`__meta_kubernetes_pod_*`. So the relabelling a user writes for `kubernetes_sd_configs` runs
unchanged on these targets (cluster/monitoring.py renders both forms).

An API failure answers 502 (Prometheus then keeps the targets it had); bad input answers 400.

    python cluster/pod_sd.py --listen 127.0.0.1:9095 --api-server https://10.244.0.1:6443 \\
        --token-file TOKEN --ca-file CA
"""

from __future__ import annotations

import argparse
import asyncio
import re
import ssl
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

if __package__ in (None, ""):                  # run as a script: the repository's packages
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpulens.ground.logs import get_logger, setup_logging  # noqa: E402

__all__ = ["ApiSource", "target_groups", "make_app", "main"]

log = get_logger("pod-sd")
#: A namespace name as the API accepts it (RFC 1123 label).
_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def _sanitize(name: str) -> str:
    """Prometheus's strutil.SanitizeLabelName: anything but [a-zA-Z0-9_] becomes _."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def _ready(pod: dict) -> str:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return str(cond.get("status", "Unknown")).lower()
    return "unknown"


def _pod_labels(pod: dict) -> dict[str, str]:
    meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    ls = {
        "__meta_kubernetes_namespace": meta.get("namespace", ""),
        "__meta_kubernetes_pod_name": meta.get("name", ""),
        "__meta_kubernetes_pod_ip": status.get("podIP", ""),
        "__meta_kubernetes_pod_ready": _ready(pod),
        "__meta_kubernetes_pod_phase": status.get("phase", ""),
        "__meta_kubernetes_pod_node_name": spec.get("nodeName", ""),
        "__meta_kubernetes_pod_host_ip": status.get("hostIP", ""),
        "__meta_kubernetes_pod_uid": meta.get("uid", ""),
    }
    owner = next((o for o in meta.get("ownerReferences") or [] if o.get("controller")), None)
    if owner:
        if owner.get("kind"):
            ls["__meta_kubernetes_pod_controller_kind"] = owner["kind"]
        if owner.get("name"):
            ls["__meta_kubernetes_pod_controller_name"] = owner["name"]
    for prefix, values in (("label", meta.get("labels")), ("annotation", meta.get("annotations"))):
        for k, v in (values or {}).items():
            ls[f"__meta_kubernetes_pod_{prefix}_{_sanitize(k)}"] = v
            ls[f"__meta_kubernetes_pod_{prefix}present_{_sanitize(k)}"] = "true"
    return ls


def target_groups(pods: dict) -> list[dict[str, Any]]:
    """HTTP SD target groups for a PodList, one group per container target (HTTP SD has no
    per-target labels, so each upstream target becomes its own group with the pod's labels)."""
    groups = []
    for pod in pods.get("items") or []:
        ip = (pod.get("status") or {}).get("podIP")
        if not ip:                          # starting or evicted: upstream emits no targets either
            continue
        base = _pod_labels(pod)
        for init, key in ((False, "containers"), (True, "initContainers")):
            for c in (pod.get("spec") or {}).get(key) or []:
                cl = {**base, "__meta_kubernetes_pod_container_name": c.get("name", ""),
                      "__meta_kubernetes_pod_container_image": c.get("image", ""),
                      "__meta_kubernetes_pod_container_init": str(init).lower()}
                ports = c.get("ports") or []
                if not ports:
                    groups.append({"targets": [ip], "labels": cl})
                for p in ports:
                    number = str(p.get("containerPort", ""))
                    groups.append({"targets": [f"{ip}:{number}"], "labels": {
                        **cl, "__meta_kubernetes_pod_container_port_name": p.get("name", ""),
                        "__meta_kubernetes_pod_container_port_number": number,
                        "__meta_kubernetes_pod_container_port_protocol": p.get("protocol", "TCP")}})
    return groups


class ApiError(Exception):
    def __init__(self, status: int, detail: str):
        super().__init__(f"API answered {status}: {detail[:300]}")
        self.status = status


@dataclass
class ApiSource:
    """Lists pods as the ServiceAccount (its token re-read each time: tokens rotate)."""

    server: str
    token_file: Path
    ca_file: Path
    session: aiohttp.ClientSession | None = None

    async def pods(self, namespace: str) -> dict:
        assert self.session is not None
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        headers = {"Authorization": f"Bearer {self.token_file.read_text().strip()}"}
        async with self.session.get(f"{self.server}/api/v1/namespaces/{namespace}/pods", headers=headers,
                                    ssl=ctx) as r:
            if r.status != 200:
                raise ApiError(r.status, await r.text())
            return await r.json()


SOURCE = web.AppKey("source", ApiSource)


async def get_pods(request: web.Request) -> web.Response:
    namespace = request.query.get("namespace", "")
    if not _NAMESPACE.match(namespace):
        return web.json_response({"error": "?namespace= must be one namespace name", "field": "namespace"}, status=400)
    try:
        pods = await request.app[SOURCE].pods(namespace)
    except (ApiError, aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
        log.warning("sd.api_failed", namespace=namespace, error=str(exc))
        return web.json_response({"error": str(exc)}, status=502)
    groups = target_groups(pods)
    log.debug("sd.answered", namespace=namespace, targets=len(groups))
    return web.json_response(groups)


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def make_app(source: ApiSource) -> web.Application:
    app = web.Application()
    app[SOURCE] = source

    async def session(app: web.Application):
        source.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        yield
        await source.session.close()
    app.cleanup_ctx.append(session)
    app.router.add_get("/v1/pods", get_pods)
    app.router.add_get("/healthz", healthz)
    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cluster/pod_sd.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--listen", default="127.0.0.1:9095")
    p.add_argument("--api-server", default="https://10.244.0.1:6443")
    p.add_argument("--token-file", type=Path, required=True)
    p.add_argument("--ca-file", type=Path, required=True)
    a = p.parse_args(argv)
    setup_logging()
    host, _, port = a.listen.rpartition(":")
    log.info("sd.ready", listen=a.listen, api_server=a.api_server)
    web.run_app(make_app(ApiSource(a.api_server, a.token_file, a.ca_file)), host=host, port=int(port),
                print=None, handle_signals=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
