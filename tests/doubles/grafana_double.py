"""A test double for Grafana's legacy annotations HTTP API, checking the contract as it serves it.

It stands for Grafana 9-12's `/api/annotations` as documented (reference/ecosystem-conventions.md
section 2.1; grafana/grafana docs/sources/developers/http_api/annotations.md): service-account
bearer auth; `POST /api/annotations` with `text` required, `time`/`timeEnd` in epoch
milliseconds, `tags` a list of strings, optional `dashboardUID`/`panelId`, answering
`200 {"message": "Annotation added", "id": N}`; `PATCH /api/annotations/:id` (text, tags, time,
timeEnd; `404` for an unknown id; `200 {"message": "Annotation patched"}`); `GET
/api/annotations?tags=a&tags=b&limit=N` (tags ANDed). Unknown body fields are ignored, as
Grafana's JSON decoding ignores them.

Where it is stricter than Grafana, on purpose (each one is a bug in a client): a time that is
not an integer is refused (Grafana's int64 fields refuse it too), a time below 1e11 is refused
as "seconds, not milliseconds" (Grafana would silently file it in 1973), `timeEnd < time` is
refused, and a `text` with a `<script>` is refused (Grafana sanitizes; a client must escape).

Faults for tests: `fail_next(n, status)` answers the next n writes with an error without
applying them; `slow_next(n, seconds)` applies the write, then answers late (a client timing out
cannot know it landed); `down` answers 503 to everything.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

_SCRIPT = re.compile(r"<\s*script", re.I)


@dataclass
class GrafanaDouble:
    token: str
    annotations: dict[int, dict[str, Any]] = field(default_factory=dict)
    requests: list[tuple[str, str, Any]] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)   # (path, why) of every 400
    down: bool = False
    _fail: list[int] = field(default_factory=list)
    _slow: list[float] = field(default_factory=list)
    _next_id: int = 1

    def fail_next(self, n: int, status: int = 500) -> None:
        self._fail.extend([status] * n)

    def slow_next(self, n: int, seconds: float) -> None:
        self._slow.extend([seconds] * n)

    def with_tag(self, tag: str) -> list[dict[str, Any]]:
        return [a for a in self.annotations.values() if tag in a["tags"]]

    # --- contract ----------------------------------------------------------------------------

    def _bad(self, request: web.Request, why: str) -> web.Response:
        self.refused.append((request.path, why))
        return web.json_response({"message": why}, status=400)

    @staticmethod
    def _check_time(body: dict[str, Any], key: str) -> str | None:
        if key not in body:
            return None
        v = body[key]
        if isinstance(v, bool) or not isinstance(v, int):
            return f"{key} must be an integer (epoch milliseconds), got {v!r}"
        if v < 100_000_000_000:
            return f"{key}={v} looks like seconds, not milliseconds"
        return None

    def _check_common(self, body: dict[str, Any], require_text: bool) -> str | None:
        if require_text and (not isinstance(body.get("text"), str) or not body["text"].strip()):
            return "text is required"
        if "text" in body and (not isinstance(body["text"], str) or _SCRIPT.search(body["text"])):
            return "text must be a string of sanitizable HTML (no <script>)"
        for key in ("time", "timeEnd"):
            problem = self._check_time(body, key)
            if problem:
                return problem
        if "tags" in body and (not isinstance(body["tags"], list) or not all(isinstance(t, str) for t in body["tags"])):
            return "tags must be a list of strings"
        if "dashboardUID" in body and not isinstance(body["dashboardUID"], str):
            return "dashboardUID must be a string"
        if "panelId" in body and (isinstance(body["panelId"], bool) or not isinstance(body["panelId"], int)):
            return "panelId must be an integer"
        return None

    async def _body(self, request: web.Request) -> dict[str, Any] | None:
        try:
            body = await request.json()
        except ValueError:
            return None
        return body if isinstance(body, dict) else None

    async def _fault(self) -> web.Response | None:
        if self._fail:
            status = self._fail.pop(0)
            return web.json_response({"message": "double: injected failure"}, status=status)
        return None

    async def _answer(self, response: web.Response) -> web.Response:
        if self._slow:
            await asyncio.sleep(self._slow.pop(0))
        return response

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        self.requests.append((request.method, request.path_qs, None))
        if self.down:
            return web.json_response({"message": "double: down"}, status=503)
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response({"message": "Unauthorized"}, status=401)
        return await handler(request)

    async def create(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if body is None:
            return self._bad(request, "bad request data")
        self.requests[-1] = (request.method, request.path_qs, body)
        fault = await self._fault()
        if fault:
            return fault
        problem = self._check_common(body, require_text=True)
        if not problem and "timeEnd" in body and body["timeEnd"] < body.get("time", 0):
            problem = "timeEnd is before time"
        if problem:
            return self._bad(request, problem)
        ann_id, self._next_id = self._next_id, self._next_id + 1
        self.annotations[ann_id] = {"id": ann_id, "time": body.get("time", 0), "timeEnd": body.get("timeEnd", body.get("time", 0)),
                                    "tags": list(body.get("tags", [])), "text": body["text"],
                                    "dashboardUID": body.get("dashboardUID", ""), "panelId": body.get("panelId", 0)}
        return await self._answer(web.json_response({"message": "Annotation added", "id": ann_id}))

    async def patch(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if body is None:
            return self._bad(request, "bad request data")
        self.requests[-1] = (request.method, request.path_qs, body)
        fault = await self._fault()
        if fault:
            return fault
        try:
            ann_id = int(request.match_info["id"])
        except ValueError:
            return self._bad(request, "annotationId is invalid")
        if ann_id not in self.annotations:
            return web.json_response({"message": "Annotation not found"}, status=404)
        problem = self._check_common(body, require_text=False)
        current = self.annotations[ann_id]
        start, end = body.get("time", current["time"]), body.get("timeEnd", current["timeEnd"])
        if not problem and end < start:
            problem = "timeEnd is before time"
        if problem:
            return self._bad(request, problem)
        for key in ("text", "tags", "time", "timeEnd"):
            if key in body:
                current[key] = body[key]
        return await self._answer(web.json_response({"message": "Annotation patched"}))

    async def search(self, request: web.Request) -> web.Response:
        tags = request.query.getall("tags", [])
        try:
            limit = int(request.query.get("limit", "100"))
        except ValueError:
            return self._bad(request, "limit must be an integer")
        found = [dict(a) for a in sorted(self.annotations.values(), key=lambda a: -a["time"])
                 if all(t in a["tags"] for t in tags)]
        return web.json_response(found[:limit])

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware])
        app.router.add_post("/api/annotations", self.create)
        app.router.add_patch("/api/annotations/{id}", self.patch)
        app.router.add_get("/api/annotations", self.search)
        return app


class RunningGrafana:
    """A GrafanaDouble on 127.0.0.1 (free port) in the test's event loop."""

    def __init__(self, double: GrafanaDouble):
        self.double, self.url, self._runner = double, "", None

    async def __aenter__(self) -> "RunningGrafana":
        self._runner = web.AppRunner(self.double.app(), access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        await self._runner.cleanup()
