"""Reading facts about host processes from a /proc tree (injectable root for tests and hostPID mounts).

Every function tolerates the process exiting under it: a vanished pid reads as None or empty,
never as an exception, because processes come and go between any two reads.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

__all__ = ["ProcFS"]


class ProcFS:
    def __init__(self, root: str | Path = "/proc"):
        self.root = Path(root)
        self._root = str(root)
        self.clock_ticks = os.sysconf("SC_CLK_TCK")
        self._start_memo: dict[int, int | None] | None = None

    def __repr__(self) -> str:
        return f"ProcFS({self._root!r})"

    @contextmanager
    def snapshot(self) -> Iterator[None]:
        """Within the block, each pid's start time is read once (discovery, exits and attribution
        all ask during one tick; with 1,000 processes that is thousands of /proc reads saved)."""
        self._start_memo = {}
        try:
            yield
        finally:
            self._start_memo = None

    def pids(self) -> list[int]:
        try:
            return [int(name) for name in os.listdir(self.root) if name.isdigit()]
        except OSError:
            return []

    def read_bytes(self, pid: int, name: str) -> bytes | None:
        try:
            with open(f"{self._root}/{pid}/{name}", "rb") as f:
                return f.read()
        except OSError:
            return None

    def environ(self, pid: int, name: str, limit: int = 1 << 20) -> str | None:
        """One variable of the process's initial environment (/proc/<pid>/environ, as exec'd)."""
        try:
            with open(f"{self._root}/{pid}/environ", "rb") as f:
                data = f.read(limit)
        except OSError:
            return None
        prefix = name.encode() + b"="
        for entry in data.split(b"\0"):
            if entry.startswith(prefix):
                return entry[len(prefix):].decode("utf-8", "replace")
        return None

    def _read(self, pid: int, name: str) -> str | None:
        data = self.read_bytes(pid, name)
        return None if data is None else data.decode("utf-8", "replace")

    def start_ticks(self, pid: int) -> int | None:
        """Field 22 of /proc/<pid>/stat: start time in clock ticks since boot."""
        memo = self._start_memo
        if memo is not None and pid in memo:
            return memo[pid]
        stat = self.read_bytes(pid, "stat")
        ticks = None
        if stat and b")" in stat:
            fields = stat.rsplit(b")", 1)[1].split()
            try:
                ticks = int(fields[19])
            except (IndexError, ValueError):
                ticks = None
        if memo is not None:
            memo[pid] = ticks
        return ticks

    def same_process(self, pid: int, start_ns: int) -> bool:
        """Whether `pid` is still the process that started at `start_ns` (0: unknown, any)."""
        ticks = self.start_ticks(pid)
        if ticks is None:
            return False
        if start_ns == 0:
            return True
        return ticks == start_ns // (1_000_000_000 // self.clock_ticks)

    def comm(self, pid: int) -> str | None:
        text = self._read(pid, "comm")
        return text.rstrip("\n") if text else None

    def cgroup(self, pid: int) -> str | None:
        return self._read(pid, "cgroup")

    def ns_pids(self, pid: int) -> list[int]:
        """NSpid: this process's pid in each nested pid namespace, outermost first."""
        status = self._read(pid, "status") or ""
        for line in status.splitlines():
            if line.startswith("NSpid:"):
                try:
                    return [int(x) for x in line.split()[1:]]
                except ValueError:
                    return []
        return []

    def pid_namespace(self, pid: int) -> str | None:
        try:
            return os.readlink(f"{self._root}/{pid}/ns/pid")
        except OSError:
            return None

    def thread_alive(self, tgid: int, tid: int) -> bool:
        return os.path.exists(f"{self._root}/{tgid}/task/{tid}")

    def boot_time(self) -> float | None:
        """Unix time of boot (btime in /proc/stat), to compare process start with wall clocks."""
        try:
            with open(f"{self._root}/stat") as f:
                for line in f:
                    if line.startswith("btime "):
                        return float(line.split()[1])
        except (OSError, ValueError):
            pass
        return None

    def start_unix(self, pid: int) -> float | None:
        ticks, boot = self.start_ticks(pid), self.boot_time()
        if ticks is None or boot is None:
            return None
        return boot + ticks / self.clock_ticks
