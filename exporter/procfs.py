"""Reading facts about host processes from a /proc tree (injectable root for tests and hostPID mounts).

Every function tolerates the process exiting under it: a vanished pid reads as None or empty,
never as an exception, because processes come and go between any two reads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ProcFS"]


@dataclass(frozen=True)
class ProcFS:
    root: Path = Path("/proc")

    @property
    def clock_ticks(self) -> int:
        return os.sysconf("SC_CLK_TCK")

    def pids(self) -> list[int]:
        try:
            return [int(name) for name in os.listdir(self.root) if name.isdigit()]
        except OSError:
            return []

    def _read(self, pid: int, name: str) -> str | None:
        try:
            with open(self.root / str(pid) / name, "rb") as f:
                return f.read().decode("utf-8", "replace")
        except OSError:
            return None

    def read_bytes(self, pid: int, name: str) -> bytes | None:
        try:
            with open(self.root / str(pid) / name, "rb") as f:
                return f.read()
        except OSError:
            return None

    def start_ticks(self, pid: int) -> int | None:
        """Field 22 of /proc/<pid>/stat: start time in clock ticks since boot."""
        stat = self._read(pid, "stat")
        if not stat or ")" not in stat:
            return None
        fields = stat.rsplit(")", 1)[1].split()
        try:
            return int(fields[19])
        except (IndexError, ValueError):
            return None

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
            return os.readlink(self.root / str(pid) / "ns" / "pid")
        except OSError:
            return None

    def thread_alive(self, tgid: int, tid: int) -> bool:
        return (self.root / str(tgid) / "task" / str(tid)).exists()

    def boot_time(self) -> float | None:
        """Unix time of boot (btime in /proc/stat), to compare process start with wall clocks."""
        try:
            with open(self.root / "stat") as f:
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
