"""kopf wiring: thin handlers that only route events to the Reconciler.

Only event watchers are used: they keep no state in annotations and put no finalizers on anyone's
objects, so the operator never writes to trainer pods and an operator that is gone blocks no
deletion. Events, not the periodic resync, are what make coordinators appear in seconds: a failed
call is retried here with a short backoff (Kubernetes 1.20 refuses a Pod with 500 until its new
ServiceAccount has a token; an alert must not wait a resync for that), and a deleted
CaptureCoordinator's own DELETED event brings it back. The resync stays as the net for events
that were never delivered.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, Callable

import kopf

from gpulens.ground.logs import get_logger

from ..wire import labels as L
from .jobs import job_of_pod
from .kube import KubeError
from .login import login_in_cluster
from .reconcile import Reconciler

__all__ = ["build_registry", "RETRY_BACKOFF_S"]

log = get_logger("operator")

#: Seconds between attempts of a handler whose API calls failed (about 30 s in all, then the resync).
RETRY_BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0, 15.0)


async def _retrying(what: str, fn: Callable[..., Any], *args: Any,
                    backoff: tuple[float, ...] = RETRY_BACKOFF_S) -> Any:
    """Run the blocking `fn(*args)` in a thread; on KubeError, again after each backoff step
    (not when the namespace is being deleted: every retry would be refused the same way)."""
    for attempt, delay in enumerate((*backoff, None)):
        try:
            return await asyncio.to_thread(fn, *args)
        except KubeError as exc:
            if exc.namespace_terminating:
                # The namespace is being deleted with everything in it: nothing to bring back.
                log.info("event.dropped", what=what, reason="namespace terminating", attempts=attempt + 1)
                return None
            if delay is None:
                log.warning("event.gave_up", what=what, attempts=attempt + 1, reason=str(exc),
                            effect="the next resync retries")
                return None
            log.info("event.retry", what=what, attempt=attempt + 1, reason=str(exc), retry_in_s=delay)
            await asyncio.sleep(delay)
    return None


def build_registry(reconciler: Reconciler, connection: kopf.ConnectionInfo | None = None,
                   backoff: tuple[float, ...] = RETRY_BACKOFF_S) -> kopf.OperatorRegistry:
    """A fresh registry (never kopf's global one) with our handlers bound to `reconciler`."""
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        # A registry of our own carries no default login. In a pod: the service-account token,
        # re-read on every re-login (tokens rotate), at KUBERNETES_SERVICE_HOST/PORT (kopf's own
        # login needs DNS for kubernetes.default.svc). Elsewhere: $KUBECONFIG, read at call time
        # (the kubernetes client reads it once at import, before `--kubeconfig` could set it).
        if connection is not None:
            return connection
        return login_in_cluster(env=os.environ, settings=kwargs.get("settings")) or kopf.login_with_kubeconfig(**kwargs)

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.posting.enabled = False                  # no Events: keeps RBAC minimal
        # No cluster scanning: the operator's resources are fixed and it runs cluster-wide, so it
        # needs no list/watch of CustomResourceDefinitions or Namespaces (a real API server answers
        # 403 to those under the chart's RBAC). kopf then resolves the resources once, at start,
        # from discovery (/apis), which every authenticated user may read.
        settings.scanning.disabled = True
        settings.watching.server_timeout = 300            # re-list every few minutes
        settings.watching.client_timeout = 330
        settings.networking.error_backoffs = [1, 2, 5, 10]
        # Server-side filtering: watch only pods that carry gpulens.dev/armed (armed trainers
        # have "true", our coordinator pods "false"), not every pod of the cluster.
        settings.watching.label_selectors["v1", "pods"] = L.ARMED

    @kopf.on.event("v1", "pods", labels={L.ARMED: "true"}, registry=registry)
    async def armed_pod_changed(body: kopf.Body, namespace: str | None, **_: Any) -> None:
        job = job_of_pod(body, namespace)
        if job is not None:
            await _retrying(f"job {job.namespace}/{job.job_id}", reconciler.reconcile_job, job.namespace,
                            job.job_id, backoff=backoff)

    def _coordinator_pod_gone(namespace: str, cc_name: str) -> None:
        cc = reconciler.api.get_coordinator(namespace, cc_name)
        if cc is not None and not cc["metadata"].get("deletionTimestamp"):
            reconciler.ensure_children(cc)                # a lost coordinator Pod comes back

    @kopf.on.event("v1", "pods", labels={L.MANAGED_BY: L.MANAGER, L.COMPONENT: "coordinator"}, registry=registry)
    async def coordinator_pod_changed(type: str | None, body: kopf.Body, namespace: str | None, **_: Any) -> None:
        if type == "DELETED":
            cc_name = (body.get("metadata") or {}).get("labels", {}).get(L.COORDINATOR_OF)
            if cc_name:
                await _retrying(f"coordinator {namespace}/{cc_name}", _coordinator_pod_gone, namespace or "",
                                cc_name, backoff=backoff)
        await _retrying("coordinator status", reconciler.status_for_pod, dict(body), backoff=backoff)

    @kopf.on.event(L.GROUP, L.VERSION, L.PLURAL, registry=registry)
    async def coordinator_changed(type: str | None, body: kopf.Body, **_: Any) -> None:
        meta = body.get("metadata") or {}
        if type == "DELETED":
            # Deleted by hand (or by the garbage collector): the job decides whether it comes back,
            # now, not at the next resync.
            job_id = (body.get("spec") or {}).get("jobId")
            if job_id and meta.get("namespace"):
                await _retrying(f"job {meta['namespace']}/{job_id}", reconciler.reconcile_job, meta["namespace"],
                                job_id, backoff=backoff)
        elif type in (None, "ADDED") and not meta.get("deletionTimestamp"):
            await _retrying(f"coordinator {meta.get('namespace')}/{meta.get('name')}", reconciler.ensure_children,
                            dict(body), backoff=backoff)

    return registry
