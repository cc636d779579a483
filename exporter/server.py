"""HTTP: /metrics (Prometheus text or OpenMetrics, by Accept) and /healthz.

Collection reads BPF maps and /proc, which block, so it runs in a worker thread; the handler only
turns a request into a response (client_python's exposition functions do the encoding).
"""

from __future__ import annotations

import asyncio
import json

from aiohttp import web
from prometheus_client.exposition import choose_encoder

__all__ = ["make_app"]


def make_app(exporter) -> web.Application:
    async def metrics(request: web.Request) -> web.Response:
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        body = await asyncio.to_thread(encoder, exporter.registry)
        resp = web.Response(body=body, headers={"Content-Type": content_type})
        resp.enable_compression()
        return resp

    async def healthz(request: web.Request) -> web.Response:
        sources = {h.name: {"state": h.view()[0], "reason": h.view()[1]} for h in exporter.health.values()}
        return web.Response(text=json.dumps({"status": "ok", "node": exporter.config.node, "sources": sources}),
                            content_type="application/json")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    return app
