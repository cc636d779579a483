"""Mutating admission webhook that arms trainer pods (opt-in per namespace).

The API server POSTs an `admission.k8s.io/v1` AdmissionReview to `/mutate` over TLS; we answer
with the JSON Patch from `arming.arm_pod`. The chart registers it only for namespaces labelled
`gpulens.dev/arming=enabled`, with `failurePolicy: Ignore`, and this handler never refuses a pod:
if arming fails, the pod is admitted unarmed with a warning, because observability must never
stop training. It has no side effects and returns a transformation of what it was sent plus one
number read from the API, which is why it needs no authentication beyond the API server's TLS
connection.

Serving workloads: `/mutate-serving` is the same handler for the chart's serving entries (a
namespace labelled `gpulens.dev/serving=enabled`, or a pod labelled `gpulens.dev/arm=true` in any
namespace); it also arms Deployment, StatefulSet and LeaderWorkerSet pods that carry no label.
It never arms in kube-system or the operator's own namespace (`SERVING_NEVER`, plus the namespace
`make_app` is given): the chart's per-workload entry excludes them with a namespaceSelector on
`kubernetes.io/metadata.name`, a label the API server sets only from Kubernetes 1.21, so on 1.20
(which the chart supports) that selector matches every namespace and only this check holds.

That one read: for a pod of a plain batch Job it counts the Job's failed pods first
(`job_attempts.py`: only for the Job whose uid the pod names), so a replacement pod is a new
attempt. That read is bounded
(`ATTEMPT_BUDGET_S`, below the chart's 5 s webhook timeout) and a failed read arms the pod as
attempt 0 with a log line: the pod is never held up or refused for it.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import ssl
from typing import Any, Callable, Mapping

from aiohttp import web

from gpulens.capture.wire import limits, web_json
from gpulens.ground.logs import get_logger

from .arming import arm_pod
from .config import ArmingConfig
from .stopping import stopped_within

__all__ = ["review_response", "attempt_for", "make_app", "tls_context", "reload_certificates", "MAX_BODY",
           "ATTEMPT_BUDGET_S", "AttemptReader", "SERVING_NEVER"]

log = get_logger("webhook")

MAX_BODY = limits.WEBHOOK_BODY.max_bytes   # admission requests are bounded by the 3 MiB object limit
ATTEMPT_BUDGET_S = 3.0                     # reading the Job; the API server gives the webhook 5 s in all
#: Namespaces the serving entries never arm in (with the operator's own; see the module docstring).
SERVING_NEVER = ("kube-system",)

#: (pod, namespace) -> the pod's attempt, or None when the reader has no rule for that pod
#: (`job_attempts.JobAttempts.attempt_of`). Synchronous: it runs in a thread.
AttemptReader = Callable[[Mapping[str, Any], str], "int | None"]


class BadReview(ValueError):
    pass


def _request_of(review: Any) -> Mapping[str, Any]:
    if not isinstance(review, dict):
        raise BadReview("body must be a JSON object")
    if review.get("apiVersion") != "admission.k8s.io/v1" or review.get("kind") != "AdmissionReview":
        raise BadReview("expected apiVersion admission.k8s.io/v1, kind AdmissionReview")
    req = review.get("request")
    if not isinstance(req, dict):
        raise BadReview("request: missing or not an object")
    if not isinstance(req.get("uid"), str) or not req["uid"]:
        raise BadReview("request.uid: missing")
    return req


def _pod_created(req: Mapping[str, Any]) -> dict[str, Any] | None:
    """The pod of a Pod CREATE request, None for anything else (admitted untouched)."""
    kind = req.get("kind") or {}
    obj = req.get("object")
    if kind.get("kind") != "Pod" or kind.get("group", "") != "" or req.get("operation") != "CREATE" \
            or not isinstance(obj, dict):
        return None
    return obj


def _namespace(req: Mapping[str, Any], obj: Mapping[str, Any]) -> str:
    return req.get("namespace") or (obj.get("metadata") or {}).get("namespace") or "default"


async def attempt_for(review: Any, reader: AttemptReader | None, budget_s: float = ATTEMPT_BUDGET_S) -> int | None:
    """The attempt `reader` gives the reviewed pod; None when there is no reader, no pod, no rule
    for it, or the read failed or ran out of time (then logged: the pod is armed as attempt 0).
    Raises BadReview for a malformed request."""
    req = _request_of(review)
    obj = _pod_created(req)
    if reader is None or obj is None:
        return None
    namespace = _namespace(req, obj)
    try:
        return await asyncio.wait_for(asyncio.to_thread(reader, obj, namespace), budget_s)
    except Exception as exc:  # noqa: BLE001 - a pod is never held up by this read
        reason = "timeout" if isinstance(exc, asyncio.TimeoutError) else f"{type(exc).__name__}: {exc}"
        log.warning("attempt.unread", namespace=namespace, uid=req["uid"], attempt=0, reason=reason)
        return None


def review_response(review: Any, cfg: ArmingConfig, image: str, attempt: int | None = None,
                    serving: bool = False, never: frozenset[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """The AdmissionReview answer for `review`; raises BadReview for a malformed request.

    `attempt`: what `attempt_for` read for the pod (None: the pod's own labels decide).
    `serving`: the request came through the serving entry (`/mutate-serving`: the namespace
    opted in to serving), so serving workloads' pods are armed without a label of their own.
    `never`: namespaces where a serving request leaves every pod alone."""
    req = _request_of(review)
    resp: dict[str, Any] = {"uid": req["uid"], "allowed": True}
    obj = _pod_created(req)
    if obj is None:
        return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": resp}
    namespace = _namespace(req, obj)
    if serving and namespace in never:
        log.info("pod.skipped", namespace=namespace, reason="serving pods are never armed in this namespace",
                 uid=req["uid"])
        return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": resp}
    try:
        result = arm_pod(obj, namespace, cfg, image, attempt, serving)
    except Exception as exc:  # never refuse a pod because arming failed
        log.error("arming.failed", namespace=namespace, uid=req["uid"], reason=f"{type(exc).__name__}: {exc}")
        resp["warnings"] = [f"gpulens: pod not armed: {type(exc).__name__}"]
        return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": resp}
    if result.patch:
        resp["patchType"] = "JSONPatch"
        resp["patch"] = base64.b64encode(json.dumps(result.patch).encode()).decode()
    if result.warnings:
        resp["warnings"] = [f"gpulens: {w}" for w in result.warnings]
    log.info("pod.armed" if result.patch else "pod.skipped", namespace=namespace, job_id=result.job_id,
             reason=result.reason, uid=req["uid"], attempt=attempt)
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": resp}


def make_app(cfg: ArmingConfig | None, image: str, attempts: AttemptReader | None = None,
             own_namespace: str | None = None) -> web.Application:
    """`/healthz` always; `/mutate` when `cfg` is given (the webhook is enabled). `attempts` numbers
    batch Job pods' attempts (None: the pods' labels alone do, as with no API access).
    `own_namespace`: the operator's (the release's), where `/mutate-serving` arms nothing, as in
    kube-system."""
    app = web.Application(client_max_size=MAX_BODY)
    never = frozenset(SERVING_NEVER + ((own_namespace,) if own_namespace else ()))

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def mutate(request: web.Request, serving: bool = False) -> web.Response:
        if request.content_type != "application/json":
            return web.json_response({"error": "Content-Type must be application/json"}, status=415)
        review = await web_json.read_json(request, limits.WEBHOOK_BODY)
        try:
            attempt = await attempt_for(review, attempts)
            return web.json_response(review_response(review, cfg, image, attempt, serving,  # type: ignore[arg-type]
                                                     never if serving else ()))
        except BadReview as exc:
            log.warning("review.bad", reason=str(exc))
            return web.json_response({"error": str(exc)}, status=400)

    async def mutate_serving(request: web.Request) -> web.Response:
        return await mutate(request, serving=True)

    app.router.add_get("/healthz", healthz)
    if cfg is not None:
        app.router.add_post("/mutate", mutate)
        app.router.add_post("/mutate-serving", mutate_serving)
    return app


def tls_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert_file, key_file)
    return ctx


def _stamp(*paths: str) -> tuple:
    out = []
    for p in paths:
        try:
            st = os.stat(p)                    # follows the Secret volume's symlinks
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            out.append(None)
    return tuple(out)


async def reload_certificates(ctx: ssl.SSLContext, cert_file: str, key_file: str, stop: asyncio.Event,
                              interval_s: float = 30.0) -> None:
    """Load a renewed certificate (cert-manager rotates it in the mounted Secret) into the live
    context: new TLS handshakes use it, no restart needed. A half-written pair is retried later."""
    seen = _stamp(cert_file, key_file)
    while not stop.is_set():
        if await stopped_within(stop, interval_s):
            return
        now = _stamp(cert_file, key_file)
        if now == seen or None in now:
            continue
        try:
            ctx.load_cert_chain(cert_file, key_file)
        except (ssl.SSLError, OSError) as exc:
            log.warning("tls.reload_failed", reason=type(exc).__name__)
            continue
        seen = now
        log.info("tls.reloaded", cert=cert_file)
