"""Find the driver library files processes have mapped, one entry per distinct file (dev, inode).

A uprobe belongs to a file, not to a process: once the host's libcuda inode is probed, every
process mapping it (in any container, since the NVIDIA toolkit bind-mounts the host file) is
counted from its first call. Discovery therefore only has to notice *new library files* (a
container shipping its own forward-compat libcuda) and files nobody maps any more. New pids are
scanned on the next pass; pids already scanned are re-read every `rescan_interval` (a process maps
libcuda when it initialises CUDA, not at exec).
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from .procfs import ProcFS

__all__ = ["LibraryFile", "ScanResult", "LibraryScanner", "glob_regex"]

LibraryKey = tuple[int, int]   # (st_dev, st_ino)


@dataclass(frozen=True)
class LibraryFile:
    key: LibraryKey
    path: str          # the path as the process sees it (may be inside its container)
    attach_path: str   # a path to the same file that this process can open


@dataclass
class ScanResult:
    libraries: dict[LibraryKey, LibraryFile] = field(default_factory=dict)
    users: dict[LibraryKey, set[int]] = field(default_factory=dict)
    scanned: int = 0      # maps files read in this pass


def _glob_part(glob: str) -> str:
    out, i = [], 0
    while i < len(glob):
        c = glob[i]
        if c == "*":
            out.append("[^/\n]*?")      # lazy, so a trailing " (deleted)" is left to its group
        elif c == "?":
            out.append("[^/\n]")
        elif c == "[":
            j = glob.find("]", i + 1)
            if j == -1:
                out.append(re.escape(c))
            else:
                body = glob[i + 1:j].replace("\\", "\\\\")
                out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
                i = j
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


def glob_regex(globs: Iterable[str]) -> re.Pattern[bytes]:
    """One regex over a whole maps file; a glob without '/' matches the file name, else the path."""
    alts = [_glob_part(g.lstrip("/")) if "/" in g else "(?:[^\n]*/)?" + _glob_part(g) for g in globs]
    pattern = (r"^([0-9a-f]+-[0-9a-f]+) \S+ [0-9a-f]+ ([0-9a-f]+):([0-9a-f]+) ([0-9]+) +"
               r"(/(?:" + "|".join(alts) + r"))( \(deleted\))?$")
    return re.compile(pattern.encode(), re.M)


@dataclass
class _PidState:
    start: int | None
    scanned_at: float
    keys: set[LibraryKey]


class LibraryScanner:
    def __init__(self, proc: ProcFS, globs: Iterable[str], *, rescan_interval: float = 5.0,
                 clock: Callable[[], float] = time.monotonic, self_pid: int | None = None):
        self._proc = proc
        self._regex = glob_regex(list(globs))
        self._rescan = rescan_interval
        self._clock = clock
        self._pids: dict[int, _PidState] = {}
        self._files: dict[LibraryKey, LibraryFile] = {}
        self._self = os.getpid() if self_pid is None else self_pid

    def _resolve(self, pid: int, key: LibraryKey, path: str, deleted: bool, vma: str) -> LibraryFile | None:
        """A path we can open for the mapped file: through the process's root, else map_files."""
        candidates = []
        if not deleted:
            candidates.append(str(self._proc.root / str(pid) / "root") + path)
        candidates.append(str(self._proc.root / str(pid) / "map_files" / vma))
        for candidate in candidates:
            try:
                st = os.stat(candidate)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) == key:
                return LibraryFile(key=key, path=path, attach_path=candidate)
        # Some file systems (overlay) report different device numbers in maps and stat; the
        # map_files link is the mapped file itself, so trust it when it opens.
        last = candidates[-1]
        return LibraryFile(key=key, path=path, attach_path=last) if os.path.exists(last) else None

    def forget_file(self, key: LibraryKey) -> None:
        """Resolve this file's path again next time (its process may have exited)."""
        self._files.pop(key, None)
        for state in self._pids.values():
            if key in state.keys:
                state.scanned_at = float("-inf")

    def _scan_pid(self, pid: int) -> set[LibraryKey] | None:
        data = self._proc.read_bytes(pid, "maps")
        if data is None:
            return None
        keys: set[LibraryKey] = set()
        for m in self._regex.finditer(data):
            inode = int(m.group(4))
            if inode == 0:
                continue
            key = (os.makedev(int(m.group(2), 16), int(m.group(3), 16)), inode)
            keys.add(key)
            if key not in self._files:
                lib = self._resolve(pid, key, m.group(5).decode("utf-8", "replace"), bool(m.group(6)),
                                    m.group(1).decode())
                if lib is not None:
                    self._files[key] = lib
        return keys

    def scan(self) -> ScanResult:
        now = self._clock()
        result = ScanResult()
        live = set(self._proc.pids())
        live.discard(self._self)
        for pid in list(self._pids):
            if pid not in live:
                del self._pids[pid]
        for pid in live:
            state = self._pids.get(pid)
            start = self._proc.start_ticks(pid)
            if state is not None and state.start == start and now - state.scanned_at < self._rescan:
                continue
            keys = self._scan_pid(pid)
            if keys is None:
                self._pids.pop(pid, None)
                continue
            result.scanned += 1
            self._pids[pid] = _PidState(start=start, scanned_at=now, keys=keys)
        for pid, state in self._pids.items():
            for key in state.keys:
                result.users.setdefault(key, set()).add(pid)
        for key in list(self._files):
            if key not in result.users:
                del self._files[key]
        result.libraries = {k: v for k, v in self._files.items() if k in result.users}
        return result
