"""Headless Chromium driven over the DevTools protocol (aiohttp websocket), for rendering checks.

Console errors, uncaught exceptions, CSP violations and failed loads are all collected: `Runtime`
(exceptionThrown, consoleAPICalled) and `Log` (entryAdded: network, security, violation, ...).
The browser runs with networking features off and a throwaway profile, and is killed with its
process group when the context exits.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import os
import signal
import subprocess
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

CHROMIUM = "/usr/bin/chromium"


@dataclass
class PageResult:
    errors: list[str] = field(default_factory=list)
    screenshot: bytes = b""
    values: dict = field(default_factory=dict)


class _Session:
    def __init__(self, ws: aiohttp.ClientWebSocketResponse):
        self._ws, self._ids = ws, itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self.events: list[dict] = []
        self._waiters: list[tuple[str, asyncio.Future]] = []
        self._reader = asyncio.create_task(self._read())

    async def _read(self):
        async for msg in self._ws:
            data = msg.json()
            if "id" in data and data["id"] in self._pending:
                self._pending.pop(data["id"]).set_result(data)
            elif "method" in data:
                self.events.append(data)
                for method, fut in list(self._waiters):
                    if method == data["method"] and not fut.done():
                        fut.set_result(data)

    async def send(self, method: str, session_id: str | None = None, **params) -> dict:
        i = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[i] = fut
        msg = {"id": i, "method": method, "params": params}
        if session_id:
            msg["sessionId"] = session_id
        await self._ws.send_json(msg)
        reply = await asyncio.wait_for(fut, 60)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def wait_for(self, method: str) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append((method, fut))
        return fut

    async def close(self):
        self._reader.cancel()
        await self._ws.close()


@asynccontextmanager
async def chromium(profile_dir: Path):
    profile_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-extensions",
         f"--user-data-dir={profile_dir}", "--remote-debugging-port=0", "--remote-debugging-address=127.0.0.1",
         "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        port_file = profile_dir / "DevToolsActivePort"
        for _ in range(600):
            if port_file.exists() and len(port_file.read_text().splitlines()) >= 2:
                break
            if proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {proc.returncode}")
            await asyncio.sleep(0.1)
        else:
            raise RuntimeError("chromium did not write DevToolsActivePort")
        port, path = port_file.read_text().splitlines()[:2]
        async with aiohttp.ClientSession() as http:
            async with http.ws_connect(f"ws://127.0.0.1:{port}{path}", max_msg_size=0) as ws:
                session = _Session(ws)
                try:
                    yield session
                finally:
                    await session.close()
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


async def render(profile_dir: Path, url: str, expressions: dict[str, str], ready: str,
                 clip_selector: str | None = None) -> PageResult:
    """Open `url`, wait until JS `ready` is true, evaluate `expressions`, screenshot the full page
    (or only the first element matching `clip_selector`)."""
    async with chromium(profile_dir) as b:
        target = await b.send("Target.createTarget", url="about:blank")
        sid = (await b.send("Target.attachToTarget", targetId=target["targetId"], flatten=True))["sessionId"]
        for domain in ("Runtime", "Log", "Page"):
            await b.send(f"{domain}.enable", sid)
        loaded = b.wait_for("Page.loadEventFired")
        await b.send("Page.navigate", sid, url=url)
        await asyncio.wait_for(loaded, 120)
        for _ in range(600):
            r = await b.send("Runtime.evaluate", sid, expression=f"Boolean({ready})", returnByValue=True)
            if r["result"].get("value"):
                break
            await asyncio.sleep(0.1)
        out = PageResult()
        for name, expr in expressions.items():
            r = await b.send("Runtime.evaluate", sid, expression=expr, returnByValue=True)
            out.values[name] = r["result"].get("value")
        metrics = await b.send("Page.getLayoutMetrics", sid)
        size = metrics["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": min(size["height"], 12000), "scale": 1}
        if clip_selector:
            r = await b.send("Runtime.evaluate", sid, returnByValue=True, expression=(
                f"(() => {{ const r = document.querySelector({clip_selector!r}).getBoundingClientRect(); "
                "return {x: r.x + scrollX, y: r.y + scrollY, width: r.width, height: r.height, scale: 1}; })()"))
            clip = r["result"]["value"]
            out.values["clip"] = clip
        shot = await b.send("Page.captureScreenshot", sid, format="png", captureBeyondViewport=True, clip=clip)
        out.screenshot = base64.b64decode(shot["data"])
        for ev in b.events:
            p = ev.get("params", {})
            if ev["method"] == "Runtime.exceptionThrown":
                d = p["exceptionDetails"]
                out.errors.append(f"exception: {d.get('exception', {}).get('description') or d.get('text')}")
            elif ev["method"] == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                out.errors.append("console.error: " + " ".join(str(a.get("value", a.get("description")))
                                                                for a in p.get("args", [])))
            elif ev["method"] == "Log.entryAdded" and p["entry"]["level"] == "error":
                out.errors.append(f"log[{p['entry']['source']}]: {p['entry']['text']}")
        return out
