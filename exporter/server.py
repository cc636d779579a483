"""HTTP: /metrics (Prometheus text or OpenMetrics, by Accept; gzip by Accept-Encoding) and /healthz.

/metrics serves the bytes the discovery tick encoded (exporter/exposition.py); only when they are
missing or stale does the request encode, in a worker thread, so the event loop never blocks on
BPF maps, /proc or encoding.
"""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

__all__ = ["make_app"]


def _accepts_gzip(header: str) -> bool:
    for part in header.split(","):
        coding, _, params = part.strip().partition(";")
        if coding.strip().lower() in ("gzip", "*"):
            q = params.strip()
            return not (q.startswith("q=") and q[2:].strip() in ("0", "0.0", "0.00", "0.000"))
    return False


def make_app(exporter) -> web.Application:
    async def metrics(request: web.Request) -> web.Response:
        gz = _accepts_gzip(request.headers.get("Accept-Encoding", ""))
        body = await asyncio.to_thread(exporter.exposition.body, request.headers.get("Accept", ""), gz)
        headers = {"Content-Type": body.content_type, "Vary": "Accept, Accept-Encoding"}
        if body.gzipped:
            headers["Content-Encoding"] = "gzip"
        return web.Response(body=body.data, headers=headers)

    async def healthz(request: web.Request) -> web.Response:
        sources = {h.name: {"state": h.view()[0], "reason": h.view()[1]} for h in exporter.health.values()}
        return web.Response(text=json.dumps({"status": "ok", "node": exporter.config.node, "sources": sources}),
                            content_type="application/json")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    return app
