"""Live status on the terminal: one line per event (process state, firing alert, capture progress),
and a heartbeat line when nothing happened for a while, so a newcomer sees the loop move."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import aiohttp

from .page import list_captures

if TYPE_CHECKING:
    from .host import UpHost

__all__ = ["StatusReporter"]


class StatusReporter:
    def __init__(self, runner: "UpHost", interval_s: float = 5.0, heartbeat_s: float = 60.0):
        self.runner, self.interval_s, self.heartbeat_s = runner, interval_s, heartbeat_s
        self._seen: set[str] = set()
        self._last_line = time.monotonic()

    def emit(self, key: str, text: str) -> None:
        if key not in self._seen:
            self._seen.add(key)
            self.runner.say(f"[{time.strftime('%H:%M:%S')}] {text}")
            self._last_line = time.monotonic()

    async def run(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as session:
            while True:
                await self.tick(session)
                await asyncio.sleep(self.interval_s)

    async def tick(self, session: aiohttp.ClientSession) -> None:
        for name, child in self.runner.sup.children.items():
            if child.state in ("failed", "exited"):
                self.emit(f"child:{name}:{child.state}:{child.restarts}",
                          f"process {name} {child.state} (exit code {child.exit_code}); log: {child.log_path}")
        if "alertmanager" in self.runner.sup.children:
            try:
                url = f"http://127.0.0.1:{self.runner.ports.alertmanager}/api/v2/alerts?active=true"
                async with session.get(url) as r:
                    alerts = await r.json() if r.status == 200 else []
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                alerts = []
            for a in alerts:
                lab = a.get("labels", {})
                self.emit(f"alert:{a.get('fingerprint')}:{a.get('startsAt')}",
                          f"alert firing: {lab.get('alertname')} diagnosis={lab.get('diagnosis')} "
                          f"{lab.get('namespace')}/{lab.get('pod')}")
        for c in list_captures(self.runner.layout.archive_dir):
            cid = c["capture_id"]
            verdict = "all ranks archived" if c["fully_succeeded"] else f"{c['archived']}/{c['expected']} ranks archived"
            self.emit(f"capture:{cid}:manifest", f"capture {cid} ({c['job_id']}): converged, {verdict}")
            if c["report"]:
                self.emit(f"capture:{cid}:report", f"capture {cid}: report "
                          f"http://127.0.0.1:{self.runner.ports.ui}/archive/{c['report']}")
        if time.monotonic() - self._last_line > self.heartbeat_s:
            up = sum(1 for c in self.runner.sup.children.values() if c.state in ("ready", "starting"))
            self.runner.say(f"[{time.strftime('%H:%M:%S')}] {up} processes running; "
                            f"{len(self.runner.operator.coordinators) if self.runner.operator else 0} coordinators")
            self._last_line = time.monotonic()
