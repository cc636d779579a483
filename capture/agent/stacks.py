"""Every thread's Python stack of one worker, read from outside it (issue 45's hang capture).

Why from outside: a rank that holds the others up may be spinning in Python or blocked in a C call
with the GIL held, and then no thread of the hook can run in it; the Flight Recorder dump (taken
in the process) says which collective it last entered, and only a reader outside says where it
is now. The agent runs on the node with the host's PIDs and, in the chart, as root with
`CAP_SYS_PTRACE`, so it can read any worker it registered.

Why py-spy: PyPI ships it as a wheel with its binary (no compiler, no registry), it reads every
thread of CPython 3.6-3.13 without injecting code, and `dump --json` answers in ~0.03 s here
(BENCHMARKS.md, "Hangs"). It pauses the process for the read (the default; `--nonblocking` can
read a torn stack), a cost only paid when a hang capture asks. gdb would need a debugger in the
image; torch's own debug server (pytorch#167395) runs in the process, which is the thing that
may not answer.

The result is the `python_stacks` document (capture/schemas/python_stacks.schema.json), or
`StacksUnavailable` with a reason a target can end with.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..schemas import SchemaError, validate
from .unavailable import Unavailable

__all__ = ["StackReader", "StacksUnavailable", "find_py_spy", "read_stacks"]

#: what a failed read is called: the reason a hang capture's target records for its stacks
TOOL_MISSING, PROCESS_GONE, NOT_PYTHON, NOT_PERMITTED, TIMED_OUT, UNREADABLE = (
    "tool_missing", "process_gone", "not_python", "not_permitted", "timed_out", "unreadable")


class StacksUnavailable(Unavailable):
    """No stacks for this process; `reason` is one of the names above."""


def find_py_spy() -> str | None:
    """The py-spy installed beside this interpreter (the wheel puts it in the venv's bin), else on PATH."""
    here = Path(sys.executable).with_name("py-spy")
    return str(here) if here.is_file() and os.access(here, os.X_OK) else shutil.which("py-spy")


@dataclass(frozen=True)
class StackReader:
    """How the agent reads stacks: which binary, and how long one read may take."""

    py_spy: str | None = None        # None: find_py_spy()
    timeout_s: float = 10.0

    async def read(self, pid: int) -> dict:
        return await read_stacks(pid, py_spy=self.py_spy, timeout_s=self.timeout_s)


async def read_stacks(pid: int, *, py_spy: str | None = None, timeout_s: float = 10.0) -> dict:
    """Every thread's stack of `pid` (as this process sees pids), as a `python_stacks` document."""
    if isinstance(pid, bool) or not isinstance(pid, int) or pid < 1:
        raise StacksUnavailable(UNREADABLE, f"{pid!r} is not a process id")
    tool = py_spy or find_py_spy()
    if not tool or not os.access(tool, os.X_OK):
        raise StacksUnavailable(TOOL_MISSING, f"no py-spy at {tool or 'the interpreter bin or PATH'} "
                                             "(a dependency of gpulens: reinstall the package)")
    began = time.time()
    try:
        proc = await asyncio.create_subprocess_exec(tool, "dump", "--pid", str(pid), "--json",
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                                                    env={**os.environ, "RUST_BACKTRACE": "0"})
    except OSError as exc:
        raise StacksUnavailable(TOOL_MISSING, f"{tool} could not run: {exc}") from exc
    try:
        async with asyncio.timeout(timeout_s):
            out, err = await proc.communicate()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise StacksUnavailable(TIMED_OUT, f"py-spy read pid {pid} for more than {timeout_s:g} s") from None
    seconds = time.time() - began
    text = err.decode(errors="replace").strip()
    if proc.returncode != 0:
        raise StacksUnavailable(_failure(pid, text), f"py-spy exit {proc.returncode}: {_first_lines(text)}")
    try:
        raw = json.loads(out)
    except ValueError as exc:
        raise StacksUnavailable(UNREADABLE, f"py-spy printed no JSON ({exc}): {out[:200]!r}") from exc
    doc = {"stacks_version": 1, "pid": pid, "taken_at": round(began, 3), "seconds": round(seconds, 3),
           "tool": f"py-spy ({Path(tool).name})", "threads": [_thread(t) if isinstance(t, dict) else t for t in raw]
           if isinstance(raw, list) else raw}
    try:
        validate("python_stacks", doc)
    except SchemaError as exc:
        raise StacksUnavailable(UNREADABLE, f"py-spy's JSON is not what it documents: {exc}") from exc
    return doc


def _thread(t: dict) -> dict:
    """py-spy's thread, its fields renamed and nothing else changed: the schema then judges it."""
    frames = t.get("frames")
    return {"thread_id": t.get("thread_id"), "os_thread_id": t.get("os_thread_id"), "name": t.get("thread_name"),
            "active": t.get("active"), "owns_gil": t.get("owns_gil"),
            "frames": [{"name": f.get("name"), "filename": f.get("filename"), "line": f.get("line")}
                       if isinstance(f, dict) else f for f in frames] if isinstance(frames, list) else frames}


def _failure(pid: int, stderr: str) -> str:
    """py-spy's error, named: its messages are read here, since its exit status is 1 for all."""
    if "Failed to find python version" in stderr or "python binary" in stderr.lower():
        return NOT_PYTHON
    if not os.path.exists(f"/proc/{pid}"):
        return PROCESS_GONE
    if "Permission denied" in stderr or "Operation not permitted" in stderr:
        return NOT_PERMITTED
    return UNREADABLE


def _first_lines(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith(("Stack backtrace", "   "))]
    return " | ".join(lines[:4])[:500]
