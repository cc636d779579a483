"""The operator's only door to the Kubernetes API: thin, idempotent calls with the `kubernetes` client.

Objects travel as plain dicts (the API's own JSON, `_preload_content=False`), so the pure planning
code and the tests see exactly what the API server sends. Creation is idempotent (409 means it is
already there), deletion too (404 means it is already gone). Any other API error is raised as
`KubeError` for the caller to retry at the next event or resync.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from ..wire import labels as L
from .jobs import OwnerRef

__all__ = ["KubeApi", "KubeError", "MERGE_PATCH"]

MERGE_PATCH = "application/merge-patch+json"   # the client would send a dict as json-patch otherwise

_PLURALS = {"Job": "jobs", "JobSet": "jobsets", "PyTorchJob": "pytorchjobs"}


#: The cause Kubernetes' NamespaceLifecycle admission puts on its 403 for new objects in a
#: namespace being deleted (k8s.io/api/core/v1 NamespaceTerminatingCause).
NAMESPACE_TERMINATING = "NamespaceTerminating"


class KubeError(RuntimeError):
    """An API call failed in a way that retrying later may fix (403, 5xx, connection refused).

    Carries the API server's own Status message (why a 422 was invalid, which namespace is
    terminating): without it a log says "422 Unprocessable Entity" and nobody can tell why.
    """

    def __init__(self, action: str, exc: Exception):
        status = getattr(exc, "status", None)
        reason = getattr(exc, "reason", None) or type(exc).__name__
        self.message, self.causes = _api_status(getattr(exc, "body", None))
        text = f"{action}: " + " ".join(str(part) for part in (status, reason) if part)
        super().__init__(f"{text}: {self.message}" if self.message else text)
        self.status = status

    @property
    def namespace_terminating(self) -> bool:
        """The call created something in a namespace that is being deleted: no retry can help."""
        return self.status == 403 and (NAMESPACE_TERMINATING in self.causes
                                       or "because it is being terminated" in self.message)


def _api_status(body: Any) -> tuple[str, tuple[str, ...]]:
    """The message and cause types of a `metav1.Status` body; ("", ()) for anything else."""
    if isinstance(body, (bytes, bytearray)):
        body = body.decode("utf-8", "replace")
    if not isinstance(body, str) or not body:
        return "", ()
    try:
        status = json.loads(body)
    except ValueError:
        return "", ()
    if not isinstance(status, dict):
        return "", ()
    message = status.get("message")
    causes = ((status.get("details") or {}) if isinstance(status.get("details"), dict) else {}).get("causes")
    # metav1.StatusCause's type travels under the JSON key "reason".
    kinds = tuple(str(c.get("reason")) for c in causes if isinstance(c, dict) and c.get("reason")) \
        if isinstance(causes, list) else ()
    return (" ".join(message.split())[:400] if isinstance(message, str) else ""), kinds


def _json(resp: Any) -> Any:
    return json.loads(resp.data) if resp.data else {}


def _split(api_version: str) -> tuple[str, str]:
    group, _, version = api_version.rpartition("/")
    return group, version


class KubeApi:
    """Just the calls the operator makes; every method is synchronous (kopf runs it in a thread)."""

    def __init__(self, api_client: k8s.ApiClient):
        self.api_client = api_client
        self.core = k8s.CoreV1Api(api_client)
        self.custom = k8s.CustomObjectsApi(api_client)
        self.rbac = k8s.RbacAuthorizationV1Api(api_client)
        self.batch = k8s.BatchV1Api(api_client)

    def _call(self, action: str, fn, *args, missing_ok: bool = False, exists_ok: bool = False, **kw) -> Any:
        try:
            return _json(fn(*args, _preload_content=False, **kw))
        except ApiException as exc:
            if missing_ok and exc.status == 404:
                return None
            if exists_ok and exc.status == 409:
                return None
            raise KubeError(action, exc) from None
        except Exception as exc:  # urllib3 connection errors and the like
            raise KubeError(action, exc) from None

    # --- reading ---------------------------------------------------------------------------
    def list_armed_pods(self, namespace: str | None = None) -> list[dict[str, Any]]:
        sel = f"{L.ARMED}=true"
        if namespace:
            out = self._call("list pods", self.core.list_namespaced_pod, namespace, label_selector=sel)
        else:
            out = self._call("list pods", self.core.list_pod_for_all_namespaces, label_selector=sel)
        return list(out.get("items") or [])

    def list_coordinators(self, namespace: str | None = None) -> list[dict[str, Any]]:
        if namespace:
            out = self._call("list capturecoordinators", self.custom.list_namespaced_custom_object,
                             L.GROUP, L.VERSION, namespace, L.PLURAL)
        else:
            out = self._call("list capturecoordinators", self.custom.list_cluster_custom_object,
                             L.GROUP, L.VERSION, L.PLURAL)
        return list(out.get("items") or [])

    def get_owner(self, owner: OwnerRef, namespace: str) -> dict[str, Any] | None:
        """The job object, or None when it (or its whole API) does not exist."""
        group, version = _split(owner.api_version)
        plural = _PLURALS.get(owner.kind, owner.kind.lower() + "s")
        return self._call(f"get {owner.kind} {namespace}/{owner.name}", self.custom.get_namespaced_custom_object,
                          group, version, namespace, plural, owner.name, missing_ok=True)

    def get_job(self, namespace: str, name: str, timeout_s: float | None = None) -> dict[str, Any] | None:
        """A batch/v1 Job, or None when it is gone (the webhook numbers a replacement pod's attempt)."""
        return self._call(f"get job {namespace}/{name}", self.batch.read_namespaced_job, name, namespace,
                          missing_ok=True, _request_timeout=timeout_s)

    def list_pods(self, namespace: str, label_selector: str, field_selector: str = "",
                  timeout_s: float | None = None) -> list[dict[str, Any]]:
        out = self._call(f"list pods {namespace}", self.core.list_namespaced_pod, namespace,
                         label_selector=label_selector, field_selector=field_selector or None,
                         _request_timeout=timeout_s)
        return list(out.get("items") or [])

    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._call(f"get pod {namespace}/{name}", self.core.read_namespaced_pod, name, namespace,
                          missing_ok=True)

    def get_service(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._call(f"get service {namespace}/{name}", self.core.read_namespaced_service, name, namespace,
                          missing_ok=True)

    def get_coordinator(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._call(f"get capturecoordinator {namespace}/{name}", self.custom.get_namespaced_custom_object,
                          L.GROUP, L.VERSION, namespace, L.PLURAL, name, missing_ok=True)

    def get_secret_data(self, namespace: str, name: str) -> dict[str, str] | None:
        out = self._call(f"get secret {namespace}/{name}", self.core.read_namespaced_secret, name, namespace,
                         missing_ok=True)
        return None if out is None else dict(out.get("data") or {})

    # --- writing ---------------------------------------------------------------------------
    def create(self, body: Mapping[str, Any]) -> dict[str, Any] | None:
        """Create `body`; None when an object of that name already exists (we never replace it)."""
        kind, ns = body["kind"], body["metadata"]["namespace"]
        what = f"create {kind} {ns}/{body['metadata']['name']}"
        if kind == L.KIND:
            return self._call(what, self.custom.create_namespaced_custom_object, L.GROUP, L.VERSION, ns, L.PLURAL,
                              body, exists_ok=True)
        fn = {"Pod": self.core.create_namespaced_pod, "Service": self.core.create_namespaced_service,
              "ServiceAccount": self.core.create_namespaced_service_account,
              "Secret": self.core.create_namespaced_secret,
              "RoleBinding": self.rbac.create_namespaced_role_binding}[kind]
        return self._call(what, fn, ns, body, exists_ok=True)

    def delete_coordinator(self, namespace: str, name: str) -> bool:
        """Delete a CaptureCoordinator; its children follow through owner references."""
        out = self._call(f"delete capturecoordinator {namespace}/{name}",
                         self.custom.delete_namespaced_custom_object, L.GROUP, L.VERSION, namespace, L.PLURAL, name,
                         body=k8s.V1DeleteOptions(propagation_policy="Background"), missing_ok=True)
        return out is not None

    def patch_service(self, namespace: str, name: str, patch: Mapping[str, Any]) -> dict[str, Any] | None:
        return self._call(f"patch service {namespace}/{name}", self.core.patch_namespaced_service, name, namespace,
                          patch, _content_type=MERGE_PATCH, missing_ok=True)

    def patch_coordinator_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> dict[str, Any] | None:
        return self._call(f"patch capturecoordinator {namespace}/{name}/status",
                          self.custom.patch_namespaced_custom_object_status, L.GROUP, L.VERSION, namespace,
                          L.PLURAL, name, {"status": dict(status)}, _content_type=MERGE_PATCH, missing_ok=True)
