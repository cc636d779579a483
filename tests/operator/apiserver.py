"""A Kubernetes API server for tests: kmock's KubernetesEmulator plus the server-side behaviour
the operator relies on. It stands for kube-apiserver (plus its garbage collector) as seen through
the REST API; everything is served over real HTTP on 127.0.0.1 to the real `kubernetes` client
and to kopf.

What it adds to kmock 0.8, each as the real API server does it:
- on create: `metadata.uid`, `resourceVersion`, `creationTimestamp`, `generation`, and the
  namespace from the URL (kmock stores the body as sent);
- every write bumps `resourceVersion`; `PUT` replaces an object and answers 409 Conflict when the
  body's resourceVersion is stale (optimistic concurrency, which Lease elections depend on);
- `labelSelector` on list and watch (equality, inequality, existence); `fieldSelector` on list
  (equality and inequality on a dotted field path, e.g. `status.phase=Failed`);
- background cascading deletion: deleting an object deletes the objects whose ownerReferences
  name its uid, recursively (the garbage collector, with no delay); `propagationPolicy: Orphan`
  instead removes those owner references and keeps the dependents; an object written with owners
  that are all gone is collected too;
- a log of every request (method, path, query) for assertions;
- 1.20's merge patch of a CaptureCoordinator that sets a string field to "": refused with 422
  (the server stores it as null, which the CRD's schema refuses);
- NamespaceLifecycle admission for the namespaces named in `terminating`: a create there is
  refused with 403 and a `NamespaceTerminating` cause, as for a namespace being deleted;
- optionally (`token_delay_s`), Kubernetes 1.20's ServiceAccount admission with legacy token
  Secrets, which the project's cluster runs: a pod naming a ServiceAccount that does not exist is
  refused with 403, one whose ServiceAccount has no token Secret yet with 500 ServerTimeout ("No
  API token found ... retry after the token is automatically created"), and a token controller,
  an HTTP client of this server like kube-controller-manager's, creates the token Secret and lists
  it on a new ServiceAccount `token_delay_s` after its creation. Pods that name no ServiceAccount
  are let through (the double keeps no per-namespace `default` account).

It runs in its own thread and event loop, so synchronous code (the kubernetes client, kopf in
another thread) can use it from the test's thread.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import json
import threading
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import aiohttp.web
import attrs
import kmock
from kmock._internal import apps, enums, rendering

CORE = {"pods": "Pod", "services": "Service", "serviceaccounts": "ServiceAccount", "secrets": "Secret",
        "namespaces": "Namespace"}
RESOURCES = {
    **{f"v1/{plural}": (kind, plural != "namespaces") for plural, kind in CORE.items()},
    "rbac.authorization.k8s.io/v1/rolebindings": ("RoleBinding", True),
    "coordination.k8s.io/v1/leases": ("Lease", True),
    "batch/v1/jobs": ("Job", True),
    "jobset.x-k8s.io/v1alpha2/jobsets": ("JobSet", True),
    "kubeflow.org/v1/pytorchjobs": ("PyTorchJob", True),
    "gpulens.dev/v1alpha1/capturecoordinators": ("CaptureCoordinator", True),
    # Served by every real API server: kopf's cluster scanning lists and watches it when it can.
    "apiextensions.k8s.io/v1/customresourcedefinitions": ("CustomResourceDefinition", False),
}


def _selector_matches(selector: str, labels: dict[str, str]) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k.strip()) == v.strip():
                return False
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            if labels.get(k.strip()) != v.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def _field_selector_matches(selector: str, obj: dict) -> bool:
    def value(path: str) -> str:
        node: Any = obj
        for part in path.strip().split("."):
            node = node.get(part) if isinstance(node, dict) else None
        return "" if node is None else str(node)
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if value(k) == v.strip():
                return False
        else:
            k, v = term.replace("==", "=").split("=", 1)
            if value(k) != v.strip():
                return False
    return True


def _status(code: int, reason: str, message: str) -> aiohttp.web.Response:
    return aiohttp.web.json_response({"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
                                      "code": code, "reason": reason, "message": message}, status=code)


def _empty_string_path(doc: Any, path: str = "") -> str | None:
    """The first field a JSON merge patch sets to "": kube-apiserver 1.20 stores such a value as
    null, and a CRD field typed string then fails validation (measured on the project's cluster:
    `{"status": {"podName": ""}}` answered 422 "status.podName ... must be of type string: null")."""
    if doc == "":
        return path
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in items:
        found = _empty_string_path(value, f"{path}.{key}" if path else str(key))
        if found:
            return found
    return None


def _terminating(request: rendering.Request) -> aiohttp.web.Response:
    """NamespaceLifecycle admission's refusal of a new object in a namespace being deleted
    (plugin/pkg/admission/namespace/lifecycle, as 1.20 sends it: 403 with a NamespaceTerminating cause)."""
    ns, plural = request.namespace, request.resource.plural
    name = ((request.data or {}).get("metadata") or {}).get("name", "") if isinstance(request.data, dict) else ""
    group = request.resource.group or ""
    body = {"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure", "code": 403,
            "reason": "Forbidden",
            "message": f"{plural}{'.' + group if group else ''} \"{name}\" is forbidden: unable to create new "
                       f"content in namespace {ns} because it is being terminated",
            "details": {"name": name, "group": group, "kind": plural,
                        "causes": [{"reason": "NamespaceTerminating", "message": f"namespace {ns} is being terminated",
                                    "field": "metadata.namespace"}]}}
    return aiohttp.web.json_response(body, status=403)


@attrs.define(kw_only=True)
class ApiServer(kmock.KubernetesEmulator):
    log: list[tuple[str, str, str]] = attrs.field(factory=list, init=False)
    agents: list[str] = attrs.field(factory=list, init=False)      # User-Agent of each logged request
    _rv: Any = attrs.field(factory=lambda: itertools.count(1000), init=False)
    token_delay_s: float | None = None       # None: no ServiceAccount token admission (see the docstring)
    terminating: set = attrs.field(factory=set)   # namespaces being deleted: creates in them are refused
    base_url: str = attrs.field(default="", init=False)     # set once serving; the token controller's target
    _token_tasks: set = attrs.field(factory=set, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for key, (kind, namespaced) in RESOURCES.items():
            self.resources[key] = kmock.ResourceInfo(kind=kind, namespaced=namespaced, subresources={"status"},
                                                     verbs={"get", "list", "watch", "create", "update", "patch",
                                                            "delete"})

    def _key(self, request: rendering.Request) -> tuple:
        return (request.resource, request.namespace, request.name)

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        self.log.append((str(request.method.value).upper(), request.url.path, request.url.query_string))
        self.agents.append(request.headers.get("User-Agent", ""))
        if request.resource is None:
            return await super()._handle(request)
        if str(request.method.value).upper() == "PUT" and request.name:
            return await self._replace(request)
        if str(request.method.value).upper() == "PATCH" and request.resource.plural == "capturecoordinators" \
                and isinstance(request.data, dict):
            empty = _empty_string_path(request.data)
            if empty:
                return _status(422, "Invalid", f'CaptureCoordinator.gpulens.dev "{request.name}" is invalid: {empty}: '
                                               f'Invalid value: "null": {empty} in body must be of type string: "null"')
        if request.action == enums.action.CREATE and request.namespace in self.terminating:
            return _terminating(request)
        if self.token_delay_s is not None and request.action == enums.action.CREATE and \
                request.resource.plural == "pods" and not request.subresource and isinstance(request.data, dict):
            refused = await self._admit_service_account(request)
            if refused is not None:
                return refused
        rv = str(next(self._rv))
        if request.action == enums.action.CREATE and isinstance(request.data, dict):
            meta = request.data.setdefault("metadata", {})
            meta.setdefault("namespace", request.namespace) if request.namespace else None
            meta.update(uid=str(uuid.uuid4()), resourceVersion=rv, generation=1,
                        creationTimestamp=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
        elif request.action == enums.action.UPDATE and isinstance(request.data, dict):
            request.data.setdefault("metadata", {})["resourceVersion"] = rv
        owner_uid = None
        if request.action == enums.action.DELETE and request.name:
            async with self._lock:
                key = self._key(request)
                obj = self._objects[key] if key in self._objects else None
                if obj is not None and not obj.deleted:
                    owner_uid = obj.raw.get("metadata", {}).get("uid")
        orphan = isinstance(request.data, dict) and request.data.get("propagationPolicy") == "Orphan" or \
            request.params.get("propagationPolicy") == "Orphan"
        response = await super()._handle(request)
        if owner_uid and response.status < 300:
            await (self._orphan(owner_uid) if orphan else self._collect_garbage({owner_uid}))
        elif self.token_delay_s is not None and request.action == enums.action.CREATE and response.status < 300 \
                and request.resource.plural == "serviceaccounts" and not request.subresource:
            task = asyncio.create_task(self._issue_token(request.namespace, request.data["metadata"]["name"]))
            self._token_tasks.add(task)
            task.add_done_callback(self._token_tasks.discard)
        elif request.action in (enums.action.CREATE, enums.action.UPDATE) and response.status < 300:
            await self._collect_dangling()
        return response

    async def _admit_service_account(self, request: rendering.Request) -> aiohttp.web.Response | None:
        """1.20's ServiceAccount admission plugin (plugin/pkg/admission/serviceaccount) for a pod
        that mounts its account's token: None admits, else the refusal the real server sends."""
        spec = request.data.get("spec") or {}
        name = spec.get("serviceAccountName")
        if not name or spec.get("automountServiceAccountToken") is False:
            return None
        async with self._lock:
            account = next((o.raw for (res, ns, n), o in self._objects.items()
                            if res.plural == "serviceaccounts" and ns == request.namespace and n == name
                            and not o.deleted), None)
        if account is None:
            return _status(403, "Forbidden", f"pods is forbidden: service account {request.namespace}/{name} was "
                                             "not found, retry after the service account is created")
        if not account.get("secrets"):
            return _status(500, "ServerTimeout", f"No API token found for service account \"{name}\", retry after "
                                                 "the token is automatically created and added to the service account")
        return None

    async def _issue_token(self, namespace: str, account: str) -> None:
        """The token controller: a token Secret for the new account, then the account lists it."""
        await asyncio.sleep(self.token_delay_s or 0)
        secret = f"{account}-token-{uuid.uuid4().hex[:5]}"
        base = f"{self.base_url}/api/v1/namespaces/{namespace}"
        async with aiohttp.ClientSession(headers={"User-Agent": "token-controller"}) as http:
            async with http.post(f"{base}/secrets", json={
                    "apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/service-account-token",
                    "metadata": {"name": secret, "annotations": {"kubernetes.io/service-account.name": account}},
                    "data": {"token": "dG9rZW4="}}) as resp:
                resp.raise_for_status()
            async with http.patch(f"{base}/serviceaccounts/{account}", json={"secrets": [{"name": secret}]},
                                  headers={"Content-Type": "application/merge-patch+json"}) as resp:
                if resp.status == 404:
                    return     # the account went before its token came
                resp.raise_for_status()

    async def _collect_dangling(self) -> None:
        """The garbage collector also deletes an object all of whose owners are gone when it is
        written (a late create by a reconciler that still held the deleted owner): without this, the
        double kept such objects forever where the real cluster removes them."""
        async with self._lock:
            live = {o.raw.get("metadata", {}).get("uid") for o in self._objects.values() if not o.deleted}
            dangling = set()
            for obj in self._objects.values():
                if obj.deleted:
                    continue
                refs = {r.get("uid") for r in (obj.raw.get("metadata", {}).get("ownerReferences") or [])}
                if refs and not refs & live:
                    dangling |= refs
        if dangling:
            await self._collect_garbage(dangling)

    async def _orphan(self, owner_uid: str) -> None:
        async with self._lock:
            for (resource, _ns, _name), obj in list(self._objects.items()):
                if obj.deleted:
                    continue
                refs = obj.raw.get("metadata", {}).get("ownerReferences") or []
                if any(r.get("uid") == owner_uid for r in refs):
                    obj.patch({"metadata": {"ownerReferences": [r for r in refs if r.get("uid") != owner_uid]}})
                    await self._buses[resource].put({"type": "MODIFIED", "object": obj.raw})

    async def _replace(self, request: rendering.Request) -> aiohttp.web.Response:
        body = request.data if isinstance(request.data, dict) else {}
        async with self._lock:
            key = self._key(request)
            if key not in self._objects or self._objects[key].deleted:
                return _status(404, "NotFound", f"{request.name} not found")
            current = self._objects[key].raw
            want_rv = (body.get("metadata") or {}).get("resourceVersion")
            if want_rv and want_rv != current["metadata"].get("resourceVersion"):
                return _status(409, "Conflict", "the object has been modified; please apply your changes "
                                                "to the latest version and try again")
            new = json.loads(json.dumps(body))
            meta = new.setdefault("metadata", {})
            for k in ("uid", "creationTimestamp", "namespace", "name", "generation"):
                if k in current["metadata"]:
                    meta[k] = current["metadata"][k]
            meta["resourceVersion"] = str(next(self._rv))
            self._objects[key].create(new)
            await self._buses[request.resource].put({"type": "MODIFIED", "object": new})
        return aiohttp.web.json_response(new)

    async def _collect_garbage(self, gone: set[str]) -> None:
        while gone:
            following: set[str] = set()
            async with self._lock:
                for (resource, _ns, _name), obj in list(self._objects.items()):
                    if obj.deleted:
                        continue
                    raw = obj.raw
                    refs = {r.get("uid") for r in raw.get("metadata", {}).get("ownerReferences") or []}
                    if refs & gone:
                        obj.delete()
                        await self._buses[resource].put({"type": "DELETED", "object": raw})
                        following.add(raw.get("metadata", {}).get("uid"))
            gone = {u for u in following if u}

    async def _serve_list(self, request: rendering.Request) -> rendering.Payload:
        out = await super()._serve_list(request)
        selector = request.params.get("labelSelector")
        if selector:
            out["items"] = [o for o in out["items"]
                            if _selector_matches(selector, (o.get("metadata") or {}).get("labels") or {})]
        fields = request.params.get("fieldSelector")
        if fields:
            out["items"] = [o for o in out["items"] if _field_selector_matches(fields, o)]
        return out

    async def _serve_watch(self, request: rendering.Request):
        selector = request.params.get("labelSelector")
        async for event in super()._serve_watch(request):
            if selector and isinstance(event, dict):
                labels = ((event.get("object") or {}).get("metadata") or {}).get("labels") or {}
                if not _selector_matches(selector, labels):
                    continue
            yield event


