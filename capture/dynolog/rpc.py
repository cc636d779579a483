"""Client for stock dynolog's JSON RPC (TCP, default port 1778).

Wire format (dynolog-kineto-protocol.md section 1): one request per connection; a 4-byte
little-endian int32 length then that many bytes of JSON, the same framing back, then the server
closes. The server is single-threaded with blocking reads, so every step here (connect, send,
read length, read body) has its own timeout: a stuck client would stall dynolog for everyone, and
a stuck dynolog must not stall the agent. The length and body go out in one write because dynolog
reads the prefix with a single read().
"""

from __future__ import annotations

import asyncio
import json
import struct
import time
from typing import Any, Callable, TypeVar

from .results import DynologRefused, OnDemandResult, TriggerFailed

__all__ = ["DynologClient", "encode_frame", "MAX_RESPONSE_BYTES"]

_LEN = struct.Struct("<i")
MAX_RESPONSE_BYTES = 16 << 20


def encode_frame(obj: dict[str, Any]) -> bytes:
    body = json.dumps(obj, separators=(",", ":")).encode()
    return _LEN.pack(len(body)) + body


def parse_addr(addr: str) -> tuple[str, int]:
    """'HOST:PORT' or '[v6]:PORT' -> (host, port)."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"dynolog address must be HOST:PORT, got {addr!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


OnCall = Callable[[str, float, "str | None"], None]  # (method, seconds, failure reason or None)
T = TypeVar("T")


def refusal(body: Any) -> str | None:
    """The text of a failure document, else None. dynolog's failures carry only `"status"`, a string
    ("failed", "failed with exception = ..."); getStatus's int and dcgm's bool statuses are answers."""
    if isinstance(body, dict) and set(body) == {"status"} and isinstance(body["status"], str):
        return body["status"]
    return None


class DynologClient:
    def __init__(self, host: str = "127.0.0.1", port: int = 1778, *, timeout_s: float = 3.0,
                 on_call: OnCall | None = None):
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self.on_call = on_call  # the agent's metrics: every call's duration and outcome

    def with_timeout(self, timeout_s: float) -> "DynologClient":
        """The same dynolog, a different per-step timeout (a liveness probe must be quick)."""
        return type(self)(self.host, self.port, timeout_s=timeout_s, on_call=self.on_call)

    @property
    def where(self) -> str:
        return f"dynolog at {self.host}:{self.port}"

    @classmethod
    def from_addr(cls, addr: str, **kw: Any) -> "DynologClient":
        host, port = parse_addr(addr)
        return cls(host, port, **kw)

    async def call(self, request: dict[str, Any]) -> Any:
        """Send one request, return the decoded answer. Raises TriggerFailed(dynolog_unreachable |
        dynolog_error), DynologRefused for a failure document; unreachable and timeouts are retryable."""
        return await self._counted(request, lambda body: body)

    async def _counted(self, request: dict[str, Any], read: Callable[[Any], T]) -> T:
        """One call with its answer read by `read`, timed and counted by `on_call` as a whole: an
        answer that is a refusal or unusable is a failed call, not a success."""
        started = time.monotonic()
        try:
            answer = read(await self._call(request))
        except TriggerFailed as exc:
            if self.on_call is not None:
                self.on_call(str(request.get("fn")), time.monotonic() - started, exc.metric_reason)
            raise
        if self.on_call is not None:
            self.on_call(str(request.get("fn")), time.monotonic() - started, None)
        return answer

    async def _call(self, request: dict[str, Any]) -> Any:
        where = f"dynolog at {self.host}:{self.port}"
        t = self.timeout_s
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(self.host, self.port), t)
        except (OSError, asyncio.TimeoutError) as exc:
            raise TriggerFailed("dynolog_unreachable", f"{where} not listening: {_describe(exc)}", retryable=True) from exc
        try:
            writer.write(encode_frame(request))
            await asyncio.wait_for(writer.drain(), t)
            try:
                head = await asyncio.wait_for(reader.readexactly(4), t)
            except asyncio.IncompleteReadError as exc:
                # dynolog closes without answering on unknown fn, bad JSON, missing "fn", bad length
                raise TriggerFailed("dynolog_error", f"{where} closed without answering {request.get('fn')!r} "
                                    "(unknown function or malformed request)") from exc
            (size,) = _LEN.unpack(head)
            if not 0 < size <= MAX_RESPONSE_BYTES:
                raise TriggerFailed("dynolog_error", f"{where} sent a bad length prefix {size}")
            body = await asyncio.wait_for(reader.readexactly(size), t)
        except asyncio.TimeoutError as exc:
            raise TriggerFailed("dynolog_unreachable", f"{where} did not answer within {t:g} s", retryable=True) from exc
        except asyncio.IncompleteReadError as exc:
            raise TriggerFailed("dynolog_error", f"{where} closed mid-answer", retryable=True) from exc
        except OSError as exc:
            raise TriggerFailed("dynolog_unreachable", f"{where}: {_describe(exc)}", retryable=True) from exc
        finally:
            writer.close()
            try:
                await asyncio.wait_for(writer.wait_closed(), 1.0)
            except (OSError, asyncio.TimeoutError):
                pass
        try:
            answer = json.loads(body)
        except ValueError as exc:
            raise TriggerFailed("dynolog_error", f"{where} answered invalid JSON: {body[:200]!r}") from exc
        if (status := refusal(answer)) is not None:
            raise DynologRefused(f"{where} refused {request.get('fn')!r}: {status}")
        return answer

    async def set_kineto_ondemand_request(self, config: str, pids: list[int], job_id: int,
                                          process_limit: int = 1000) -> OnDemandResult:
        """Queue `config` for the job's processes with these (namespace-local) pids."""
        if not pids or any(p <= 0 for p in pids):
            raise ValueError("explicit positive pids only: [] and [0] mean every process of the job")
        if not 0 <= int(job_id) <= 0x7FFFFFFF:
            raise ValueError(f"job_id {job_id} does not fit dynolog's C int")
        return await self._counted({"fn": "setKinetOnDemandRequest", "config": config, "job_id": int(job_id),
                                    "pids": [int(p) for p in pids], "process_limit": int(process_limit)},
                                   OnDemandResult.from_body)

    async def get_version(self) -> str:
        return await self._counted({"fn": "getVersion"}, _version)

    async def get_status(self) -> int:
        return await self._counted({"fn": "getStatus"}, _status)


def _version(body: Any) -> str:
    if not isinstance(body, dict) or "version" not in body:
        raise TriggerFailed("dynolog_error", f"unexpected getVersion answer {body!r:.200}")
    return str(body["version"])


def _status(body: Any) -> int:
    if not isinstance(body, dict) or not isinstance(body.get("status"), int):
        raise TriggerFailed("dynolog_error", f"unexpected getStatus answer {body!r:.200}")
    return body["status"]


def _describe(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}"
