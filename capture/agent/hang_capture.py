"""A hang capture's target on the node (issue 45): the rank's evidence as one checked document.

A trace capture hands Kineto a config and waits for a file; a hang capture has nothing to wait
for. The agent asks the rank's hook for its Flight Recorder dump over the socket the registration
names, reads every thread's stack from outside (hang_evidence.py), and archives the `hang_evidence`
document as `traces/<target>.hang.json`, checksummed and named in the manifest. Where the
hook's socket and trace folder are, seen from the agent: its own `--socket-dir` / `--trace-dir`
when they are the trainer's folders (shared hostPath), else through the trainer's root.

A rank with neither half (gone, not Python, no hook) fails `no_hang_evidence` with both reasons;
a rank with one half is archived with the other half's reason in the document: a GIL-holding
rank writes no dump, and its stack is exactly the evidence that names it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .hang_evidence import HangTarget
from .registry import Worker, agent_view

__all__ = ["hang_target", "evidence_bytes", "describe", "nothing_taken", "HANG_SUFFIX"]

HANG_SUFFIX = ".json"
HANG_TAG = "hang"


def hang_target(capture_id: str, target_id: str, rank: int, worker: Worker, *, trace_view: Path,
                socket_dir: Path | None) -> HangTarget:
    rec = worker.record
    socket = None
    if rec.flight_socket and rec.socket_dir:
        socket = str(agent_view(rec.socket_dir, socket_dir, worker.host_pid) / rec.flight_socket)
    return HangTarget(capture_id=capture_id, target_id=target_id, rank=rank, pid=rec.pid, host_pid=worker.host_pid,
                      flight_socket=socket, trace_dir=str(trace_view))


def evidence_bytes(doc: dict) -> tuple[bytes, str]:
    """The archived bytes and their sha256 (compact JSON: a dump with frames is mostly strings)."""
    data = json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()
    return data, hashlib.sha256(data).hexdigest()


def nothing_taken(doc: dict) -> str | None:
    """Why neither half could be had, or None when at least one is in the document."""
    fr, st = doc["flight_recorder"], doc["stacks"]
    if fr["dump"] is not None or st["doc"] is not None:
        return None
    return (f"no Flight Recorder dump ({fr['reason']}: {fr['detail'] or ''}) and no stacks "
            f"({st['reason']}: {st['detail'] or ''})")


def describe(doc: dict) -> str:
    """One line on what the document holds, for the target's detail."""
    fr, st = doc["flight_recorder"], doc["stacks"]
    if fr["dump"] is not None:
        entries = fr["dump"].get("entries") or []
        dump = f"Flight Recorder dump of {len(entries)} entries"
    else:
        dump = f"no Flight Recorder dump ({fr['reason']})"
    if st["doc"] is not None:
        stacks = f"stacks of {len(st['doc'].get('threads') or [])} threads"
    else:
        stacks = f"no stacks ({st['reason']})"
    return f"{dump}, {stacks}, taken in {doc['seconds']:.1f} s"
