"""Asking a rank's hook for its Flight Recorder dump (issue 45's hang capture), and reading it.

The hook of every registered rank of a process group listens on a Unix socket of its own
(hooks/site/_gpulens_flight.py, `FlightListener`; its name is the registration record's
`flight_socket`). One request, one JSON line each way; the hook writes the dump under the trace
folder at a name it builds from the capture and target ids, and the agent reads it from there,
checks it against the `flight_recorder` schema and its size limit, and archives it as any artifact.

The wait is bounded: a rank whose thread holds the GIL (or a stopped process) accepts the
connection in the kernel and never answers; its stacks, read from outside (stacks.py), are then
the evidence, and the target says `no_answer`.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from gpulens.hooks.site import _gpulens_flight as _format

from ..schemas import SchemaError, validate
from .unavailable import Unavailable

__all__ = ["FlightUnavailable", "request_flight_dump", "read_flight_dump", "dump_path", "MAX_DUMP_BYTES"]

# The request's wire form and the dump's name have one definition, the writer's: the hook's
# stdlib-only module, imported here as a module of the installed package (as steps.py does).

#: a dump of torch's default ring (2,000 entries) with frames is a few MB; anything past this is not one
MAX_DUMP_BYTES = 256 * 1024 * 1024
NO_SOCKET, NO_ANSWER, REFUSED, NOT_TAKEN, UNREADABLE = "no_socket", "no_answer", "refused", "not_taken", "unreadable"


class FlightUnavailable(Unavailable):
    """No dump from this rank; `reason` is one of the names above."""


def dump_path(trace_dir: str | os.PathLike, capture_id: str, target_id: str) -> Path:
    """Where the hook writes this target's dump, in the agent's own view of the trace folder (the
    hook's answer names it in the trainer's view, which may be another mount)."""
    name = _format.flight_dump_name(capture_id, target_id)
    if name is None:
        raise FlightUnavailable(REFUSED, f"capture {capture_id!r} / target {target_id!r} are not plain names")
    return Path(trace_dir) / name


async def request_flight_dump(socket_path: str, capture_id: str, target_id: str, *, timeout_s: float = 10.0) -> dict:
    """Ask the hook behind `socket_path` to write its dump; its answer (`ok`, `path`, `bytes`)."""
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_unix_connection(socket_path, limit=64 * 1024)
    except TimeoutError:
        raise FlightUnavailable(NO_ANSWER, f"{socket_path} did not accept in {timeout_s:g} s") from None
    except (FileNotFoundError, ConnectionRefusedError) as exc:
        raise FlightUnavailable(NO_SOCKET, f"{socket_path}: {exc.strerror or exc} (the process is gone, or its hook "
                                           "predates Flight Recorder dumps)") from exc
    except OSError as exc:
        raise FlightUnavailable(NO_SOCKET, f"{socket_path}: {exc}") from exc
    try:
        writer.write(json.dumps({"op": "flight_dump", "capture_id": capture_id, "target_id": target_id}).encode() + b"\n")
        async with asyncio.timeout(timeout_s):
            await writer.drain()
            line = await reader.readline()
    except TimeoutError:
        raise FlightUnavailable(NO_ANSWER, f"no answer from {socket_path} in {timeout_s:g} s: a thread of the rank "
                                           "holds the GIL, or the process is stopped (its stacks say which)") from None
    except (OSError, ValueError) as exc:
        raise FlightUnavailable(NO_ANSWER, f"{socket_path}: {exc}") from exc
    finally:
        writer.close()
    try:
        answer = json.loads(line)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise FlightUnavailable(UNREADABLE, f"{socket_path} answered {line[:200]!r}")
    if not answer.get("ok"):
        reason = str(answer.get("reason") or "no reason given")[:500]
        raise FlightUnavailable(REFUSED if reason.startswith(("refused", "bad request")) else NOT_TAKEN, reason)
    return answer


def read_flight_dump(path: str | os.PathLike, *, max_bytes: int = MAX_DUMP_BYTES) -> dict:
    """The dump the hook wrote, checked: at most `max_bytes`, JSON, the `flight_recorder` schema."""
    p = Path(path)
    try:
        size = p.stat().st_size
        if size > max_bytes:
            raise FlightUnavailable(UNREADABLE, f"{p} is {size} bytes, over the {max_bytes}-byte limit")
        doc = json.loads(p.read_bytes())
    except OSError as exc:
        raise FlightUnavailable(UNREADABLE, f"{p}: {exc}") from exc
    except ValueError as exc:
        raise FlightUnavailable(UNREADABLE, f"{p} is not JSON: {exc}") from exc
    try:
        validate("flight_recorder", doc)
    except SchemaError as exc:
        raise FlightUnavailable(UNREADABLE, f"{p}: {exc}") from exc
    return doc
