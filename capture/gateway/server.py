"""The gateway's HTTP API: the Alertmanager webhook, manual requests, and the capture API of
whichever coordinator holds a capture (so `gpulens capture --url <gateway>` works for any job).

Status codes for Alertmanager: 200 once every alert is handled (started, a repeat, cooled down,
ignored or unroutable: retrying changes none of these), 400 for a body that is not a v4 payload,
401 for bad credentials, 503 only when a coordinator could not be reached (a retry may work).
"""

from __future__ import annotations

import asyncio
import json
from typing import Callable

import aiohttp
from aiohttp import web

from gpulens.capture.wire import limits, web_json
from gpulens.capture.client.api import ApiError, ApiUnavailable, CaptureApi
from gpulens.capture.wire.auth import Credentials, auth_middleware
from gpulens.ground.logs import get_logger

from .alertmanager import PayloadError, parse_payload
from .handling import Gateway

__all__ = ["make_app"]

log = get_logger("gateway")

GATEWAY = web.AppKey("gateway", Gateway)
SESSION = web.AppKey("session", aiohttp.ClientSession)
API_FOR = web.AppKey("api_for", Callable)


def _unknown(capture_id: str) -> web.Response:
    return web.json_response({"capture_id": capture_id, "phase": "unknown",
                              "error": "no known coordinator holds this capture"}, status=404)


async def _json(request: web.Request):
    return await web_json.read_json(request, limits.GATEWAY_BODY)


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def alertmanager(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY]
    try:
        alerts = parse_payload(await _json(request))
    except PayloadError as exc:
        log.warning("webhook.bad_payload", field=exc.field, error=str(exc))
        return web.json_response({"error": str(exc), "field": exc.field}, status=400)
    try:
        outcomes = await gateway.handle_alerts(alerts)
    except OSError as exc:  # the ledger could not be written: nothing is durable, so ask for a retry
        return web.json_response({"error": f"state not writable: {exc}"}, status=503)
    retry = any(o.retryable for o in outcomes)
    log.info("webhook.handled", alerts=len(alerts), outcomes=",".join(o.outcome for o in outcomes) or None,
             status=503 if retry else 200)
    return web.json_response({"results": [o.to_dict() for o in outcomes]}, status=503 if retry else 200)


async def start_capture(request: web.Request) -> web.Response:
    try:
        status, body = await request.app[GATEWAY].manual(await _json(request), request.query.get("namespace"),
                                                         request.query.get("pod"), request.query.get("workload"))
    except OSError as exc:
        return web.json_response({"error": f"state not writable: {exc}"}, status=503)
    return web.json_response(body, status=status)


async def _coordinator(request: web.Request) -> tuple[str, CaptureApi | None]:
    capture_id = request.match_info["capture_id"]
    url = await request.app[GATEWAY].coordinator_of(capture_id)
    return capture_id, (request.app[API_FOR](url) if url else None)


def _relay(exc: ApiError) -> web.Response:
    if isinstance(exc, ApiUnavailable):
        return web.json_response({"error": "the capture's coordinator is unavailable", "detail": str(exc)}, status=502)
    return web.json_response(exc.body if isinstance(exc.body, dict) else {"error": str(exc)}, status=exc.status)


async def get_capture(request: web.Request) -> web.Response:
    capture_id, api = await _coordinator(request)
    if api is None:
        return _unknown(capture_id)
    try:
        return web.json_response(await api.status(capture_id))
    except ApiError as exc:
        return _relay(exc)


async def cancel_capture(request: web.Request) -> web.Response:
    capture_id, api = await _coordinator(request)
    if api is None:
        return _unknown(capture_id)
    try:
        return web.json_response(await api.cancel(capture_id))
    except ApiError as exc:
        return _relay(exc)


async def capture_events(request: web.Request) -> web.StreamResponse:
    capture_id, api = await _coordinator(request)
    if api is None:
        return _unknown(capture_id)
    resp: web.StreamResponse | None = None
    try:
        async for event in api.events(capture_id):
            if resp is None:
                resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson", "Cache-Control": "no-cache"})
                await resp.prepare(request)
            await resp.write((json.dumps(event, separators=(",", ":")) + "\n").encode())
    except ApiError as exc:
        if resp is None:
            return _relay(exc)
        await resp.write((json.dumps({"event": "error", "error": str(exc)}) + "\n").encode())
    except (ConnectionResetError, asyncio.CancelledError):
        return resp or web.Response(status=499)
    await resp.write_eof()
    return resp


async def list_captures(request: web.Request) -> web.Response:
    """One job's captures (?namespace=&job_id=), else every capture this gateway started or can see."""
    gateway, api_for = request.app[GATEWAY], request.app[API_FOR]
    ns, job = request.query.get("namespace"), request.query.get("job_id")
    if ns and job:
        try:
            return web.json_response(await api_for(gateway.router.resolve(ns, job).url).list())
        except ApiError as exc:
            return _relay(exc)
        except Exception as exc:  # Unroutable
            return web.json_response({"error": str(exc)}, status=404)
    urls = set(gateway.router.routes().values()) | {c.coordinator_url for c in gateway.ledger.captures.values()}
    seen, errors = {}, []

    async def one(url: str) -> None:
        try:
            for c in (await api_for(url).list()).get("captures", []):
                seen[c.get("capture_id")] = c
        except ApiError as exc:
            errors.append(str(exc))
    await asyncio.gather(*(one(u) for u in sorted(urls)))
    for c in gateway.ledger.captures.values():  # started here, but its coordinator is gone or silent
        seen.setdefault(c.capture_id, {"capture_id": c.capture_id, "namespace": c.namespace, "job_id": c.job_id,
                                       "phase": "unknown", "requested_at": c.started_at, "reason": c.reason})
    captures = sorted(seen.values(), key=lambda c: str(c.get("capture_id")), reverse=True)
    return web.json_response({"captures": captures, "errors": errors})


def make_app(gateway: Gateway, credentials: Credentials, api_for: Callable[[str], CaptureApi]) -> web.Application:
    app = web.Application(middlewares=[web_json.json_errors, auth_middleware(credentials)], client_max_size=limits.GATEWAY_BODY.max_bytes)
    app[GATEWAY] = gateway
    app[API_FOR] = api_for
    app.router.add_get("/healthz", healthz)
    app.router.add_post("/v1/alertmanager", alertmanager)
    app.router.add_post("/v1/captures", start_capture)
    app.router.add_get("/v1/captures", list_captures)
    app.router.add_get("/v1/captures/{capture_id}", get_capture)
    app.router.add_get("/v1/captures/{capture_id}/events", capture_events)
    app.router.add_post("/v1/captures/{capture_id}/cancel", cancel_capture)
    return app
