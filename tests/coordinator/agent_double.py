"""A test double for the node agent's HTTP API (docs/ARCHITECTURE.md, "Node agent API").

It stands for `gpulens agent` as the coordinator sees it over HTTP, and follows the documented
protocol: bearer auth (401), `PUT /v1/captures/{c}/targets/{t}` validated against
dispatch.schema.json (400 naming the field; 202 with a TargetStatus when new, 200 with the
current status when repeated), `GET /v1/captures/{c}` (404 when never seen), `POST .../cancel`
(targets not yet queued end `failed(cancelled)`), `GET /v1/workers`. Every status it sends is
validated against target_status.schema.json before it leaves, so the double cannot drift from
the contract.

Instead of dynolog and Kineto it moves each target through the states on a clock: dispatched ->
queued_by_dynolog -> trace_observed -> verified -> archived, writing a small real trace file
into the `file://` archive (size and sha256 are the file's). `outcome(dispatch, target_id)` can
script a failure or a hang per target; `down` makes it answer 503, `black_hole` makes it accept
connections and never answer (a node that silently drops packets), `forget()` drops its state.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable
from urllib.parse import unquote, urlparse

from aiohttp import web

from gpulens.capture.models import Artifact, Dispatch, FailureReason, TargetState, TargetStatus
from gpulens.capture.schemas import SchemaError

STEPS = (TargetState.QUEUED_BY_DYNOLOG, TargetState.TRACE_OBSERVED, TargetState.VERIFIED, TargetState.ARCHIVED)


def tiny_trace(rank: int, pid: int) -> bytes:
    events = [{"ph": "X", "cat": "cpu_op", "name": f"aten::mm", "pid": pid, "tid": 1, "ts": 1000 + 10 * i, "dur": 5,
               "args": {}} for i in range(20)]
    return json.dumps({"schemaVersion": 1, "deviceProperties": [], "trace_id": f"T{rank}", "displayTimeUnit": "ms",
                       "baseTimeNanoseconds": 1_700_000_000_000_000_000, "traceEvents": events,
                       "traceName": f"rank{rank}"}).encode()


@dataclass
class _Entry:
    dispatch: Dispatch
    accepted_at: float
    outcome: Any
    status: TargetStatus


@dataclass
class AgentDouble:
    node: str
    token: str
    step_s: float = 0.05                    # time between two state steps
    workers: list[dict[str, Any]] = field(default_factory=list)
    outcome: Callable[[Dispatch, str], Any] | None = None   # None/"archive" | ("fail", reason, detail) | "hang"
    down: bool = False
    black_hole: bool = False
    captures: dict[str, dict[str, _Entry]] = field(default_factory=dict)
    requests: list[tuple[str, str]] = field(default_factory=list)
    dispatches: list[tuple[str, str]] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)

    def forget(self) -> None:
        self.captures.clear()

    # --- state machine -----------------------------------------------------------------------

    def _advance(self, capture_id: str, target_id: str, e: _Entry) -> None:
        if e.status.terminal:
            return
        if e.outcome == "hang":
            e.status = TargetStatus(target_id, TargetState.QUEUED_BY_DYNOLOG)
            return
        if isinstance(e.outcome, tuple) and e.outcome[0] == "fail":
            _, reason, detail = e.outcome
            e.status = TargetStatus(target_id, TargetState.FAILED, FailureReason(reason), detail)
            return
        steps = int((time.time() - e.accepted_at) / self.step_s) if self.step_s > 0 else len(STEPS)
        if time.time() > e.dispatch.deadline:
            e.status = TargetStatus(target_id, TargetState.FAILED, FailureReason.TRACE_TIMEOUT, "double: deadline")
            return
        state = STEPS[min(steps, len(STEPS)) - 1] if steps > 0 else TargetState.DISPATCHED
        artifact = self._archive(capture_id, target_id, e.dispatch) if state == TargetState.ARCHIVED else None
        e.status = TargetStatus(target_id, state, artifact=artifact)

    def _archive(self, capture_id: str, target_id: str, d: Dispatch) -> Artifact:
        pid = 1000 + d.rank
        data = tiny_trace(d.rank, pid)
        uri = f"{d.archive_prefix.rstrip('/')}/traces/{target_id}.json"
        if uri.startswith("file://"):
            path = Path(unquote(urlparse(uri).path))
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        return Artifact(target_id=target_id, rank=d.rank, local_rank=d.local_rank or 0, node=self.node,
                        pod=d.pod or "", pid=pid, attempt=d.attempt, uri=uri, size=len(data),
                        sha256=hashlib.sha256(data).hexdigest(), trace_id=f"T{d.rank}")

    # --- HTTP --------------------------------------------------------------------------------

    def _ok_auth(self, request: web.Request) -> bool:
        return request.headers.get("Authorization") == f"Bearer {self.token}"

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        self.requests.append((request.method, request.path))
        if self.black_hole:
            await asyncio.sleep(3600)
        if request.path == "/healthz":
            return web.json_response({"status": "ok"})
        if not self._ok_auth(request):
            return web.json_response({"error": "unauthorized"}, status=401)
        if self.down:
            return web.json_response({"error": "double: down"}, status=503)
        return await handler(request)

    async def put_target(self, request: web.Request) -> web.Response:
        cid, tid = request.match_info["capture_id"], request.match_info["target_id"]
        try:
            d = Dispatch.from_dict(await request.json())
        except SchemaError as exc:
            return web.json_response({"error": str(exc), "field": exc.field}, status=400)
        except ValueError:
            return web.json_response({"error": "not JSON"}, status=400)
        self.dispatches.append((cid, tid))
        entries = self.captures.setdefault(cid, {})
        if tid in entries:
            self._advance(cid, tid, entries[tid])
            return web.json_response(entries[tid].status.to_dict(), status=200)
        outcome = self.outcome(d, tid) if self.outcome else None
        e = _Entry(d, time.time(), outcome, TargetStatus(tid, TargetState.DISPATCHED))
        entries[tid] = e
        self._advance(cid, tid, e)
        return web.json_response(self._checked(e.status), status=202)

    async def get_capture(self, request: web.Request) -> web.Response:
        cid = request.match_info["capture_id"]
        if cid not in self.captures:
            return web.json_response({"error": "unknown capture"}, status=404)
        for tid, e in self.captures[cid].items():
            self._advance(cid, tid, e)
        return web.json_response({"capture_id": cid,
                                  "targets": [self._checked(e.status) for e in self.captures[cid].values()]})

    async def cancel(self, request: web.Request) -> web.Response:
        cid = request.match_info["capture_id"]
        self.cancels.append(cid)
        for tid, e in self.captures.get(cid, {}).items():
            self._advance(cid, tid, e)
            if e.status.state in (TargetState.PENDING, TargetState.DISPATCHED, TargetState.NOT_MATCHED,
                                  TargetState.WAITING_FOR_SLOT):
                e.status = TargetStatus(tid, TargetState.FAILED, FailureReason.CANCELLED, "double: cancelled")
                e.outcome = ("fail", "cancelled", "double: cancelled")
        return web.json_response({"capture_id": cid})

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def list_workers(self, request: web.Request) -> web.Response:
        return web.json_response({"workers": self.workers})

    @staticmethod
    def _checked(status: TargetStatus) -> dict[str, Any]:
        d = status.to_dict()
        TargetStatus.from_dict(d)  # raises if the double ever broke the schema
        return d

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware])
        app.router.add_get("/healthz", self.healthz)
        app.router.add_put("/v1/captures/{capture_id}/targets/{target_id}", self.put_target)
        app.router.add_get("/v1/captures/{capture_id}", self.get_capture)
        app.router.add_post("/v1/captures/{capture_id}/cancel", self.cancel)
        app.router.add_get("/v1/workers", self.list_workers)
        return app


class RunningAgent:
    """An AgentDouble served on 127.0.0.1 (free port) in the test's event loop."""

    def __init__(self, double: AgentDouble):
        self.double = double
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def __aenter__(self) -> "RunningAgent":
        self.runner = web.AppRunner(self.double.app(), access_log=None, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc) -> None:
        self.double.black_hole = False
        await self.runner.cleanup()
