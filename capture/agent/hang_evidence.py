"""One rank's hang evidence: its Flight Recorder dump and every thread's stack, in one document.

What a hang capture archives per target (issue 45), as a trace capture archives a trace: one JSON
file (schema `hang_evidence`), checksummed and named in the manifest. Each half says why it is
missing when it is (`flight.py` and `stacks.py` name the reasons), so a rank that could not dump
(its thread holds the GIL) still has its stacks, and one that is gone says so; the analysis
(`capture/analysis/hang.py`) reads both halves of every rank.

The dump is asked first and the stacks read after it: py-spy pauses the process for its read, and
the hook's thread must not be paused while it answers. The hook's dump file is folded into the
document and removed, so the evidence is one artifact and nothing is left in the trace folder.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from ..schemas import validate
from .flight import FlightUnavailable, dump_path, read_flight_dump, request_flight_dump
from .stacks import StackReader, StacksUnavailable

__all__ = ["HangTarget", "collect_hang_evidence", "EVIDENCE_VERSION"]

EVIDENCE_VERSION = 1


@dataclass(frozen=True)
class HangTarget:
    """The worker to read, as the agent sees it: its socket and trace folders are the agent's own views."""

    capture_id: str
    target_id: str
    rank: int
    pid: int                      # in the worker's own pid namespace (what its dump says)
    host_pid: int | None          # what py-spy reads (the agent runs with the host's pids)
    flight_socket: str | None     # the full path of the hook's socket, None for a hook without one
    trace_dir: str


async def collect_hang_evidence(t: HangTarget, *, stacks: StackReader | None = None,
                                flight_timeout_s: float = 10.0) -> dict:
    """The `hang_evidence` document of one target; never raises for what the process does."""
    began = time.time()
    flight: dict = {"dump": None, "reason": None, "detail": None}
    if not t.flight_socket:
        flight.update(reason="no_socket", detail="the worker's registration names no Flight Recorder socket "
                                                 "(a hook older than issue 45, or no process group)")
    else:
        try:
            answer = await request_flight_dump(t.flight_socket, t.capture_id, t.target_id, timeout_s=flight_timeout_s)
            path = dump_path(t.trace_dir, t.capture_id, t.target_id)
            flight["dump"] = read_flight_dump(path)
            flight["detail"] = f"{answer.get('bytes')} bytes written by the hook"
            try:
                os.unlink(path)
            except OSError:
                pass
        except FlightUnavailable as exc:
            flight.update(reason=exc.reason, detail=exc.detail)
    read: dict = {"doc": None, "reason": None, "detail": None}
    if not t.host_pid:
        read.update(reason="process_gone", detail="no host pid known for this worker: its stacks cannot be read")
    else:
        try:
            read["doc"] = await (stacks or StackReader()).read(t.host_pid)
        except StacksUnavailable as exc:
            read.update(reason=exc.reason, detail=exc.detail)
    doc = {"evidence_version": EVIDENCE_VERSION, "capture_id": t.capture_id, "target_id": t.target_id,
           "rank": t.rank, "pid": t.pid, "host_pid": t.host_pid, "taken_at": round(began, 3),
           "seconds": round(time.time() - began, 3), "flight_recorder": flight, "stacks": read}
    validate("hang_evidence", doc)
    return doc
