"""Which coordinator serves a (namespace, job): static routes, a routes file, or a URL template.

The routes file is what `gpulens up`'s local operator writes: `{"routes": {"ns/job": URL},
"pods": {"ns/pod": "ns/job"}}`, re-read when it changes. The template (in a cluster) is formatted
with `{namespace}`, `{job}` and `{service}` (the job's Service name as the operator makes it:
lower-cased, hashed when it had to change). An alert without a job label is routed by its pod
through the routes file's pod map; with a template alone it cannot be, and says so.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Route", "Router", "Unroutable", "parse_route", "SERVING_KINDS", "serving_kind", "deployment_revision"]

#: Workload kinds (the exporter's `gpulens_workload="<Kind>/<name>"`) whose pods are replicas:
#: captures take the alerted pod and peers, in wall-clock windows (capture/wire/labels.py).
SERVING_KINDS = ("Deployment", "StatefulSet", "LeaderWorkerSet")


class Unroutable(Exception):
    """No coordinator is known for what the request or alert names."""


@dataclass(frozen=True)
class Route:
    namespace: str
    job_id: str
    url: str

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.job_id}"


def parse_route(text: str) -> tuple[str, str]:
    """`NAMESPACE/JOB=URL` -> ("NAMESPACE/JOB", URL)."""
    name, sep, url = text.partition("=")
    ns, slash, job = name.partition("/")
    if not sep or not slash or not ns or not job or not url.startswith(("http://", "https://")):
        raise ValueError(f"a route is NAMESPACE/JOB=http(s)://HOST:PORT, not {text!r}")
    return f"{ns}/{job}", url.rstrip("/")


def serving_kind(workload: str | None) -> str | None:
    """`Deployment` for `Deployment/web` (a serving workload), else None (a training job, a bare pod)."""
    kind, slash, name = (workload or "").partition("/")
    return kind if slash and name and kind in SERVING_KINDS else None


def deployment_revision(workload: str | None, pod: str | None) -> str | None:
    """The revision job id of a Deployment's pod, from names alone: the ReplicaSet controller names
    pods `<deployment>-<pod-template-hash>-<5 characters>`, and the operator names the revision's
    job after the ReplicaSet (`<deployment>-<pod-template-hash>`). None when the names do not say it."""
    kind, _, name = (workload or "").partition("/")
    if kind != "Deployment" or not name or not pod or not pod.startswith(f"{name}-"):
        return None
    rs, dash, suffix = pod.rpartition("-")
    template_hash = rs[len(name) + 1:]
    if not dash or not suffix or not template_hash or "-" in template_hash or not template_hash.isalnum():
        return None
    return rs


def _service_name(job: str) -> str:
    from gpulens.capture.wire.labels import service_name  # the operator's naming rule, byte for byte
    return service_name(job)


@dataclass
class Router:
    static: dict[str, str] = field(default_factory=dict)
    routes_file: Path | None = None
    template: str | None = None
    _stamp: tuple[int, int] | None = field(default=None, repr=False)
    _file_routes: dict[str, str] = field(default_factory=dict, repr=False)
    _file_pods: dict[str, str] = field(default_factory=dict, repr=False)

    def _load(self) -> None:
        if self.routes_file is None:
            return
        try:
            st = os.stat(self.routes_file)
        except OSError:
            self._file_routes, self._file_pods, self._stamp = {}, {}, None
            return
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return
        try:
            doc = json.loads(Path(self.routes_file).read_text())
        except (OSError, ValueError):
            return  # keep the last good routes; the writer replaces the file atomically
        routes = doc.get("routes", {}) if isinstance(doc, dict) else {}
        pods = doc.get("pods", {}) if isinstance(doc, dict) else {}
        self._file_routes = {k: str(v).rstrip("/") for k, v in routes.items() if isinstance(v, str)}
        self._file_pods = {k: v for k, v in pods.items() if isinstance(v, str)}
        self._stamp = stamp

    def routes(self) -> dict[str, str]:
        """Every explicitly known ns/job -> URL (not the template's, which are unbounded)."""
        self._load()
        return {**self._file_routes, **self.static}

    def resolve(self, namespace: str | None, job: str | None = None, pod: str | None = None) -> Route:
        if not namespace:
            raise Unroutable("no namespace")
        self._load()
        if not job and pod:
            named = self._file_pods.get(f"{namespace}/{pod}")
            if not named:
                raise Unroutable(f"pod {namespace}/{pod} belongs to no known job (and the alert has no gpulens_job label)")
            job = named.partition("/")[2]
        if not job:
            raise Unroutable("neither a job nor a pod to route by")
        key = f"{namespace}/{job}"
        url = self.static.get(key) or self._file_routes.get(key)
        if url:
            return Route(namespace, job, url)
        if self.template:
            fields = {"namespace": namespace, "job": job}
            if "{service}" in self.template:
                fields["service"] = _service_name(job)
            return Route(namespace, job, self.template.format(**fields).rstrip("/"))
        raise Unroutable(f"no coordinator is known for {key}")
