"""NvmlApi over the CUDA stand-in's state directory: NVML's view when there is no GPU.

The stand-in libcuda (exporter/stub) writes `<dir>/gpu<N>/<pidns>.<pid>` for every process holding
a context on stub GPU N ("pid=.. pidns=.. device=.. mem=.. busy_ns=.."). This reads them the way
NVML reports running processes, so contention works end to end on a machine without a GPU (tests,
the embedded demo, the test cluster's trainers). Utilisation is busy time over wall time between
two reads. A file whose process is gone (a killed process cannot remove it) is ignored.

NVML reports the node's pids; a process in a container knows only its own namespace's. So the pid
is translated: the process in `proc_root` whose PID namespace has inode `pidns` and whose innermost
pid (the last of `NSpid` in its status) is `pid`. Found once by a scan of `proc_root`, then checked
by two reads per read of a GPU's list; a file whose process is gone (SIGKILLed) costs a scan of
`proc_root` per such read until it is removed (the stand-in only, never on a real GPU).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Callable

from .api import GpuDevice, GpuProcess, NvmlApi, NvmlUnavailable, UtilSample

__all__ = ["StubNvmlApi"]

_FIELD = re.compile(r"(\w+)=(\d+)")
_NAME = re.compile(r"\d+\.\d+")                # "<pidns>.<pid>"


class StubNvmlApi:
    def __init__(self, state_dir: str | Path, *, devices: int = 1, proc_root: str | Path = "/proc",
                 clock_us: Callable[[], int] = lambda: int(time.time() * 1e6)):
        self._dir = Path(state_dir)
        if not self._dir.is_dir():
            raise NvmlUnavailable(f"stub NVML state directory {self._dir} does not exist")
        self._devices = devices
        self._proc = Path(proc_root)
        self._clock_us = clock_us
        self._last_busy: dict[tuple[int, int], tuple[int, int]] = {}   # (gpu, pid) -> (busy_ns, t_us)
        self._node_pid: dict[tuple[int, int], int] = {}                  # (pidns, own pid) -> node pid

    def devices(self) -> list[GpuDevice]:
        found = set(range(self._devices))
        for entry in os.listdir(self._dir):
            m = re.fullmatch(r"gpu(\d+)(?:\.timeline)?", entry)
            if m:
                found.add(int(m.group(1)))
        return [GpuDevice(i, f"GPU-stub-{i:04d}", f"gpulens stub GPU {i}") for i in sorted(found)]

    def _entries(self, index: int) -> list[dict[str, int]]:
        """The live processes on GPU `index`, each with "pid" the node's pid."""
        d = self._dir / f"gpu{index}"
        try:
            names = os.listdir(d)
        except FileNotFoundError:
            return []
        out, unresolved = [], []
        for name in names:
            if not _NAME.fullmatch(name):
                continue
            try:
                text = (d / name).read_text()
            except OSError:
                continue
            fields = {k: int(v) for k, v in _FIELD.findall(text)}
            if "pid" not in fields:
                continue
            node_pid = self._resolve(fields["pid"], fields.get("pidns", 0))
            if node_pid is None:
                unresolved.append(fields)
            else:
                out.append({**fields, "pid": node_pid})
        if unresolved:
            found = self._scan({(f["pidns"], f["pid"]) for f in unresolved if f.get("pidns")})
            out += [{**f, "pid": found[(f["pidns"], f["pid"])]} for f in unresolved
                    if (f.get("pidns", 0), f["pid"]) in found]
        return out

    def _pidns(self, node_pid: int) -> int | None:
        try:
            return os.stat(self._proc / str(node_pid) / "ns" / "pid").st_ino
        except OSError:
            return None

    def _own_pid(self, node_pid: int) -> int | None:
        """The innermost of the process's pids (NSpid's last): the one it sees itself."""
        try:
            text = (self._proc / str(node_pid) / "status").read_text()
        except OSError:
            return None
        for line in text.splitlines():
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
        return node_pid                      # kernels before 4.1 have no NSpid: one namespace

    def _resolve(self, pid: int, pidns: int) -> int | None:
        """The node pid without a scan: the same namespace as `proc_root` (the demo, processes on the
        host), or the translation found before, if it still holds. None: scan."""
        if not pidns:                        # no namespace known: take the pid as the node's
            return pid if (self._proc / str(pid)).exists() else None
        if self._pidns(pid) == pidns and self._own_pid(pid) == pid:
            return pid
        known = self._node_pid.get((pidns, pid))
        if known is not None and self._pidns(known) == pidns and self._own_pid(known) == pid:
            return known
        self._node_pid.pop((pidns, pid), None)
        return None

    def _scan(self, wanted: set[tuple[int, int]]) -> dict[tuple[int, int], int]:
        if not wanted:
            return {}
        spaces = {ns for ns, _ in wanted}
        try:
            pids = [int(n) for n in os.listdir(self._proc) if n.isdigit()]
        except OSError:
            return {}
        for node_pid in pids:
            ns = self._pidns(node_pid)
            if ns in spaces:
                own = self._own_pid(node_pid)
                if (ns, own) in wanted:
                    self._node_pid[(ns, own)] = node_pid
        return {k: self._node_pid[k] for k in wanted if k in self._node_pid}

    def compute_processes(self, index: int) -> list[GpuProcess]:
        return [GpuProcess(e["pid"], e.get("mem")) for e in self._entries(index)]

    def process_utilization(self, index: int, since_us: int) -> list[UtilSample]:
        now = self._clock_us()
        out = []
        entries = self._entries(index)
        live = {(index, e["pid"]) for e in entries}
        self._last_busy = {k: v for k, v in self._last_busy.items() if k[0] != index or k in live}
        for e in entries:
            key = (index, e["pid"])
            busy = e.get("busy_ns", 0)
            prev = self._last_busy.get(key)
            self._last_busy[key] = (busy, now)
            if prev is None or now <= prev[1]:
                continue
            pct = min(100.0, max(0.0, (busy - prev[0]) / 1000 / (now - prev[1]) * 100))
            if now > since_us:
                out.append(UtilSample(e["pid"], now, pct))
        return out

    def close(self) -> None:
        pass


_: type[NvmlApi] = StubNvmlApi
