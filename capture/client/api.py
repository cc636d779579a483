"""An async client for the capture API that coordinators and the gateway both serve.

Used by the `gpulens capture` CLI and by the gateway when it forwards to a coordinator. Errors
keep the HTTP status and the server's JSON body, so callers can tell "unknown capture" (404)
from "busy" (409) from "unreachable" (`ApiUnavailable`: transport error, timeout or 5xx).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator
from urllib.parse import quote

import aiohttp

__all__ = ["CaptureApi", "ApiError", "ApiUnavailable", "MAX_EVENT_BYTES"]

MAX_EVENT_BYTES = 64 << 20


class ApiError(Exception):
    """The server answered with an error status; `.status` and `.body` say what it said."""

    def __init__(self, status: int, body: Any, url: str, cause: BaseException | None = None):
        detail = body.get("error") if isinstance(body, dict) else body
        super().__init__(f"{url}: HTTP {status}: {str(detail)[:300]}")
        self.status, self.body, self.url = status, body, url
        #: the transport error behind a status-0 answer (refused, timeout, bad URL), for people's messages
        self.cause = cause


class ApiUnavailable(ApiError):
    """No usable answer (connection refused, timeout, 5xx): trying again later may work."""


class CaptureApi:
    def __init__(self, session: aiohttp.ClientSession, base_url: str, token: str | None, *, timeout_s: float = 10.0):
        self._session, self.base_url, self._token = session, base_url.rstrip("/"), token
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=min(3.0, timeout_s))

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._token}"} if self._token else {}

    def _url(self, path: str) -> str:
        return self.base_url + path

    @staticmethod
    def _cid(capture_id: str) -> str:
        return quote(capture_id, safe="")

    async def request(self, method: str, path: str, body: Any = None, params: dict[str, str] | None = None,
                      ok: tuple[int, ...] = (200, 201, 202)) -> tuple[int, Any]:
        url = self._url(path)
        try:
            async with self._session.request(method, url, json=body, params=params, headers=self._headers(),
                                             timeout=self._timeout) as resp:
                text = await resp.text()
                try:
                    data = json.loads(text) if text else None
                except ValueError:
                    data = text
                if resp.status in ok:
                    return resp.status, data
                cls = ApiUnavailable if resp.status >= 500 else ApiError
                raise cls(resp.status, data, url)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise ApiUnavailable(0, f"{type(exc).__name__}: {exc}", url, exc) from exc

    async def start(self, request: dict[str, Any], *, namespace: str | None = None,
                    pod: str | None = None, workload: str | None = None) -> tuple[int, dict[str, Any]]:
        params = {k: v for k, v in (("namespace", namespace), ("pod", pod), ("workload", workload)) if v}
        return await self.request("POST", "/v1/captures", request, params=params or None)

    async def status(self, capture_id: str) -> dict[str, Any]:
        return (await self.request("GET", f"/v1/captures/{self._cid(capture_id)}"))[1]

    async def list(self, **params: str) -> dict[str, Any]:
        return (await self.request("GET", "/v1/captures", params={k: v for k, v in params.items() if v} or None))[1]

    async def cancel(self, capture_id: str) -> dict[str, Any]:
        return (await self.request("POST", f"/v1/captures/{self._cid(capture_id)}/cancel"))[1]

    async def alert_resolved(self, capture_id: str, ends_at: str) -> dict[str, Any]:
        return (await self.request("POST", f"/v1/captures/{self._cid(capture_id)}/alert-resolved",
                                   {"ends_at": ends_at}))[1]

    async def events(self, capture_id: str, *, idle_timeout_s: float = 60.0) -> AsyncIterator[dict[str, Any]]:
        """The NDJSON event stream; ends after the `end` event (or raises ApiUnavailable if cut)."""
        url = self._url(f"/v1/captures/{self._cid(capture_id)}/events")
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=3.0, sock_read=idle_timeout_s)
        try:
            async with self._session.get(url, headers=self._headers(), timeout=timeout) as resp:
                if resp.status != 200:
                    text = await resp.text()
                    try:
                        data = json.loads(text)
                    except ValueError:
                        data = text
                    raise (ApiUnavailable if resp.status >= 500 else ApiError)(resp.status, data, url)
                buffer = b""
                async for chunk in resp.content.iter_any():  # snapshot lines can exceed aiohttp's line limit
                    buffer += chunk
                    *lines, buffer = buffer.split(b"\n")
                    if len(buffer) > MAX_EVENT_BYTES:
                        raise ApiUnavailable(0, f"an event is larger than {MAX_EVENT_BYTES} bytes", url)
                    for line in lines:
                        if not line.strip():
                            continue
                        try:
                            event = json.loads(line)
                        except ValueError:
                            continue
                        yield event
                        if event.get("event") == "end":
                            return
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise ApiUnavailable(0, f"event stream cut: {type(exc).__name__}: {exc}", url, exc) from exc
        raise ApiUnavailable(0, "event stream ended before the capture did", url)
