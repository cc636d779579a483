"""Streaming reader for a Kineto trace: top-level keys as values, `traceEvents` a chunk of events at a time.

A trace can be a gigabyte; `json.load` would hold the text and every event object at once. This
reads fixed-size chunks, hands the raw bytes to a callback (the verifier hashes them) as they go
by, and decodes with the C-accelerated `json` scanner, so memory stays at about one chunk (plus
the events decoded from it) and time is O(bytes). Syntax errors, truncation and nesting past the
parser's recursion limit raise `TraceSyntaxError` with the character position.

Events are decoded a batch at a time: the text up to the last `},` in the next 16 KiB is handed to
the decoder as one array, so the Python cost is one call per ~50 events instead of one per event,
and the batch's objects are still in the CPU cache when the checks read and free them (1 MiB
batches measured 2-3x slower than 16 KiB ones: their ~5 MiB of objects leave the cache; that,
not the call count, is what made `json.load` and the one-by-one reader slow, bench/agent_verify.py). The cut is only a guess
(the `},` may sit inside a string or a nested object) and the decode itself checks it: a scanner
that reads `[` + text + `]` from left to right is, at the cut, in the same state as when it reads
the real array, so the wrapped text is a valid array only if the cut falls between two complete
elements (inside a string the `]` is string text and the string never ends; inside a nested value
the `]` closes that value and the outer array stays open). A `]` before the cut is the real end of
`traceEvents`: the events before it are the last ones. A miss drops the batch and reads one event
at a time up to the failed cut (this path also reports every error), then batching resumes.

A batch is decoded by orjson (a strict RFC 8259 parser in Rust, ~3x the stdlib scanner's speed,
the same dicts, lists, strings and numbers). Whatever orjson refuses goes to the stdlib scanner,
which decides: a wrong cut, the end of the array inside the batch, and the values orjson does not
take but `json.load` does (NaN, Infinity, 1e400, lone surrogate escapes, nesting past 1,024). So
the reader accepts exactly what `json.load` accepts. The one difference in values: an integer
beyond 64 bits inside an event comes back as the nearest float (no Kineto field is that large;
top-level values are always decoded by the stdlib scanner).
"""

from __future__ import annotations

import codecs
import json
from typing import Any, BinaryIO, Callable, Iterator

import orjson

__all__ = ["TraceSyntaxError", "TraceStream", "iter_trace", "CHUNK", "MAX_VALUE_CHARS"]

CHUNK = 1 << 20
BATCH_CHARS = 16 << 10      # text per batch: its objects (~5x) stay in the CPU cache until freed
MAX_VALUE_CHARS = 64 << 20  # one event (or top-level value) larger than this is not Kineto's output
_WS = " \t\n\r"


class TraceSyntaxError(ValueError):
    pass


