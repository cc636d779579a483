"""Noticing Kineto's finished trace files: its final rename, never its `.tmp` work in progress.

Kineto streams a trace into `<final>.tmp` and, when done, deletes any old `<final>` and renames the
`.tmp` over it (dynolog-kineto-protocol.md 4.7). So a file under its final name is complete, and
the final name (`<target_id>_<pid>.json`, Kineto inserts the pid) tells which target and which
process it belongs to. The observer polls the directories that currently have expectations with
one `os.scandir` per directory per tick: cheap, works on any file system (inotify does not see
writes made through another mount namespace's view on some set-ups), and it runs in its own task
on the event loop while verification runs in a process pool, so a gigabyte being verified never
delays noticing the next file.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass

from gpulens.ground.logs import get_logger

__all__ = ["Observer", "ObservedFile"]

_log = get_logger("agent")


@dataclass(frozen=True)
class ObservedFile:
    path: str
    size: int
    observed_at: float


class Observer:
    def __init__(self, *, interval_s: float = 0.2):
        self.interval_s = interval_s
        self._waiting: dict[str, dict[str, asyncio.Future[ObservedFile]]] = {}  # dir -> name -> future
        self._reported: set[str] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="trace-observer")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for names in self._waiting.values():
            for fut in names.values():
                fut.cancel()
        self._waiting.clear()

    async def wait_for(self, path: str, timeout_s: float) -> ObservedFile | None:
        """The file once it exists under its final name, or None after `timeout_s`."""
        directory, name = os.path.split(path)
        names = self._waiting.setdefault(directory, {})
        fut = names.get(name)
        if fut is None or fut.done():
            fut = names[name] = asyncio.get_running_loop().create_future()
        self._wake.set()
        try:
            return await asyncio.wait_for(asyncio.shield(fut), max(0.0, timeout_s))
        except asyncio.TimeoutError:
            return None
        finally:
            if names.get(name) is fut and not fut.done():
                fut.cancel()
            if names.get(name) is fut:
                del names[name]
            if not names:
                self._waiting.pop(directory, None)

    async def _loop(self) -> None:
        while True:
            if not self._waiting:
                self._wake.clear()
                await self._wake.wait()
            self.scan_once()
            await asyncio.sleep(self.interval_s)

    def scan_once(self) -> int:
        """One pass over the watched directories; returns how many expectations it fulfilled."""
        found = 0
        now = time.time()
        for directory, names in list(self._waiting.items()):
            try:
                with os.scandir(directory) as it:
                    entries = [(e.name, e) for e in it]
            except OSError:
                continue
            for name, entry in entries:
                if name.endswith(".tmp"):
                    continue  # Kineto is still writing
                fut = names.get(name)
                if fut is not None and not fut.done():
                    try:
                        size = entry.stat().st_size
                    except OSError:
                        continue
                    fut.set_result(ObservedFile(os.path.join(directory, name), size, now))
                    found += 1
                elif fut is None and name.endswith(".json"):
                    full = os.path.join(directory, name)
                    if full not in self._reported:
                        self._reported.add(full)
                        _log.debug("observe.unbound_file", path=full)
        return found
