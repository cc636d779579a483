"""Read an aiohttp request's JSON body within a `gpulens.capture.wire.limits.JsonLimit` (the one way every API does).

Answers, as JSON `{"error", "field": "", "limit"}`: 413 over `max_bytes` (also for chunked bodies,
which aiohttp bounds by `client_max_size`), 400 over `max_depth` or for a body that is not JSON.
Kept apart from capture/wire/limits.py so the analysis can use the limits without importing aiohttp.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from .limits import JsonLimit, JsonLimitError, loads

__all__ = ["read_json", "body_error", "json_errors"]


def body_error(status: int, message: str, limit: str | None = None) -> web.HTTPException:
    body: dict[str, Any] = {"error": message, "field": ""}
    if limit:
        body["limit"] = limit
    if status == 413:  # max_size/actual_size only feed aiohttp's default text, replaced here
        return web.HTTPRequestEntityTooLarge(max_size=0, actual_size=0, text=json.dumps(body),
                                             content_type="application/json")
    return web.HTTPBadRequest(text=json.dumps(body), content_type="application/json")


async def read_json(request: web.Request, limit: JsonLimit) -> Any:
    """The parsed body, or raise a 400/413 HTTPException with a JSON body naming the limit."""
    over = JsonLimitError("max_bytes", limit.max_bytes, request.content_length or 0, limit.what)
    if request.content_length is not None and request.content_length > limit.max_bytes:
        raise body_error(413, str(over), "max_bytes")
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:  # a chunked body past client_max_size
        raise body_error(413, f"{limit.what} is larger than max_bytes={limit.max_bytes}", "max_bytes") from None
    try:
        return loads(raw, limit)
    except JsonLimitError as exc:
        raise body_error(413 if exc.limit == "max_bytes" else 400, str(exc), exc.limit) from exc
    except ValueError as exc:  # includes UnicodeDecodeError
        raise body_error(400, f"body is not JSON: {exc}") from exc


@web.middleware
async def json_errors(request: web.Request, handler) -> web.StreamResponse:
    """Router-level refusals (404 unknown path, 405 method) as JSON bodies too, like every other error."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status >= 400 and exc.content_type != "application/json":
            return web.json_response({"error": exc.reason}, status=exc.status, headers={
                k: v for k, v in exc.headers.items() if k.lower() == "allow"})
        raise