class TraceStream:
    """Iterate `("key", (name, value))` for top-level keys and `("event", item)` for each
    traceEvents item; with `batches=True`, `("events", [item, ...])` in order instead (one tuple
    per decoded chunk: the verifier checks a batch with C-level passes, not a Python loop).
    `misses` counts guessed cuts the scanner refused (bench and tests read it). `fast_loads` is
    the batch decoder (orjson; None: the stdlib scanner alone, bench/agent_verify.py compares)."""

    fast_loads: Callable[[str], Any] | None = orjson.loads
    batch_chars = BATCH_CHARS

    def __init__(self, f: BinaryIO, *, chunk: int = CHUNK, on_bytes: Callable[[bytes], None] | None = None,
                 batches: bool = False):
        self._f, self._chunk, self._on_bytes, self._batches = f, chunk, on_bytes, batches
        self._dec = codecs.getincrementaldecoder("utf-8")("strict")
        self._json = json.JSONDecoder()
        self.buf, self.pos, self.eof = "", 0, False
        self.consumed = 0  # characters dropped from the front of buf
        self.misses = 0

    # --- buffer --------------------------------------------------------------------------

    def _refill(self) -> bool:
        if self.eof:
            return False
        data = self._f.read(self._chunk)
        if self._on_bytes and data:
            self._on_bytes(data)
        if self.pos > (len(self.buf) >> 1):
            self.consumed += self.pos
            self.buf, self.pos = self.buf[self.pos:], 0
        try:
            self.buf += self._dec.decode(data, final=not data)
        except UnicodeDecodeError as exc:
            raise TraceSyntaxError(f"not UTF-8 near character {self.consumed + len(self.buf)}: {exc.reason}") from exc
        if not data:
            self.eof = True
        return True

    def _skip_ws(self) -> str:
        """Advance past whitespace; return the next character ('' at end of input)."""
        while True:
            buf, pos = self.buf, self.pos
            n = len(buf)
            while pos < n and buf[pos] in _WS:
                pos += 1
            self.pos = pos
            if pos < n:
                return buf[pos]
            if not self._refill():
                return ""

    def _expect(self, chars: str) -> str:
        c = self._skip_ws()
        if c == "" or c not in chars:
            where = "end of input (truncated)" if c == "" else repr(c)
            raise TraceSyntaxError(f"expected one of {chars!r} at character {self.consumed + self.pos}, found {where}")
        self.pos += 1
        return c

    def _value(self) -> Any:
        self._skip_ws()
        while True:
            try:
                value, end = self._json.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as exc:
                if not self.eof and len(self.buf) - self.pos < MAX_VALUE_CHARS:
                    self._refill()
                    continue
                what = "truncated" if self.eof else "invalid"
                raise TraceSyntaxError(f"{what} JSON at character {self.consumed + exc.pos}: {exc.msg}") from None
            except RecursionError:
                # what json.load (and so the analysis, capture/limits.TRACE_FILE) refuses as max_depth
                raise TraceSyntaxError(f"a value at character {self.consumed + self.pos} nests deeper than the "
                                       "JSON parser's recursion limit (max_depth)") from None
            if end == len(self.buf) and not self.eof:
                self._refill()  # a number at the very end of the buffer may continue in the next chunk
                continue
            self.pos = end
            return value

    # --- structure -----------------------------------------------------------------------

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        self._refill()
        if self.buf.startswith("\ufeff"):
            self.pos = 1
        self._expect("{")
        if self._skip_ws() == "}":
            self.pos += 1
        else:
            while True:
                key = self._value()
                if not isinstance(key, str):
                    raise TraceSyntaxError(f"object key is not a string at character {self.consumed + self.pos}")
                self._expect(":")
                if key == "traceEvents" and self._skip_ws() == "[":
                    self.pos += 1
                    yield from self._events()
                    yield ("key", ("traceEvents", None))
                else:
                    yield ("key", (key, self._value()))
                if self._expect(",}") == "}":
                    break
        if self._skip_ws() != "":
            raise TraceSyntaxError(f"data after the top-level object at character {self.consumed + self.pos}")

    def _batch(self) -> tuple[list, bool] | int:
        """Every complete event from pos up to the last `},` in the buffer, and whether the array
        ended inside it; or, when the scanner refuses the cut, the cut's absolute position."""
        if not self.eof and len(self.buf) - self.pos < self._chunk:
            self._refill()
        buf, pos = self.buf, self.pos
        cut = buf.rfind("},", pos, pos + self.batch_chars)
        if cut < pos:
            return -1                       # no cut to try
        text = "[" + buf[pos:cut + 1] + "]"
        if self.fast_loads is not None:
            try:
                events = self.fast_loads(text)
            except orjson.JSONDecodeError as exc:
                # the array may have ended inside the batch (later keys hold a `},`): a prefix up to a
                # "]" that decodes as a whole is the real array, parsed from the same first character
                head = text[:exc.pos].rstrip()
                if head.endswith("]") and len(head) > 2:
                    try:
                        events = self.fast_loads(head)
                    except orjson.JSONDecodeError:
                        pass    # the stdlib scanner decides below
                    else:
                        self.pos = pos + len(head) - 1
                        return events, True
            else:               # never "[]": the text ends with the "}" at the cut
                self.pos = cut + 2
                return events, False
        try:
            events, end = self._json.raw_decode(text)
        except (json.JSONDecodeError, RecursionError):
            # the one-by-one path decides (a depth error there is reported at the event's own depth)
            return self.consumed + cut
        if not events:      # "[]": a "]" right after a comma (trailing comma); one-by-one reports it
            return self.consumed + cut
        if end == len(text):
            self.pos = cut + 2              # past the comma: the next element follows
            return events, False
        self.pos = pos + end - 1            # the real "]" of traceEvents was text[end - 1]
        return events, True

    def _events(self) -> Iterator[tuple[str, Any]]:
        if self._skip_ws() == "]":
            self.pos += 1
            return
        batches = self._batches
        resume_at = 0                       # absolute position: read one by one until past it
        while True:
            if self.consumed + self.pos > resume_at:
                got = self._batch()
                if type(got) is tuple:
                    events, ended = got
                    if batches:
                        yield ("events", events)
                    else:
                        for event in events:
                            yield ("event", event)
                    if ended:
                        return
                    continue
                if got >= 0:
                    self.misses += 1
                    resume_at = got
                else:                       # no `},` in the buffer (a huge event, or not objects)
                    resume_at = self.consumed + len(self.buf) - 2
            value = self._value()
            yield ("events", [value]) if batches else ("event", value)
            if self._expect(",]") == "]":
                return


def iter_trace(path: str, *, chunk: int = CHUNK) -> Iterator[tuple[str, Any]]:
    """Convenience: stream one file (no hashing)."""
    with open(path, "rb") as f:
        yield from TraceStream(f, chunk=chunk)
