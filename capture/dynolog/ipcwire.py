"""The Kineto <-> dynolog IPC fabric, byte for byte (dynolog-kineto-protocol.md section 3).

AF_UNIX datagrams. Each one is a 40-byte header (`size_t` payload length, `char[32]` type, native
= little-endian on x86-64/aarch64) followed by exactly `size` payload bytes.

- `req` (Kineto -> dynolog): int32 config-type bitmask (1 events, 2 activities), int32 n, int64 job
  id, then n int32 pids (own pid first, then ancestors). The answer is a `req` whose payload is the
  config text (no NUL), empty when nothing is pending.
- `ctxt`: int32 gpu, int32 pid, int64 job id; answered with one int32 (count for that job and gpu).

Addresses: abstract `\\0dynolog\\0` (11 bytes: NUL, name, trailing NUL) by default, or the path
`<KINETO_IPC_SOCKET_DIR>/dynolog` when that variable is set (it must be set identically for both
sides; a trainer whose peer's path does not start with its own socket dir calls std::terminate).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

__all__ = [
    "HEADER", "ACTIVITIES", "EVENTS", "DYNOLOG_NAME", "Request", "Context", "WireError",
    "pack", "unpack", "pack_request", "parse_request", "pack_context", "parse_context", "endpoint_address",
]

HEADER = struct.Struct("<Q32s")
_REQ = struct.Struct("<iiq")
_CTXT = struct.Struct("<iiq")
EVENTS, ACTIVITIES = 1, 2
DYNOLOG_NAME = "dynolog"
MAX_PIDS = 64  # Kineto sends at most 11 (itself + 10 ancestors)


class WireError(ValueError):
    """A datagram that does not follow the fabric's layout."""


@dataclass(frozen=True)
class Request:
    config_type: int
    job_id: int
    pids: tuple[int, ...]

    @property
    def wants_activities(self) -> bool:
        return bool(self.config_type & ACTIVITIES)


@dataclass(frozen=True)
class Context:
    gpu: int
    pid: int
    job_id: int


def endpoint_address(name: str = DYNOLOG_NAME, socket_dir: str | None = None) -> str | bytes:
    """Where an endpoint called `name` lives: `<dir>/<name>`, or the abstract `\\0<name>\\0`."""
    if socket_dir:
        return os.path.join(socket_dir, name)
    return b"\0" + name.encode() + b"\0"


def pack(msg_type: str, payload: bytes) -> bytes:
    return HEADER.pack(len(payload), msg_type.encode()) + payload


def unpack(datagram: bytes) -> tuple[str, bytes]:
    if len(datagram) < HEADER.size:
        raise WireError(f"datagram of {len(datagram)} bytes is shorter than the 40-byte header")
    size, raw_type = HEADER.unpack_from(datagram)
    payload = datagram[HEADER.size:]
    if size != len(payload):
        raise WireError(f"header says {size} payload bytes, datagram carries {len(payload)}")
    return raw_type.split(b"\0", 1)[0].decode("ascii", "replace"), payload


def pack_request(req: Request) -> bytes:
    return pack("req", _REQ.pack(req.config_type, len(req.pids), req.job_id) + struct.pack(f"<{len(req.pids)}i", *req.pids))


def parse_request(payload: bytes) -> Request:
    if len(payload) < _REQ.size:
        raise WireError(f"req payload of {len(payload)} bytes is shorter than 16")
    config_type, n, job_id = _REQ.unpack_from(payload)
    if not 0 < n <= MAX_PIDS or len(payload) != _REQ.size + 4 * n:
        raise WireError(f"req payload of {len(payload)} bytes does not hold n={n} pids")
    return Request(config_type, job_id, struct.unpack_from(f"<{n}i", payload, _REQ.size))


def pack_context(ctx: Context) -> bytes:
    return pack("ctxt", _CTXT.pack(ctx.gpu, ctx.pid, ctx.job_id))


def parse_context(payload: bytes) -> Context:
    if len(payload) != _CTXT.size:
        raise WireError(f"ctxt payload must be 16 bytes, got {len(payload)}")
    return Context(*_CTXT.unpack(payload))
