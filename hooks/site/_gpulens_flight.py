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

**On request** (`FlightListener`): a registered rank of a process group listens on a Unix socket of
its own in the node's socket folder (`flight__ns<ns>__p<pid>.sock`, named in its registration
record as `flight_socket`) with one thread blocked in `accept()`: nothing runs while idle. The
node agent connects and sends one JSON line `{"op": "flight_dump", "capture_id": ..., "target_id":
...}`; the thread writes the dump to `<trace dir>/<capture_id>/<target_id>.flight.json` (a name it
builds itself: a caller chooses no path) and answers one JSON line, `{"ok": true, "path": ...,
"bytes": ...}` or `{"ok": false, "reason": ...}`. Only root (the agent) or this process's own user
may ask (`SO_PEERCRED`, checked on every connection). The socket's mode is 0666 on purpose: a
connect needs write permission on it, and the chart's agent is root *without* CAP_DAC_OVERRIDE
(dropped: it holds DAC_READ_SEARCH and SYS_PTRACE only), so a 0600 socket of a trainer running as
any other user kept the agent out (measured: EACCES); the credential check is what keeps others out. A rank whose thread holds the GIL cannot answer: the agent's wait is
bounded, and its stacks, read from outside, say where it is.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import socket
import struct
import sys
import tempfile

__all__ = ["DUMP_VERSION", "dump", "write_dump", "FlightListener", "flight_socket_name", "flight_dump_name"]

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


_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}\Z")
_MAX_REQUEST = 4096


def flight_socket_name(pid_namespace: str, pid: int) -> str:
    """`flight__ns<ns>__p<pid>.sock`: one per process, beside Kineto's sockets."""
    ns = "".join(c for c in pid_namespace if c.isdigit()) or "0"
    return f"flight__ns{ns}__p{pid}.sock"


def flight_dump_name(capture_id: str, target_id: str) -> str | None:
    """`<capture_id>/<target_id>.flight.json` under the trace folder, or None for ids that are not
    plain names (a caller must never steer the write outside its capture's folder)."""
    if not (isinstance(capture_id, str) and isinstance(target_id, str) and _ID.match(capture_id)
            and _ID.match(target_id)) or ".." in capture_id or ".." in target_id:
        return None
    return f"{capture_id}/{target_id}.flight.json"


class FlightListener:
    """This rank's Flight Recorder, written on the node agent's request (see the module's text)."""

    def __init__(self, socket_dir: str, trace_dir: str):
        self.socket_dir, self.trace_dir = socket_dir, trace_dir
        self.path: str | None = None
        self.pid: int | None = None
        self._sock = None

    def start(self, name: str) -> str | None:
        """Listen at `<socket_dir>/<name>` on a daemon thread; the path, or None (then no listener)."""
        import threading

        path = os.path.join(self.socket_dir, name)
        try:
            if os.path.exists(path):
                os.unlink(path)          # a dead process's socket with our pid (a pid namespace reused)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(path)
            os.chmod(path, 0o666)        # the agent connects without DAC_OVERRIDE; SO_PEERCRED decides
            sock.listen(4)
        except OSError:
            return None
        self._sock, self.path, self.pid = sock, path, os.getpid()
        threading.Thread(target=self._serve, name="gpulens-flight", daemon=True).start()
        return path

    def close(self) -> None:
        if self.pid != os.getpid():      # a forked child inherits the object, never the listener
            return
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass
        if self.path:
            try:
                os.unlink(self.path)
            except OSError:
                pass

    def _serve(self) -> None:
        while self._sock is not None:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return                   # closed
            try:
                with conn:
                    conn.settimeout(5.0)
                    conn.sendall(json.dumps(self.answer(conn)).encode() + b"\n")
            except OSError:
                pass
            except Exception:  # noqa: BLE001 - the listener must outlive any one bad request
                pass

    def answer(self, conn) -> dict:
        # the request is read (bounded) before anything is answered, a refusal too: answered and
        # closed before the caller has sent, the caller's send would fail (EPIPE) and it would never
        # read why it was refused
        data = b""
        while not data.endswith(b"\n") and len(data) <= _MAX_REQUEST:
            chunk = conn.recv(_MAX_REQUEST)
            if not chunk:
                break
            data += chunk
        try:
            _pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        except OSError:
            return {"ok": False, "reason": "refused: the caller's credentials could not be read"}
        if uid not in (0, os.getuid()):
            return {"ok": False, "reason": f"refused: uid {uid} may not ask (only root or uid {os.getuid()})"}
        try:
            req = json.loads(data) if len(data) <= _MAX_REQUEST else None
        except ValueError:
            req = None
        if not isinstance(req, dict) or req.get("op") != "flight_dump":
            return {"ok": False, "reason": "bad request: one JSON line {\"op\": \"flight_dump\", ...} expected"}
        name = flight_dump_name(req.get("capture_id"), req.get("target_id"))
        if name is None:
            return {"ok": False, "reason": "bad request: capture_id and target_id must be plain names"}
        path = os.path.join(self.trace_dir, name)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        except OSError as exc:
            return {"ok": False, "reason": f"cannot make {os.path.dirname(path)}: {exc}"}
        size, why = write_dump(path)
        return {"ok": True, "path": path, "bytes": size} if why is None else {"ok": False, "reason": why}
