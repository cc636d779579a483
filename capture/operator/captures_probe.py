"""Reads a coordinator's capture list for its CaptureCoordinator status (`lastCaptures`).

Slow path only: the operator asks at resync time, with a short timeout, and any failure just
leaves the status as it was. Coordinators never call the Kubernetes API themselves (DESIGN.md:
the hot path never writes to it), so this is how `kubectl get capco -o yaml` shows recent captures.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any, Callable, Mapping

from gpulens.ground.logs import get_logger

from ..coordinator.progress import Phase

__all__ = ["http_captures", "CapturesFetcher", "in_flight"]

log = get_logger("operator")

CapturesFetcher = Callable[[str], Mapping[str, Any] | None]   # endpoint -> GET /v1/captures body, or None


def http_captures(token: str, timeout_s: float = 3.0,
                  rewrite: Callable[[str], str] | None = None) -> CapturesFetcher:
    """A fetcher that GETs `<endpoint>/v1/captures` with the coordinator token."""
    def fetch(endpoint: str) -> Mapping[str, Any] | None:
        url = (rewrite(endpoint) if rewrite else endpoint).rstrip("/") + "/v1/captures"
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}", "Accept": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                body = json.loads(resp.read(4 * 1024 * 1024))
        except (urllib.error.URLError, OSError, ValueError) as exc:
            log.debug("captures.unavailable", endpoint=endpoint, reason=type(exc).__name__)
            return None
        return body if isinstance(body, dict) else None
    return fetch


def in_flight(listing: Mapping[str, Any]) -> list[str]:
    """The ids of the captures a coordinator's `GET /v1/captures` answer says are still running."""
    return sorted(item["capture_id"] for item in listing.get("captures") or []
                  if isinstance(item, Mapping) and isinstance(item.get("capture_id"), str)
                  and item.get("phase") in (Phase.PREPARING, Phase.CAPTURING))