@dataclass
class Running:
    """A started ApiServer: its URL, and thread-safe helpers for the test thread."""
    server: ApiServer
    url: str
    loop: asyncio.AbstractEventLoop
    _stop: Any = field(repr=False, default=None)

    def call(self, coro_fn, *args):
        return asyncio.run_coroutine_threadsafe(coro_fn(*args), self.loop).result(timeout=30)

    def requests(self) -> list[tuple[str, str, str]]:
        return list(self.server.log)

    def requests_by(self, user_agent: str) -> list[tuple[str, str, str]]:
        return [r for r, ua in zip(list(self.server.log), list(self.server.agents)) if ua == user_agent]

    def writes(self) -> list[tuple[str, str, str]]:
        return [r for r in self.server.log if r[0] in ("POST", "PUT", "PATCH", "DELETE")]

    def api_client(self):
        from kubernetes import client
        cfg = client.Configuration()
        cfg.host = self.url
        return client.ApiClient(cfg)


@contextmanager
def running_apiserver(token_delay_s: float | None = None) -> Iterator[Running]:
    """Start an ApiServer on 127.0.0.1 (free port) in a thread; stop it and its loop afterwards.
    `token_delay_s`: emulate 1.20's ServiceAccount token admission (see ApiServer)."""
    ready = threading.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        stop = asyncio.Event()
        async with ApiServer(token_delay_s=token_delay_s) as server, apps.Server(server, host="127.0.0.1") as srv:
            server.base_url = str(srv.url).rstrip("/")
            box.update(server=server, url=str(srv.url).rstrip("/"), loop=asyncio.get_running_loop(), stop=stop)
            ready.set()
            await stop.wait()

    thread = threading.Thread(target=lambda: asyncio.run(main()), name="apiserver", daemon=True)
    thread.start()
    if not ready.wait(30):
        raise RuntimeError("the test API server did not start")
    running = Running(box["server"], box["url"], box["loop"], box["stop"])
    try:
        yield running
    finally:
        running.loop.call_soon_threadsafe(box["stop"].set)
        thread.join(30)
