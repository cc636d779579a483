"""Async client for the node agent's HTTP API (what the coordinator uses to reach each node).

Errors are typed so the caller can decide without parsing text: `AgentError.kind` is one of
`unreachable` (network, timeout: retry), `unauthorized`, `bad_request` (`.field` names the
offending field; do not retry), `not_found`, `server` (5xx: retry). The API itself is described in
docs/ARCHITECTURE.md ("Node agent API").
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp

from ..models import Dispatch, RegistrationRecord, StepReading, TargetStatus

__all__ = ["AgentClient", "AgentError", "DispatchResult", "WorkerView"]

ErrorKind = Literal["unreachable", "unauthorized", "bad_request", "not_found", "server", "protocol"]


class AgentError(Exception):
    """A call to an agent failed; `.retryable` is True for network faults and 5xx answers."""

    def __init__(self, kind: ErrorKind, message: str, *, status: int | None = None, field: str | None = None):
        super().__init__(message)
        self.kind, self.status, self.field = kind, status, field

    @property
    def retryable(self) -> bool:
        return self.kind in ("unreachable", "server")


@dataclass(frozen=True)
class DispatchResult:
    status: TargetStatus
    created: bool  # False: the agent already had this (capture_id, target_id); the PUT was a no-op


@dataclass(frozen=True)
class WorkerView:
    """One registered worker as the agent sees it: the hook's record, its host pid, and liveness.

    On the wire this is the record with `host_pid` replaced by the pid the agent resolved through
    NSpid (the hook's value is only a hint) and `alive` added.
    """

    record: RegistrationRecord
    host_pid: int | None
    alive: bool
    steps: StepReading | None = None   # its optimizer step count (None: not published, or an older agent)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "WorkerView":
        rec = {k: v for k, v in data.items() if k not in ("alive", "steps")}
        steps = StepReading.from_dict(data["steps"]) if data.get("steps") is not None else None
        return cls(RegistrationRecord.from_dict(rec), data.get("host_pid"), bool(data.get("alive")), steps)


class AgentClient:
    """One agent (`base_url`, e.g. http://10.0.0.5:9451), Bearer `token`, a timeout on every call."""

    def __init__(self, base_url: str, token: str, *, session: aiohttp.ClientSession | None = None,
                 timeout_s: float = 10.0):
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"}
        self._session, self._own_session = session, session is None
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def __aenter__(self) -> "AgentClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    def _sess(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    async def _call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        url = self.base_url + path
        try:
            async with self._sess().request(method, url, json=body, headers=self._headers,
                                            timeout=self._timeout) as resp:
                text = await resp.text()
                try:
                    data = await resp.json(content_type=None) if text else None
                except ValueError:
                    data = None
                status = resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise AgentError("unreachable", f"{method} {url}: {type(exc).__name__}: {exc}") from exc
        if status in (401, 403):
            raise AgentError("unauthorized", f"{method} {url}: HTTP {status}", status=status)
        if status == 404:
            raise AgentError("not_found", f"{method} {url}: HTTP 404", status=status)
        if 400 <= status < 500:
            field = data.get("field") if isinstance(data, dict) else None
            msg = data.get("error") if isinstance(data, dict) else text[:200]
            raise AgentError("bad_request", f"{method} {url}: HTTP {status}: {msg}", status=status, field=field)
        if status >= 500:
            raise AgentError("server", f"{method} {url}: HTTP {status}: {text[:200]}", status=status)
        return status, data

    async def dispatch(self, capture_id: str, target_id: str, dispatch: Dispatch | dict[str, Any]) -> DispatchResult:
        """PUT the target; at-least-once safe: a repeat answers 200 with the current status."""
        body = dispatch.to_dict() if isinstance(dispatch, Dispatch) else dispatch
        status, data = await self._call("PUT", f"/v1/captures/{capture_id}/targets/{target_id}", body)
        try:
            return DispatchResult(TargetStatus.from_dict(data), created=status == 202)
        except Exception as exc:
            raise AgentError("protocol", f"bad dispatch answer from {self.base_url}: {exc}") from exc

    async def status(self, capture_id: str) -> list[TargetStatus] | None:
        """Every target of the capture this agent knows, or None when it never saw the capture."""
        try:
            _, data = await self._call("GET", f"/v1/captures/{capture_id}")
        except AgentError as exc:
            if exc.kind == "not_found":
                return None
            raise
        try:
            return [TargetStatus.from_dict(t) for t in data["targets"]]
        except Exception as exc:
            raise AgentError("protocol", f"bad status answer from {self.base_url}: {exc}") from exc

    async def cancel(self, capture_id: str) -> None:
        """Logical cancel: targets not yet queued end failed(cancelled); queued traces still land."""
        try:
            await self._call("POST", f"/v1/captures/{capture_id}/cancel")
        except AgentError as exc:
            if exc.kind != "not_found":
                raise

    async def workers(self) -> list[WorkerView]:
        _, data = await self._call("GET", "/v1/workers")
        try:
            return [WorkerView.from_dict(w) for w in data["workers"]]
        except Exception as exc:
            raise AgentError("protocol", f"bad workers answer from {self.base_url}: {exc}") from exc

    async def healthy(self) -> bool:
        try:
            async with self._sess().get(self.base_url + "/healthz", timeout=self._timeout) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False
