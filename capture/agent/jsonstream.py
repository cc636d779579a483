"""Streaming reader for a Kineto trace: top-level keys as values, `traceEvents` one event at a time.

A trace can be a gigabyte; `json.load` would hold the text and every event object at once. This
reads fixed-size chunks, hashes the raw bytes as they go by, and decodes one value at a time with
the C-accelerated `json` scanner, so memory stays at about one chunk plus one event and time is
O(bytes). Syntax errors and truncation raise `TraceSyntaxError` with the byte-ish position.
"""

from __future__ import annotations

import codecs
import hashlib
import json
from typing import Any, BinaryIO, Callable, Iterator

__all__ = ["TraceSyntaxError", "TraceStream", "iter_trace"]

CHUNK = 1 << 20
MAX_VALUE_CHARS = 64 << 20  # one event (or top-level value) larger than this is not Kineto's output
_WS = " \t\n\r"


class TraceSyntaxError(ValueError):
    pass


class TraceStream:
    """Iterate `("key", value)` for top-level keys and `("event", dict)` for each traceEvents item."""

    def __init__(self, f: BinaryIO, *, chunk: int = CHUNK, on_bytes: Callable[[bytes], None] | None = None):
        self._f, self._chunk, self._on_bytes = f, chunk, on_bytes
        self._dec = codecs.getincrementaldecoder("utf-8")("strict")
        self._json = json.JSONDecoder()
        self.buf, self.pos, self.eof = "", 0, False
        self.consumed = 0  # characters dropped from the front of buf

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

    def _events(self) -> Iterator[tuple[str, Any]]:
        if self._skip_ws() == "]":
            self.pos += 1
            return
        while True:
            yield ("event", self._value())
            if self._expect(",]") == "]":
                return


def iter_trace(path: str, *, chunk: int = CHUNK) -> Iterator[tuple[str, Any]]:
    """Convenience: stream one file (no hashing)."""
    with open(path, "rb") as f:
        yield from TraceStream(f, chunk=chunk)
