"""The agent's HTTP API (aiohttp): a thin translation between requests and `Agent` calls.

Every route but /healthz and /metrics needs `Authorization: Bearer <token>` (compared in constant
time). /metrics is read-only counts without ids, open like dcgm-exporter's and kube-state-metrics'
(docs/metrics.md says why). Bodies
are limited (`max_body_bytes`, 413 beyond), must be JSON objects, and are validated against
dispatch.schema.json; a 400 answers `{"error": ..., "field": ...}` naming what to fix.
Routes and answers: docs/ARCHITECTURE.md, "Node agent API".
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Awaitable, Callable

from aiohttp import web

from gpulens.ground.logs import get_logger

from .. import schemas
from ..wire import limits, web_json
from ..wire.auth import Credentials, FixedSecret, auth_middleware
from ..wire.metrics_http import metrics_route
from .metrics import AgentMetrics
from .service import Agent, DispatchRefused
from .store import StoreWriteFailed

__all__ = ["make_app", "MAX_BODY_BYTES"]

_log = get_logger("agent")
MAX_BODY_BYTES = limits.AGENT_BODY.max_bytes
AGENT_KEY: web.AppKey[Agent] = web.AppKey("agent", Agent)
LIMIT_KEY: web.AppKey[limits.JsonLimit] = web.AppKey("body_limit", limits.JsonLimit)

OPEN_PATHS = frozenset({"/healthz", "/metrics"})
METRICS_KEY: web.AppKey[AgentMetrics] = web.AppKey("metrics", AgentMetrics)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(status: int, message: str, field: str | None = None) -> web.Response:
    body: dict = {"error": message}
    if field is not None:
        body["field"] = field
    return web.json_response(body, status=status)


@web.middleware
async def _errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status == 413 and exc.content_type != "application/json":  # aiohttp's own, text/plain
            return _error(413, f"body larger than {request.app[LIMIT_KEY].max_bytes} bytes", "")
        if exc.status >= 400 and exc.content_type != "application/json":
            return _error(exc.status, exc.reason)
        raise
    except Exception:  # noqa: BLE001 - an answer, never a dropped connection
        _log.error("api.internal_error", path=request.path, exc_info=True)
        return _error(500, "internal error (see the agent's log)")


async def _read_json(request: web.Request) -> object:
    """The body within gpulens.capture.wire.limits.AGENT_BODY (max_bytes overridable by --max-body-bytes)."""
    return await web_json.read_json(request, request.app[LIMIT_KEY])


async def put_target(request: web.Request) -> web.Response:
    agent = request.app[AGENT_KEY]
    capture_id, target_id = request.match_info["capture_id"], request.match_info["target_id"]
    try:
        body = await _read_json(request)
        status, created = agent.dispatch(capture_id, target_id, body)
    except schemas.SchemaError as exc:
        return _error(400, str(exc), exc.field)
    except DispatchRefused as exc:
        return _error(400, str(exc), exc.field)
    except StoreWriteFailed as exc:  # not the request's fault: the coordinator retries the dispatch
        return _error(503, f"target not accepted: the agent cannot persist it ({exc})")
    return web.json_response(status.to_dict(), status=202 if created else 200)


async def get_capture(request: web.Request) -> web.Response:
    capture_id = request.match_info["capture_id"]
    statuses = request.app[AGENT_KEY].capture(capture_id)
    if statuses is None:
        return _error(404, f"this agent never saw capture {capture_id}")
    return web.json_response({"capture_id": capture_id, "targets": [s.to_dict() for s in statuses]})


async def cancel_capture(request: web.Request) -> web.Response:
    capture_id = request.match_info["capture_id"]
    if not request.app[AGENT_KEY].cancel(capture_id):
        return _error(404, f"this agent never saw capture {capture_id}")
    statuses = request.app[AGENT_KEY].capture(capture_id) or []
    return web.json_response({"capture_id": capture_id, "targets": [s.to_dict() for s in statuses]})


async def get_workers(request: web.Request) -> web.Response:
    workers = await asyncio.to_thread(request.app[AGENT_KEY].worker_views)
    return web.json_response({"workers": workers})


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


def make_app(agent: Agent, token: str, *, max_body_bytes: int = MAX_BODY_BYTES,
             metrics: AgentMetrics | None = None) -> web.Application:
    if not token:
        raise ValueError("the agent API needs a non-empty token")
    auth = auth_middleware(Credentials(tokens=(FixedSecret(token),)), OPEN_PATHS, realm="gpulens-agent",
                           on_refused=lambda r: _log.warning("api.unauthorized", path=r.path, peer=r.remote))
    app = web.Application(middlewares=[_errors_middleware, auth], client_max_size=max_body_bytes)
    app[AGENT_KEY] = agent
    app[LIMIT_KEY] = dataclasses.replace(limits.AGENT_BODY, max_bytes=max_body_bytes)
    app.router.add_put("/v1/captures/{capture_id}/targets/{target_id}", put_target)
    app.router.add_get("/v1/captures/{capture_id}", get_capture)
    app.router.add_post("/v1/captures/{capture_id}/cancel", cancel_capture)
    app.router.add_get("/v1/workers", get_workers)
    app.router.add_get("/healthz", healthz)
    app[METRICS_KEY] = metrics if metrics is not None else agent.pipeline.metrics
    app.router.add_get("/metrics", metrics_route(lambda request: request.app[METRICS_KEY]))
    return app
