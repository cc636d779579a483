"""Mutating admission webhook that arms trainer pods (opt-in per namespace).

The API server POSTs an `admission.k8s.io/v1` AdmissionReview to `/mutate` over TLS; we answer
with the JSON Patch from `arming.arm_pod`. The chart registers it only for namespaces labelled
`gpulens.dev/arming=enabled`, with `failurePolicy: Ignore`, and this handler never refuses a pod:
if arming fails, the pod is admitted unarmed with a warning, because observability must never
stop training. It has no side effects and returns only a transformation of what it was sent,
which is why it needs no authentication beyond the API server's TLS connection.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import ssl
from typing import Any, Mapping

from aiohttp import web

from capture import limits, web_json
from gpulens.logs import get_logger

from .arming import arm_pod
from .config import ArmingConfig

__all__ = ["review_response", "make_app", "tls_context", "reload_certificates", "MAX_BODY"]

log = get_logger("webhook")

MAX_BODY = limits.WEBHOOK_BODY.max_bytes   # admission requests are bounded by the 3 MiB object limit


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


def review_response(review: Any, cfg: ArmingConfig, image: str) -> dict[str, Any]:
    """The AdmissionReview answer for `review`; raises BadReview for a malformed request."""
    req = _request_of(review)
    resp: dict[str, Any] = {"uid": req["uid"], "allowed": True}
    kind = req.get("kind") or {}
    obj = req.get("object")
    if kind.get("kind") != "Pod" or kind.get("group", "") != "" or req.get("operation") != "CREATE" \
            or not isinstance(obj, dict):
        return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": resp}
    namespace = req.get("namespace") or (obj.get("metadata") or {}).get("namespace") or "default"
    try:
        result = arm_pod(obj, namespace, cfg, image)
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
             reason=result.reason, uid=req["uid"])
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": resp}


def make_app(cfg: ArmingConfig | None, image: str) -> web.Application:
    """`/healthz` always; `/mutate` when `cfg` is given (the webhook is enabled)."""
    app = web.Application(client_max_size=MAX_BODY)

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def mutate(request: web.Request) -> web.Response:
        if request.content_type != "application/json":
            return web.json_response({"error": "Content-Type must be application/json"}, status=415)
        review = await web_json.read_json(request, limits.WEBHOOK_BODY)
        try:
            return web.json_response(review_response(review, cfg, image))  # type: ignore[arg-type]
        except BadReview as exc:
            log.warning("review.bad", reason=str(exc))
            return web.json_response({"error": str(exc)}, status=400)

    app.router.add_get("/healthz", healthz)
    if cfg is not None:
        app.router.add_post("/mutate", mutate)
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
        try:
            await asyncio.wait_for(stop.wait(), interval_s)
            return
        except asyncio.TimeoutError:
            pass
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
