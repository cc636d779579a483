"""One size and nesting-depth limit for every JSON document gpulens reads whole.

Why: `json.loads` recurses once per nesting level, so ~1,000 nested arrays raise `RecursionError`
(a 500 on every API before this module). The depth is measured before parsing, in one pass at C
speed (strings removed by a regex, then only brackets counted), so "too deep" is a clear refusal
that names the limit, and a huge document is refused before it is decoded.

Every aiohttp API reads its body through `gpulens.capture.wire.web_json.read_json` with one of the `*_BODY`
limits below; every JSON file the agent or the analysis reads whole goes through `loads` /
`load_file` with a `*_FILE` limit. The numbers are in docs/ARCHITECTURE.md, "Limits".
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any

__all__ = ["JsonLimit", "JsonLimitError", "MAX_DEPTH", "json_depth", "loads", "load_file",
           "AGENT_BODY", "COORDINATOR_BODY", "GATEWAY_BODY", "WEBHOOK_BODY",
           "REGISTRATION_FILE", "STATE_FILE", "MANIFEST_FILE", "TRACE_FILE"]

#: deepest nesting accepted anywhere. gpulens's own documents nest <= 6 levels and Kubernetes
#: objects (admission reviews) rarely pass 20; Python's parser fails near 1,000.
MAX_DEPTH = 64


@dataclass(frozen=True)
class JsonLimit:
    """The bounds one kind of document must stay within (`what` names it in errors).

    `max_depth=None` skips the pre-scan (for multi-GB traces, where it would add ~80% to the parse):
    the parser's own recursion limit then stands, and hitting it is still refused as `max_depth`.
    """

    what: str
    max_bytes: int
    max_depth: int | None = MAX_DEPTH


AGENT_BODY = JsonLimit("agent request body", 64 << 10)
COORDINATOR_BODY = JsonLimit("coordinator request body", 256 << 10)
GATEWAY_BODY = JsonLimit("gateway request body", 4 << 20)          # Alertmanager groups many alerts
WEBHOOK_BODY = JsonLimit("admission review", 8 << 20)              # objects are <= 3 MiB in etcd
REGISTRATION_FILE = JsonLimit("registration record", 1 << 20)
STATE_FILE = JsonLimit("target status file", 4 << 20)
MANIFEST_FILE = JsonLimit("manifest", 16 << 20)
SUMMARY_FILE = JsonLimit("analysis summary", 64 << 20)
HANG_EVIDENCE_FILE = JsonLimit("hang evidence", 272 << 20)   # a Flight Recorder dump (<= 256 MiB) and stacks
TRACE_FILE = JsonLimit("trace", 4 << 30, None)  # bytes: the analysis' --max-trace-bytes caps lower


class JsonLimitError(ValueError):
    """A document over a limit. `.limit` is `max_bytes` or `max_depth`, `.bound` its value."""

    def __init__(self, limit: str, bound: int, actual: int, what: str):
        if limit == "max_bytes":
            text = f"{what} is larger than max_bytes={bound} ({actual} bytes)"
        else:
            text = f"{what} nests deeper than max_depth={bound} ({actual if actual >= 0 else 'more'} levels)"
        super().__init__(text)
        self.limit, self.bound, self.actual, self.what = limit, bound, actual, what


_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # unrolled: ~0.8x json.loads' time
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = [0] * 256
_STEP[ord("[")] = _STEP[ord("{")] = 1
_STEP[ord("]")] = _STEP[ord("}")] = -1


def json_depth(data: bytes | bytearray | str) -> int:
    """The deepest bracket nesting of a JSON text (brackets inside strings do not count)."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKET)
    if not brackets:
        return 0
    return max(accumulate(map(_STEP.__getitem__, brackets)))


def check(data: bytes | bytearray | str, limit: JsonLimit) -> None:
    """Raise JsonLimitError when `data` is over `limit` (size first: it is free to measure)."""
    size = len(data.encode("utf-8", "surrogatepass")) if isinstance(data, str) else len(data)
    if size > limit.max_bytes:
        raise JsonLimitError("max_bytes", limit.max_bytes, size, limit.what)
    raw = data if not isinstance(data, str) else data.encode("utf-8", "surrogatepass")
    # fewer opening brackets than the bound cannot nest deeper than it: skip the scan
    if limit.max_depth is not None and raw.count(b"[") + raw.count(b"{") > limit.max_depth:
        depth = json_depth(raw)
        if depth > limit.max_depth:
            raise JsonLimitError("max_depth", limit.max_depth, depth, limit.what)


def loads(data: bytes | bytearray | str, limit: JsonLimit) -> Any:
    """`json.loads` within `limit`. Raises JsonLimitError, or ValueError for text that is not JSON."""
    check(data, limit)
    try:
        return json.loads(data)
    except RecursionError as exc:  # only reachable with a max_depth near the interpreter's own limit
        raise JsonLimitError("max_depth", limit.max_depth or sys.getrecursionlimit(), -1, limit.what) from exc


def load_file(path: str | Path, limit: JsonLimit) -> Any:
    """Read and parse a whole JSON file within `limit`, never reading more than max_bytes + 1."""
    with open(path, "rb") as f:
        raw = f.read(limit.max_bytes + 1)
    return loads(raw, limit)
