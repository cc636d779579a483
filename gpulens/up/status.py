"""Live status on the terminal: one line per decision the loop makes, so a newcomer never has to
open a log to learn why something did (or did not) happen.

- alerts: firing and resolved (Alertmanager's active alerts, polled);
- the gateway's outcome for each alert and each manual request (its own log lines, tailed:
  capture started / duplicate / cooldown since <capture> / not routable, and why);
- captures: converged (manifest in the archive) and the report's link on the captures page;
- a heartbeat line when nothing happened for a while.
Process crashes and restarts are announced by the supervisor itself, with the log path.
"""

from __future__ import annotations

import asyncio
import shlex
import time
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp

from .page import list_captures

if TYPE_CHECKING:
    from .host import UpHost

__all__ = ["StatusReporter", "LogTail", "parse_logfmt", "gateway_line"]


def parse_logfmt(line: str) -> dict[str, str]:
    """One line of gpulens.ground.logs output -> its fields (quoted values unescaped); {} if unparsable."""
    try:
        parts = shlex.split(line)
    except ValueError:
        return {}
    return dict(p.split("=", 1) for p in parts if "=" in p)


class LogTail:
    """New complete lines of a growing file, from where the last call stopped."""

    def __init__(self, path: Path):
        self.path, self._offset, self._rest = path, 0, b""

    def lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                size = f.seek(0, 2)
                if size < self._offset:          # truncated or replaced: start over
                    self._offset, self._rest = 0, b""
                f.seek(self._offset)
                data = f.read(1 << 20)
                self._offset += len(data)
        except OSError:
            return []
        *complete, self._rest = (self._rest + data).split(b"\n")
        return [c.decode(errors="replace") for c in complete]


#: gateway log event -> the sentence `up` prints; fields are the event's logfmt keys, plus `name`
_GATEWAY_SENTENCES = {
    "alert.capture_started": "gateway: {name} on {job} -> capture {capture_id} started",
    "alert.cooldown": "gateway: {name} on {job} -> no capture: cooldown since capture {since_capture} ({detail})",
    "alert.not_started": "gateway: {name} on {job} -> no capture: {outcome} ({detail})",
    "alert.unroutable": "gateway: {name} -> not routable: {detail}",
    "alert.no_coordinator": "gateway: {name} on {job} -> not routable: no coordinator answers ({error})",
    "alert.forward_failed": ("gateway: {name} on {job} -> coordinator unavailable, Alertmanager will retry with "
                             "capture {capture_id} ({error})"),
    "alert.coordinator_auth_failed": "gateway: {name} on {job} -> the coordinator refused the gateway's token",
    "alert.resolved": "gateway: {name} resolved -> capture {capture_id} told ({outcome})",
    "manual.capture_started": ("gateway: manual capture {capture_id} of {job} started (by {requested_by}; "
                               "starts the cooldown)"),
    "manual.capture_repeated": "gateway: manual request repeated capture id {capture_id}: same capture, nothing new started",
}


class _Fields(dict):
    """An event's fields for a sentence: a field the event lacks reads as '?' (details as '')."""

    def __missing__(self, key: str) -> str:
        return "" if key in ("detail", "error") else "?"


def gateway_line(f: dict[str, str]) -> str | None:
    """A gateway log event -> the sentence `up` prints, or None for events a person need not see."""
    template = _GATEWAY_SENTENCES.get(f.get("event", ""))
    if template is None:
        return None
    fields = _Fields({k: v for k, v in f.items() if v})
    fields["name"] = f.get("alertname") or f"alert {f.get('fingerprint', '?')}"
    return template.format_map(fields)


class StatusReporter:
    def __init__(self, runner: "UpHost", interval_s: float = 5.0, heartbeat_s: float = 60.0):
        self.runner, self.interval_s, self.heartbeat_s = runner, interval_s, heartbeat_s
        self._seen: set[str] = set()
        self._firing: dict[str, str] = {}                  # fingerprint -> how it was announced
        self._last_line = time.monotonic()
        self._gateway_log = LogTail(runner.layout.logs / "gateway.log")

    def say(self, text: str) -> None:
        self.runner.say(f"[{time.strftime('%H:%M:%S')}] {text}")
        self._last_line = time.monotonic()

    def emit(self, key: str, text: str) -> None:
        if key not in self._seen:
            self._seen.add(key)
            self.say(text)

    async def run(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as session:
            while True:
                await self.tick(session)
                await asyncio.sleep(self.interval_s)

    async def tick(self, session: aiohttp.ClientSession) -> None:
        if "alertmanager" in self.runner.sup.children:
            await self._alerts(session)
        for line in self._gateway_log.lines():
            text = gateway_line(parse_logfmt(line))
            if text:
                self.say(text)
        ui = self.runner.ports.ui
        for c in list_captures(self.runner.layout.archive_dir):
            cid = c["capture_id"]
            verdict = "all ranks archived" if c["fully_succeeded"] else f"{c['archived']}/{c['expected']} ranks archived"
            self.emit(f"capture:{cid}:manifest", f"capture {cid} ({c['job_id']}): converged, {verdict}"
                      + (" (cancelled)" if c.get("cancelled") else ""))
            if c["report"]:
                self.emit(f"capture:{cid}:report", f"capture {cid}: report http://127.0.0.1:{ui}/archive/{c['report']}")
            if c.get("verdict"):
                self.emit(f"capture:{cid}:verdict", f"capture {cid}: hang: {c['verdict']}")
        if time.monotonic() - self._last_line > self.heartbeat_s:
            up = sum(1 for c in self.runner.sup.children.values() if c.state in ("ready", "starting"))
            self.say(f"{up} processes running; "
                     f"{len(self.runner.operator.coordinators) if self.runner.operator else 0} coordinators")

    async def _alerts(self, session: aiohttp.ClientSession) -> None:
        try:
            url = f"http://127.0.0.1:{self.runner.ports.alertmanager}/api/v2/alerts?active=true"
            async with session.get(url) as r:
                alerts = await r.json() if r.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            alerts = None
        if alerts is None:
            return  # unknown is not "resolved"
        now: dict[str, str] = {}
        for a in alerts:
            lab = a.get("labels", {})
            fp = str(a.get("fingerprint"))
            now[fp] = (f"{lab.get('alertname')} diagnosis={lab.get('diagnosis')} "
                       f"{lab.get('namespace')}/{lab.get('pod')}")
            if fp not in self._firing:
                runbook = (a.get("annotations") or {}).get("runbook_url")
                self.say(f"alert firing: {now[fp]}" + (f"  runbook: {runbook}" if runbook else ""))
        for fp, text in self._firing.items():
            if fp not in now:
                self.say(f"alert resolved: {text}")
        self._firing = now
