"""NvmlApi over the CUDA stand-in's state directory: NVML's view when there is no GPU.

The stand-in libcuda (exporter/stub) writes `<dir>/gpu<N>/<pid>` for every process holding a
context on stub GPU N ("pid=.. device=.. mem=.. busy_ns=.."). This reads them the way NVML
reports running processes, so contention works end to end on a machine without a GPU (tests, the
embedded demo). Utilisation is busy time over wall time between two reads. A file whose pid is
gone (a killed process cannot remove it) is ignored.
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

    def devices(self) -> list[GpuDevice]:
        found = set(range(self._devices))
        for entry in os.listdir(self._dir):
            m = re.fullmatch(r"gpu(\d+)(?:\.timeline)?", entry)
            if m:
                found.add(int(m.group(1)))
        return [GpuDevice(i, f"GPU-stub-{i:04d}", f"gpulens stub GPU {i}") for i in sorted(found)]

    def _entries(self, index: int) -> list[dict[str, int]]:
        d = self._dir / f"gpu{index}"
        try:
            names = os.listdir(d)
        except FileNotFoundError:
            return []
        out = []
        for name in names:
            if not name.isdigit() or not (self._proc / name).exists():
                continue
            try:
                text = (d / name).read_text()
            except OSError:
                continue
            fields = {k: int(v) for k, v in _FIELD.findall(text)}
            if "pid" in fields:
                out.append(fields)
        return out

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
