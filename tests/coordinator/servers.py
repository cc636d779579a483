"""Helpers to serve an aiohttp app on a free loopback port, and to run `gpulens` processes that
are always stopped (by their own pid) when the test ends."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
from aiohttp import web

REPO = Path(__file__).resolve().parents[2]


@asynccontextmanager
async def serving(app: web.Application):
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.2)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


class GpulensProcess:
    """`python -m gpulens.cli ARGS` in its own session; stop() ends it and everything it started.
    `prefix` runs it through a wrapper that execs it in place (`ip netns exec NS`: a node's netns)."""

    def __init__(self, args: list[str], log: Path, env: dict | None = None, prefix: list[str] | None = None):
        self.args, self.log, self.env, self.prefix = args, log, env, list(prefix or [])
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> "GpulensProcess":
        self._logf = open(self.log, "ab")
        self.proc = await asyncio.create_subprocess_exec(
            *self.prefix, sys.executable, "-m", "gpulens.cli", *self.args, cwd=REPO, stdout=self._logf, stderr=self._logf,
            start_new_session=True, env={**os.environ, **(self.env or {})})
        return self

    async def wait_ready(self, url: str, timeout: float = 60.0) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        async with aiohttp.ClientSession() as s:
            while loop.time() < end:
                if self.proc.returncode is not None:
                    raise RuntimeError(f"gpulens {self.args[0]} exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
                try:
                    async with s.get(url + "/healthz", timeout=aiohttp.ClientTimeout(total=1)) as r:
                        if r.status == 200:
                            return
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                    pass
                await asyncio.sleep(0.1)
        raise RuntimeError(f"gpulens {self.args[0]} not ready: {self.log.read_text()[-2000:]}")

    async def stop(self, sig: int = signal.SIGTERM) -> int | None:
        if self.proc is None or self.proc.returncode is not None:
            return self.proc.returncode if self.proc else None
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            await asyncio.wait_for(self.proc.wait(), 15)
        except asyncio.TimeoutError:
            os.killpg(self.proc.pid, signal.SIGKILL)
            await self.proc.wait()
        self._logf.close()
        return self.proc.returncode
