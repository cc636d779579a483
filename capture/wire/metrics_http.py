"""A component's own Prometheus metrics and the `/metrics` route that serves them (the node agent's
and each coordinator's; the exporter has its own, as exporter and capture share nothing).

Each component instance owns a `CollectorRegistry`, never the global one, so two in one process
(the tests) never share a counter. Text format 0.0.4, as the exporter serves: Debian's Prometheus
2.42 reads it. `/metrics` needs no token (docs/metrics.md says why); the apps open the path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Awaitable, Callable

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

__all__ = ["CONTENT_TYPE", "OwnMetrics", "metrics_route"]

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4


@dataclass
class OwnMetrics:
    """Base of AgentMetrics and CoordinatorMetrics: the registry their counters are created in."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def metrics_route(metrics_of: Callable[[web.Request], OwnMetrics]) -> Callable[[web.Request], Awaitable[web.Response]]:
    """The GET /metrics handler of an app whose metrics `metrics_of(request)` finds."""
    async def get_metrics(request: web.Request) -> web.Response:
        return web.Response(body=metrics_of(request).exposition(), headers={"Content-Type": CONTENT_TYPE})
    return get_metrics
