"""PyTorch's Flight Recorder, dumped as JSON by the trainer's own hook (issue 45).

Every process group keeps a ring of its last collectives (sequence ids, op, sizes, whether each
completed, the Python frames that called it). `torch._C._distributed_c10d._dump_fr_trace()` returns
it as a pickle, and answers from any thread while the main thread is blocked inside a collective
(measured with torch 2.13 and gloo: ../shared/reference/hangs-2026.md). Its JSON twin,
`_dump_fr_trace_json()`, leaves the frames out, and a pickle must never be read outside the process
that wrote it (unpickling runs code). So the dump is unpickled here, in the process it describes,
and written as plain JSON (schema `flight_recorder`), frames included: what the analysis reads.

Standard library only; imports nothing of torch unless the process already has it. Never raises:
the reason comes back instead, and training is untouched.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import tempfile

__all__ = ["DUMP_VERSION", "dump", "write_dump"]

DUMP_VERSION = 1     # of the JSON this writes; torch's own is kept as `fr_version`


def dump() -> tuple[dict | None, str | None]:
    """(the Flight Recorder of this process as JSON-ready data, None) or (None, why not)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None, "torch is not imported in this process"
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return None, "torch.distributed is not initialised in this process"
        raw = torch._C._distributed_c10d._dump_fr_trace()
    except Exception as exc:  # noqa: BLE001 - an old torch, a backend without it: the reason, never a crash
        return None, f"Flight Recorder not available: {type(exc).__name__}: {exc}"
    try:
        data = pickle.loads(raw) if isinstance(raw, (bytes, bytearray)) else raw
    except Exception as exc:  # noqa: BLE001
        return None, f"Flight Recorder dump unreadable: {type(exc).__name__}: {exc}"
    if not isinstance(data, dict):
        return None, f"Flight Recorder dump is a {type(data).__name__}, not a dict"
    return {"dump_version": DUMP_VERSION, "fr_version": str(data.get("version", "")),
            "rank": dist.get_rank(), "world_size": dist.get_world_size(), "pid": os.getpid(),
            "pg_config": _plain(data.get("pg_config") or {}), "pg_status": _plain(data.get("pg_status") or {}),
            "entries": _plain(data.get("entries") or [])}, None


def write_dump(path: str) -> tuple[int, str | None]:
    """Write the dump to `path` (atomically: a reader never sees half of it); (bytes, None) or (0, why not)."""
    data, why = dump()
    if data is None:
        return 0, why
    text = json.dumps(data, separators=(",", ":"), default=str)
    folder = os.path.dirname(path) or "."
    try:
        fd, tmp = tempfile.mkstemp(prefix=".fr-", dir=folder)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as exc:
        return 0, f"cannot write {path}: {exc}"
    return len(text), None


def _plain(value):
    """JSON-ready: tuples as lists, keys as strings, anything else torch put there as its str."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
