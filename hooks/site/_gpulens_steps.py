"""Publish this worker's optimizer step count, as Kineto counts it, for the node agent (stdlib only).

Why: a capture's ranks must trace the *same* iterations. Kineto starts an iteration trace at an
absolute `PROFILE_START_ITERATION` only if it fetched the config before that iteration; the
coordinator can choose one start for every rank only when it knows where the ranks are, and the
agent can prove afterwards which iterations a trace holds only when it can map the trace's
`Optimizer.step#...` spans to step numbers. Neither needs the job's cooperation (no
`torch.profiler` in the loop): this module registers one global optimizer post-step hook, after
PyTorch's own (torch.profiler registers `KinetoStepTracker.increment_step("Optimizer")` when
KINETO_USE_DAEMON is set), that copies `KinetoStepTracker`'s count and the wall-clock time into a
small memory-mapped file next to the registration record.

The file (little-endian, `STEPS_SLOTS` ring entries, 64 KiB):
  0  8s  magic b"GLSTEPS1"
  8  I   layout version (1)      12 I  slots
  16 q   latest step count       24 q  its time, ns since the epoch (time.time_ns)
  64 + (step % slots) * 16: q step, q time_ns   (the post-hook time of that step)
The ring entry is written before the header, so a reader that sees step s in the header finds
its entry. Kineto's own iteration number is the count less one (its counter starts at -1 and
each `step()` increments it before acting on a pending config).

Cost: one Python call, one attribute read, two `struct.pack_into` into the map per optimizer
step (bench/hook_steps.py measures it against an empty hook).
"""

from __future__ import annotations

import mmap
import os
import struct
import time

__all__ = ["StepPublisher", "steps_filename", "MAGIC", "VERSION", "STEPS_SLOTS", "HEADER", "ENTRY", "HEADER_SIZE"]

MAGIC = b"GLSTEPS1"
VERSION = 1
STEPS_SLOTS = 4096
HEADER = struct.Struct("<8sIIqq")      # magic, version, slots, latest step, latest time_ns
ENTRY = struct.Struct("<qq")           # step, time_ns
HEADER_SIZE = 64
_LATEST = struct.Struct("<qq")
_LATEST_AT = 16


def steps_filename(pid_namespace: str, pid: int) -> str:
    """`steps__ns<ns>__p<pid>.steps`: one per process, whatever its identity (single_process, then
    its rank) so it survives a record's rename; never matched by the agent's `*.json` scan."""
    ns = "".join(c for c in pid_namespace if c.isdigit()) or "0"
    return f"steps__ns{ns}__p{pid}.steps"


class StepPublisher:
    """One process's step file; `on_step` is the optimizer post-hook."""

    def __init__(self, path: str, tracker) -> None:
        self.path, self.tracker, self.pid = path, tracker, os.getpid()
        size = HEADER_SIZE + STEPS_SLOTS * ENTRY.size
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        HEADER.pack_into(self.map, 0, MAGIC, VERSION, STEPS_SLOTS, -1, 0)
        self._entry, self._latest = ENTRY.pack_into, _LATEST.pack_into
        self.handle = None   # the optimizer hook's RemovableHandle, once registered
        self.forked = False  # set in a forked child, which inherits the hook and the map: the file is its parent's
        os.register_at_fork(after_in_child=self._in_child)

    def _in_child(self) -> None:
        self.forked = True
    def on_step(self, _optimizer=None, _args=None, _kwargs=None) -> None:
        if self.forked:
            return  # no getpid() per step: a syscall; the fork hook marks a child once
        step = self.tracker._current_step
        now = time.time_ns()
        m = self.map
        self._entry(m, HEADER_SIZE + (step % STEPS_SLOTS) * 16, step, now)
        self._latest(m, _LATEST_AT, step, now)

    def close(self, *, remove: bool = True) -> None:
        """Unhook first (a trainer that handles SIGTERM and trains on must never step into a
        closed map), then unmap and remove the file."""
        if self.handle is not None:
            try:
                self.handle.remove()
            except Exception:  # noqa: BLE001 - never break the trainer's exit
                pass
            self.handle = None
        try:
            self.map.close()
        except (BufferError, ValueError):
            pass
        if remove:
            try:
                os.unlink(self.path)
            except OSError:
                pass
