"""Keep one annotation in a sink equal to what the coordinator wants it to say.

Level-triggered: callers only `set()` the desired annotation; one task per annotation creates or
updates it until the sink agrees, retrying with back-off. A create that may have landed despite
an error (a timeout) is followed by a search for the annotation's unique tag before creating
again, so a flaky Grafana does not collect duplicates. The state is visible (`state()`), and
nothing here ever blocks the capture it describes.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

from gpulens.ground.logs import get_logger

from .model import Annotation, AnnotationError, AnnotationGone, AnnotationSink

__all__ = ["AnnotationSync"]

log = get_logger("annotations")


class AnnotationSync:
    def __init__(self, sink: AnnotationSink, key_tag: str, *, on_change: Callable[[dict[str, Any]], None] | None = None,
                 backoff_initial_s: float = 1.0, backoff_max_s: float = 60.0, give_up_after_s: float = 3600.0,
                 context: dict[str, Any] | None = None):
        self.sink, self.key_tag, self.on_change = sink, key_tag, on_change
        self.backoff_initial_s, self.backoff_max_s, self.give_up_after_s = backoff_initial_s, backoff_max_s, give_up_after_s
        self._desired: Annotation | None = None
        self._version = self._synced = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.annotation_id: int | None = None
        self._ambiguous = False
        self._attempts = 0
        self._error: str | None = None
        self._state = "pending"
        self.log = log.bind(**(context or {}))

    def state(self) -> dict[str, Any]:
        return {"state": self._state, "sink": self.sink.name, "id": self.annotation_id, "attempts": self._attempts,
                "error": self._error, "version": self._version, "synced_version": self._synced}

    def _set_state(self, state: str) -> None:
        self._state = state
        if self.on_change:
            self.on_change(self.state())

    def set(self, annotation: Annotation) -> None:
        """Want the sink to show `annotation`; returns at once."""
        if annotation == self._desired:
            return
        self._desired, self._version = annotation, self._version + 1
        if self._state != "retrying":
            self._set_state("pending")
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name=f"annotation-{self.key_tag}")

    @property
    def synced(self) -> bool:
        return self._version == self._synced

    async def wait_synced(self, timeout: float | None = None) -> bool:
        end = None if timeout is None else time.monotonic() + timeout
        while not self.synced and self._state != "failed":
            if end is not None and time.monotonic() >= end:
                return False
            await asyncio.sleep(0.05)
        return self.synced

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _push(self, annotation: Annotation) -> None:
        if self.annotation_id is not None:
            try:
                await self.sink.update(self.annotation_id, annotation)
                return
            except AnnotationGone:
                self.log.warning("annotation.gone", annotation_id=self.annotation_id)
                self.annotation_id = None
        if self._ambiguous:
            found = await self.sink.find(self.key_tag)
            self._ambiguous = False
            if found is not None:
                self.annotation_id = found
                await self.sink.update(found, annotation)
                return
        try:
            self.annotation_id = await self.sink.create(annotation)
        except AnnotationError as exc:
            self._ambiguous = self._ambiguous or exc.ambiguous
            raise

    async def _run(self) -> None:
        delay, failing_since = self.backoff_initial_s, None
        while True:
            await self._wake.wait()
            self._wake.clear()
            while not self.synced:
                version, desired = self._version, self._desired
                self._attempts += 1
                try:
                    await self._push(desired)
                except AnnotationError as exc:
                    failing_since = failing_since or time.monotonic()
                    self._error = str(exc)
                    if time.monotonic() - failing_since > self.give_up_after_s:
                        self.log.error("annotation.gave_up", error=str(exc), attempts=self._attempts)
                        self._set_state("failed")
                        failing_since, delay = None, self.backoff_initial_s  # a later set() starts afresh
                        break
                    self.log.warning("annotation.retry", error=str(exc), attempts=self._attempts, retry_in_s=delay)
                    self._set_state("retrying")
                    try:  # a newer desired state does not skip the back-off: Grafana is the one struggling
                        await asyncio.sleep(delay)
                    finally:
                        delay = min(delay * 2, self.backoff_max_s)
                    continue
                self._synced, self._error, failing_since = version, None, None
                delay = self.backoff_initial_s
                self.log.info("annotation.synced", annotation_id=self.annotation_id, version=version)
                self._set_state("synced" if self.synced else "pending")
