"""The archive copy, written during verification: gzip and sha256 of the gzip, in the same read.

The verifier reads a trace once; every chunk it reads is handed here as well. With a `Staging`
the chunk is compressed (gzip, ISA-L's deflate when the `isal` wheel is there, else zlib: the same
format, BENCHMARKS.md "Node agent" measures both) into `<path>.part`, and the sha256 covers the
*compressed* bytes, the ones the archive will hold and the analysis will fetch and check. Without
one, the sha256 covers the raw bytes (the archive then holds the file as it is).

All of it runs on one helper thread, one chunk behind the parse: zlib, ISA-L and hashlib release
the GIL on large buffers, so compressing chunk n overlaps with decoding chunk n+1, and at most one
chunk waits (memory stays flat). Nothing here may fill the node: every `FREE_CHECK_BYTES` of raw
input the staging folder's free space is read again, and below `min_free_bytes` (or on ENOSPC)
the copy stops, its part file is removed and `error` says why; the trace itself is never touched.
"""

from __future__ import annotations

import hashlib
import os
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

try:  # ISA-L: ~3.7x zlib's level-1 speed at the same ratio (BENCHMARKS.md); zlib when absent
    from isal import isal_zlib as _isal
except ImportError:  # pragma: no cover - isal is a pinned dependency
    _isal = None

__all__ = ["Staging", "StagedBytes", "compressor", "codec_name", "FREE_CHECK_BYTES"]

FREE_CHECK_BYTES = 16 << 20     # raw bytes between two looks at the staging folder's free space
_GZIP_WBITS = 31                # zlib's gzip container (header with mtime 0, no name: deterministic)


@dataclass(frozen=True)
class Staging:
    """Where and how to write the archive copy. `level` 1 is the measured speed/ratio point
    (ISA-L 0-3, zlib 1-9; ISA-L levels above 3 do not exist and are clamped)."""

    path: str                   # the finished copy; `<path>.part` until the trace verified
    level: int = 1
    min_free_bytes: int = 0     # stop when the folder's filesystem would keep less than this free
    codec: str = "auto"         # auto (isal if installed) | isal | zlib


def codec_name(codec: str = "auto") -> str:
    if codec == "auto":
        return "isal" if _isal is not None else "zlib"
    if codec == "isal" and _isal is None:
        raise ValueError("codec 'isal' asked for, but the isal package is not installed")
    if codec not in ("isal", "zlib"):
        raise ValueError(f"unknown codec {codec!r}: auto, isal or zlib")
    return codec


def compressor(level: int, codec: str = "auto") -> Any:
    """A gzip-format compressobj (either library reads the other's output)."""
    if codec_name(codec) == "isal":
        return _isal.compressobj(max(0, min(level, 3)), zlib.DEFLATED, _GZIP_WBITS)
    return zlib.compressobj(max(1, min(level, 9)), zlib.DEFLATED, _GZIP_WBITS)


class StagedBytes:
    """sha256 (of the raw bytes, or with `stage` of their gzip as written) on a helper thread."""

    def __init__(self, threaded: bool, stage: Staging | None = None) -> None:
        self._sha = hashlib.sha256()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="gl-sha256") if threaded else None
        self._pending: Future | None = None
        self.size = 0               # raw bytes seen
        self.stored_size = 0        # bytes written to the copy (raw bytes when not staging)
        self.stage = stage
        self.error: str | None = None
        self._file = None
        self._comp = None
        self._next_check = 0
        if stage is not None:
            try:
                self._comp = compressor(stage.level, stage.codec)
                self._file = open(stage.path + ".part", "wb")
            except OSError as exc:
                self.error = f"cannot write the archive copy {stage.path}.part: {exc}"

    @property
    def part(self) -> str | None:
        return None if self.stage is None else self.stage.path + ".part"

    def update(self, data: bytes) -> None:
        self.size += len(data)
        if self._pool is None:
            self._work(data)
            return
        if self._pending is not None:
            self._pending.result()
        self._pending = self._pool.submit(self._work, data)

    def _work(self, data: bytes) -> None:
        if self.stage is None:
            self._sha.update(data)
            self.stored_size += len(data)
            return
        if self.error is not None:
            return
        try:
            self._emit(self._comp.compress(data))
            if self.size >= self._next_check:   # read on this thread: size only grows, a late look is fine
                self._next_check = self.size + FREE_CHECK_BYTES
                self._check_free()
        except OSError as exc:
            self._stop(f"writing the archive copy {self.part}: {exc}")

    def _emit(self, out: bytes) -> None:
        if out:
            self._file.write(out)
            self._sha.update(out)
            self.stored_size += len(out)

    def _check_free(self) -> None:
        st = os.statvfs(os.path.dirname(self.part) or ".")
        free = st.f_bavail * st.f_frsize
        if free < self.stage.min_free_bytes:
            self._stop(f"the archive copy stopped at {self.stored_size} bytes: {free} bytes free in "
                       f"{os.path.dirname(self.part)}, the agent keeps at least {self.stage.min_free_bytes} free")

    def _stop(self, why: str) -> None:
        self.error = why
        self._discard()

    def _discard(self) -> None:
        if self._file is not None:
            f, self._file = self._file, None
            try:
                f.close()        # flushes what is buffered: on a full disk that fails again (ENOSPC)
            except OSError:
                pass             # the part file goes below either way; `error` already says why
        if self.part is not None:
            try:
                os.unlink(self.part)
            except OSError:
                pass

    def _drain(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def hexdigest(self) -> str:
        self._drain()
        return self._sha.hexdigest()

    def finish(self) -> str | None:
        """Complete the copy (flush, fsync, rename to its final name); the stored path, or None
        with `error` set. Without staging: None."""
        self._drain()
        if self.stage is None or self.error is not None:
            return None
        try:
            self._emit(self._comp.flush())
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None
            os.replace(self.part, self.stage.path)
        except OSError as exc:
            self._stop(f"finishing the archive copy {self.part}: {exc}")
            return None
        return self.stage.path

    def abort(self) -> None:
        """The trace failed: no copy is kept."""
        self._drain()
        if self.stage is not None:
            self._discard()

    def close(self) -> None:
        try:
            self._drain()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            if self._file is not None:   # an exception left it open: nothing half-written stays
                self._discard()
