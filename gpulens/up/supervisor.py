"""A small process supervisor: start children in order, wait until each is ready, restart the
ones that crash (with back-off, a bounded number of times), and stop everything on the way out.

Every child runs in its own session (process group), so stopping it also stops what it started
(torchrun's workers, a shell's children): nothing is left behind after Ctrl-C.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable

import aiohttp

from gpulens.ground.logs import get_logger

__all__ = ["ChildSpec", "Child", "Supervisor", "http_ready"]

log = get_logger("up")

ReadyCheck = Callable[[], Awaitable[bool]]


def http_ready(url: str) -> ReadyCheck:
    """Ready when `url` answers 2xx."""
    async def check() -> bool:
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as s:
                async with s.get(url) as r:
                    return 200 <= r.status < 300
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False
    return check


@dataclass
class ChildSpec:
    name: str
    argv: list[str]
    env: dict[str, str] | None = None
    ready: ReadyCheck | None = None
    url: str | None = None              # shown to the user
    restart: bool = True
    max_restarts: int = 3
    ready_timeout_s: float = 60.0
    cwd: str | None = None


@dataclass
class Child:
    spec: ChildSpec
    log_path: Path
    proc: asyncio.subprocess.Process | None = None
    restarts: int = 0
    started_at: float = 0.0
    state: str = "new"                  # new, starting, ready, exited, failed, stopped
    exit_code: int | None = None
    final: bool = False                 # stopped, or exited with no restart coming: gone for good
    _watch: asyncio.Task | None = field(default=None, repr=False)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None


class Supervisor:
    """`announce(text)` is told, in words, about every crash and restart (`gpulens up` prints it)."""

    def __init__(self, log_dir: Path, announce: Callable[[str], None] | None = None):
        self.log_dir = log_dir
        self.children: dict[str, Child] = {}
        self._stopping = False
        self._announce = announce or (lambda text: None)
        log_dir.mkdir(parents=True, exist_ok=True)

    async def start(self, spec: ChildSpec) -> Child:
        """Start one child and wait until it is ready; raises RuntimeError when it never gets there."""
        child = Child(spec, self.log_dir / f"{spec.name}.log")
        self.children[spec.name] = child
        await self._spawn(child)
        if spec.ready is not None:
            deadline = time.monotonic() + spec.ready_timeout_s
            while not await spec.ready():
                if child.proc and child.proc.returncode is not None:
                    raise RuntimeError(f"{spec.name} exited with code {child.proc.returncode} before it was ready; "
                                       f"see {child.log_path}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{spec.name} not ready after {spec.ready_timeout_s:.0f} s; see {child.log_path}")
                await asyncio.sleep(0.2)
        child.state = "ready"
        log.info("child.ready", child=spec.name, pid=child.pid, url=spec.url)
        return child

    async def _spawn(self, child: Child) -> None:
        spec = child.spec
        out = open(child.log_path, "ab", buffering=0)
        try:
            child.proc = await asyncio.create_subprocess_exec(
                *spec.argv, env=spec.env, cwd=spec.cwd, stdin=asyncio.subprocess.DEVNULL,
                stdout=out, stderr=asyncio.subprocess.STDOUT, start_new_session=True)
        finally:
            out.close()
        child.started_at, child.state, child.exit_code = time.time(), "starting", None
        log.info("child.started", child=spec.name, pid=child.proc.pid, log=str(child.log_path))
        child._watch = asyncio.create_task(self._watch(child), name=f"watch-{spec.name}")

    async def _watch(self, child: Child) -> None:
        assert child.proc is not None
        code = await child.proc.wait()
        child.exit_code = code
        if self._stopping or child.state == "stopped":
            return
        spec = child.spec
        if spec.restart and child.restarts < spec.max_restarts:
            child.restarts += 1
            child.state = "exited"
            delay = min(2 ** child.restarts, 10)
            log.warning("child.restarting", child=spec.name, exit_code=code, restart=child.restarts, delay_s=delay)
            self._announce(f"process {spec.name} (pid {child.pid}) exited with code {code}; restarting in {delay} s "
                           f"(restart {child.restarts} of {spec.max_restarts}); log: {child.log_path}")
            await asyncio.sleep(delay)
            if not self._stopping:
                await self._spawn(child)
                self._announce(f"process {spec.name} restarted: pid {child.pid}; log: {child.log_path}")
                child.state = "ready" if spec.ready is None or await spec.ready() else "starting"
        else:
            child.state, child.final = ("exited" if code == 0 else "failed"), True
            log.warning("child.exited", child=spec.name, exit_code=code, restarts=child.restarts)
            left = "no restarts left" if spec.restart else "not restarted"
            self._announce(f"process {spec.name} (pid {child.pid}) exited with code {code} ({left}); "
                           f"log: {child.log_path}")

    async def stop_child(self, name: str, timeout_s: float = 10.0) -> None:
        child = self.children.get(name)
        if child is None or child.proc is None:
            return
        child.state, child.final = "stopped", True
        await _terminate_group(child.proc, timeout_s)
        if child._watch:
            child._watch.cancel()
        log.info("child.stopped", child=name, exit_code=child.proc.returncode)

    async def stop_all(self, timeout_s: float = 10.0) -> None:
        """Stop children in reverse start order (trainers first, Prometheus last)."""
        self._stopping = True
        for name in reversed(list(self.children)):
            await self.stop_child(name, timeout_s)


async def _terminate_group(proc: asyncio.subprocess.Process, timeout_s: float) -> None:
    """SIGTERM the child's whole process group, then SIGKILL whatever is left after the timeout.

    Never a group that is no longer the child's: once the leader is reaped, its number stays
    pinned only while a member of its group lives; when none does, the kernel may give it to any
    new process, which may lead a session of its own (a test's trainer, a job's worker). A live
    process holding the leader's pid after the leader was reaped therefore means the group id is
    someone else's (measured: a CI run lost an unrelated job's two ranks to SIGKILL this way)."""
    pgid = proc.pid
    for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
        if not _still_ours(proc):
            return
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass
        try:
            await asyncio.wait_for(proc.wait(), wait)
        except asyncio.TimeoutError:
            continue
        # the leader is gone; make sure no member of its group outlives it
        if not _group_alive(pgid) or not _still_ours(proc):
            return
        await asyncio.sleep(0.5)
        if not _group_alive(pgid) or not _still_ours(proc):
            return
    if not _still_ours(proc):
        return
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _still_ours(proc: asyncio.subprocess.Process) -> bool:
    """The child's process group id still names its group: the leader runs, or it was reaped and no
    live process has taken its number (then only the group's own members can hold that id)."""
    return proc.returncode is None or not os.path.exists(f"/proc/{proc.pid}")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
