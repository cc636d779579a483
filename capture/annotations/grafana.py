"""Grafana's annotation API over aiohttp: create (POST), update (PATCH), find by tag (GET).

Auth is a service-account token (`Authorization: Bearer`, read from a file each time so a
rotation needs no restart); `X-Grafana-Org-Id` selects an organisation when one is given.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from .model import Annotation, AnnotationError, AnnotationGone

__all__ = ["GrafanaSink"]


class GrafanaSink:
    def __init__(self, session: aiohttp.ClientSession, base_url: str, token=None, *, org_id: int | None = None,
                 timeout_s: float = 10.0):
        self.name = "grafana"
        self._session, self.base_url, self._token, self._org = session, base_url.rstrip("/"), token, org_id
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    def _headers(self) -> dict[str, str]:
        h = {"Accept": "application/json"}
        if self._token is not None:
            h["Authorization"] = f"Bearer {self._token.read()}"
        if self._org is not None:
            h["X-Grafana-Org-Id"] = str(self._org)
        return h

    async def _call(self, method: str, path: str, body: Any = None, params: Any = None) -> Any:
        url = self.base_url + path
        try:
            async with self._session.request(method, url, json=body, params=params, headers=self._headers(),
                                             timeout=self._timeout) as resp:
                text = await resp.text()
                if resp.status == 404 and method == "PATCH":
                    raise AnnotationGone(f"{method} {path}: 404 {text[:200]}")
                if resp.status >= 300:
                    raise AnnotationError(f"{method} {path}: HTTP {resp.status} {text[:200]}",
                                          ambiguous=resp.status >= 500 and method == "POST")
                try:
                    return json.loads(text) if text else {}
                except ValueError as exc:
                    raise AnnotationError(f"{method} {path}: answer is not JSON", ambiguous=method == "POST") from exc
        except asyncio.TimeoutError as exc:
            raise AnnotationError(f"{method} {path}: timed out", ambiguous=True) from exc
        except aiohttp.ClientError as exc:
            # the request may have reached Grafana unless the connection itself failed
            ambiguous = not isinstance(exc, aiohttp.ClientConnectorError)
            raise AnnotationError(f"{method} {path}: {type(exc).__name__}: {exc}", ambiguous=ambiguous) from exc

    async def create(self, annotation: Annotation) -> int:
        data = await self._call("POST", "/api/annotations", annotation.create_body())
        ann_id = data.get("id") if isinstance(data, dict) else None
        if not isinstance(ann_id, int):
            raise AnnotationError(f"POST /api/annotations: answer has no id: {str(data)[:200]}", ambiguous=True)
        return ann_id

    async def update(self, annotation_id: int, annotation: Annotation) -> None:
        await self._call("PATCH", f"/api/annotations/{int(annotation_id)}", annotation.patch_body())

    async def find(self, tag: str) -> int | None:
        data = await self._call("GET", "/api/annotations", params=[("tags", tag), ("limit", "10"), ("type", "annotation")])
        items = [a for a in data if isinstance(a, dict) and isinstance(a.get("id"), int)] if isinstance(data, list) else []
        return min((a["id"] for a in items), default=None)
