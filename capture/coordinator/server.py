"""The coordinator's HTTP API (aiohttp): a thin adapter from requests to `Coordinator`.

`/healthz` and `/metrics` need no token (read-only, no ids). Every error is a JSON body with `error` (and `field` for a 400), never a stack trace; an id this
process did not start is answered from the archive when its manifest is there (`from_archive`),
else `404 {"phase": "unknown"}`.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from gpulens.capture.wire import limits, web_json
from gpulens.capture.wire.metrics_http import metrics_route
from gpulens.capture.annotations.render import report_link
from gpulens.capture.models import CaptureRequest
from gpulens.capture.schemas import SchemaError

from ..wire.auth import OPEN_PATHS, Credentials, auth_middleware
from .progress import Phase
from .service import CaptureBusy, Coordinator, RequestMismatch

__all__ = ["make_app", "read_json", "ndjson_line"]

COORDINATOR = web.AppKey("coordinator", Coordinator)
HEARTBEAT_S = web.AppKey("heartbeat_s", float)


def ndjson_line(obj: Any) -> bytes:
    return (json.dumps(obj, separators=(",", ":"), default=str) + "\n").encode()


async def read_json(request: web.Request) -> Any:
    """The body within gpulens.capture.wire.limits.COORDINATOR_BODY (400/413 naming the limit otherwise)."""
    return await web_json.read_json(request, limits.COORDINATOR_BODY)


def _unknown(capture_id: str) -> web.Response:
    return web.json_response({"capture_id": capture_id, "phase": Phase.UNKNOWN,
                              "error": "this coordinator did not start that capture (or has restarted since)"},
                             status=404)


async def healthz(request: web.Request) -> web.Response:
    s = request.app[COORDINATOR].settings
    return web.json_response({"status": "ok", "job_id": s.job_id, "attempt": s.attempt, "namespace": s.namespace})


async def start_capture(request: web.Request) -> web.Response:
    coordinator = request.app[COORDINATOR]
    data = await read_json(request)
    try:
        capture_request = CaptureRequest.from_dict(data)
    except SchemaError as exc:
        return web.json_response({"error": str(exc), "field": exc.field}, status=400)
    try:
        record, created = coordinator.start(capture_request, request.query.get("namespace"))
    except RequestMismatch as exc:
        return web.json_response({"error": str(exc), "field": exc.field}, status=409 if exc.conflict else 400)
    except CaptureBusy as exc:
        return web.json_response({"error": "capture_in_progress", "detail": str(exc),
                                  "capture_id": exc.active.capture_id}, status=409)
    body = {"capture_id": record.capture_id, "status_url": f"/v1/captures/{record.capture_id}",
            "phase": record.phase, "created": created}
    return web.json_response(body, status=202 if created else 200)


def _with_links(coordinator: Coordinator, status: dict[str, Any]) -> dict[str, Any]:
    """Add `report_url`: the browser link the annotation uses (the archive URI stays in report_uri)."""
    s = coordinator.settings
    url = report_link(status.get("report_uri"), s.archive_root, s.report_base_url)
    if url and url != status.get("report_uri"):
        status["report_url"] = url
    return status


async def list_captures(request: web.Request) -> web.Response:
    coordinator = request.app[COORDINATOR]
    records = reversed(list(coordinator.captures.values()))
    live = [_with_links(coordinator, r.to_status(full=False)) for r in records]
    kept = [_with_links(coordinator, c) for c in coordinator.archived_list()]
    return web.json_response({"captures": live + kept})


async def get_capture(request: web.Request) -> web.Response:
    capture_id = request.match_info["capture_id"]
    coordinator = request.app[COORDINATOR]
    record = coordinator.get(capture_id)
    if record is not None:
        return web.json_response(_with_links(coordinator, record.to_status(full=True)))
    archived = await coordinator.archived(capture_id)
    return _unknown(capture_id) if archived is None else web.json_response(_with_links(coordinator, archived))


async def cancel_capture(request: web.Request) -> web.Response:
    capture_id = request.match_info["capture_id"]
    coordinator = request.app[COORDINATOR]
    record = coordinator.cancel(capture_id)
    if record is None:
        archived = await coordinator.archived(capture_id)
        if archived is not None:   # finished before the restart: nothing left to cancel
            return web.json_response(archived)
    return _unknown(capture_id) if record is None else web.json_response(record.to_status(full=False))


async def alert_resolved(request: web.Request) -> web.Response:
    capture_id = request.match_info["capture_id"]
    data = await read_json(request)
    ends_at = data.get("ends_at") if isinstance(data, dict) else None
    if not isinstance(ends_at, str) or not ends_at or len(ends_at) > 64:
        return web.json_response({"error": "ends_at must be a timestamp string", "field": "ends_at"}, status=400)
    record = request.app[COORDINATOR].alert_resolved(capture_id, ends_at)
    return _unknown(capture_id) if record is None else web.json_response(record.to_status(full=False))


async def capture_events(request: web.Request) -> web.StreamResponse:
    """NDJSON: a snapshot, then every change, then `end` once the capture converged (or failed)."""
    capture_id = request.match_info["capture_id"]
    coordinator = request.app[COORDINATOR]
    record = coordinator.get(capture_id)
    if record is None:
        archived = await coordinator.archived(capture_id)
        if archived is None:
            return _unknown(capture_id)
        lines = [ndjson_line({"event": "snapshot", "status": archived}), ndjson_line({"event": "end", "status": archived})]
        return web.Response(body=b"".join(lines), content_type="application/x-ndjson")
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    sub = record.bus.subscribe()  # before the snapshot, so nothing falls between the two
    heartbeat = request.app[HEARTBEAT_S]
    try:
        await resp.write(ndjson_line({"event": "snapshot", "status": record.to_status(full=True)}))
        while record.phase not in Phase.DONE:
            event = await sub.get(timeout=heartbeat)
            await resp.write(ndjson_line(event or {"event": "heartbeat"}))
        await resp.write(ndjson_line({"event": "end", "status": record.to_status(full=False)}))
        await resp.write_eof()
    except (ConnectionResetError, asyncio.CancelledError):
        pass
    finally:
        sub.close()
    return resp


def make_app(coordinator: Coordinator, credentials: Credentials, *, heartbeat_s: float = 15.0) -> web.Application:
    app = web.Application(middlewares=[web_json.json_errors, auth_middleware(credentials, OPEN_PATHS | {"/metrics"})],
                          client_max_size=limits.COORDINATOR_BODY.max_bytes)
    app[COORDINATOR] = coordinator
    app[HEARTBEAT_S] = heartbeat_s
    app.router.add_get("/healthz", healthz)
    # open like /healthz: counts by outcome and reason, no ids (docs/metrics.md)
    app.router.add_get("/metrics", metrics_route(lambda request: request.app[COORDINATOR].metrics))
    app.router.add_post("/v1/captures", start_capture)
    app.router.add_get("/v1/captures", list_captures)
    app.router.add_get("/v1/captures/{capture_id}", get_capture)
    app.router.add_get("/v1/captures/{capture_id}/events", capture_events)
    app.router.add_post("/v1/captures/{capture_id}/cancel", cancel_capture)
    app.router.add_post("/v1/captures/{capture_id}/alert-resolved", alert_resolved)

    async def shutdown(app: web.Application) -> None:
        await coordinator.close()
    app.on_shutdown.append(shutdown)
    return app
