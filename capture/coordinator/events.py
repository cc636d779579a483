"""Per-capture event fan-out for `GET /v1/captures/{id}/events` (an NDJSON stream).

A subscriber that falls behind loses individual events, never the truth: its queue is replaced
by one fresh snapshot, because statuses are level-triggered and a snapshot says everything.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

__all__ = ["EventBus", "Subscription"]


class Subscription:
    def __init__(self, bus: "EventBus", maxsize: int):
        self._bus, self._queue = bus, asyncio.Queue(maxsize=maxsize)
        self.closed = False

    def _offer(self, event: dict[str, Any]) -> None:
        try:
            self._queue.put_nowait(event)
        except asyncio.QueueFull:
            while not self._queue.empty():
                self._queue.get_nowait()
            self._queue.put_nowait({"event": "snapshot", "lagged": True, "status": self._bus.snapshot()})

    async def get(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The next event, or None after `timeout` seconds without one."""
        try:
            return await asyncio.wait_for(self._queue.get(), timeout)
        except asyncio.TimeoutError:
            return None

    def get_nowait(self) -> dict[str, Any] | None:
        try:
            return self._queue.get_nowait()
        except asyncio.QueueEmpty:
            return None

    def close(self) -> None:
        self.closed = True
        self._bus._subs.discard(self)


class EventBus:
    def __init__(self, snapshot: Callable[[], dict[str, Any]], maxsize: int = 20000):
        self.snapshot, self._maxsize = snapshot, maxsize
        self._subs: set[Subscription] = set()

    def subscribe(self) -> Subscription:
        sub = Subscription(self, self._maxsize)
        self._subs.add(sub)
        return sub

    def publish(self, event: dict[str, Any]) -> None:
        for sub in list(self._subs):
            sub._offer(event)

    @property
    def subscribers(self) -> int:
        return len(self._subs)
