"""kopf wiring: thin handlers that only route events to the Reconciler.

Only event watchers are used: they keep no state in annotations and put no finalizers on anyone's
objects, so the operator never writes to trainer pods and an operator that is gone blocks no
deletion. A missed or failed event costs nothing because the periodic resync redoes the same work.
"""

from __future__ import annotations

import os
from typing import Any

import kopf

from . import labels as L
from .jobs import job_of_pod
from .login import login_in_cluster
from .reconcile import Reconciler

__all__ = ["build_registry"]


def build_registry(reconciler: Reconciler, connection: kopf.ConnectionInfo | None = None) -> kopf.OperatorRegistry:
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
    def armed_pod_changed(body: kopf.Body, namespace: str | None, **_: Any) -> None:
        job = job_of_pod(body, namespace)
        if job is not None:
            reconciler.reconcile_job(job.namespace, job.job_id)

    @kopf.on.event("v1", "pods", labels={L.MANAGED_BY: L.MANAGER, L.COMPONENT: "coordinator"}, registry=registry)
    def coordinator_pod_changed(type: str | None, body: kopf.Body, namespace: str | None, **_: Any) -> None:
        if type == "DELETED":
            cc_name = (body.get("metadata") or {}).get("labels", {}).get(L.COORDINATOR_OF)
            cc = reconciler.api.get_coordinator(namespace or "", cc_name) if cc_name else None
            if cc is not None and not cc["metadata"].get("deletionTimestamp"):
                reconciler.ensure_children(cc)            # a lost coordinator Pod comes back
        reconciler.status_for_pod(dict(body))

    @kopf.on.event(L.GROUP, L.VERSION, L.PLURAL, registry=registry)
    def coordinator_changed(type: str | None, body: kopf.Body, **_: Any) -> None:
        if type in (None, "ADDED") and not body.get("metadata", {}).get("deletionTimestamp"):
            reconciler.ensure_children(dict(body))

    return registry
