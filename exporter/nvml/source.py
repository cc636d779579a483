"""NVML as a source: which processes run on which GPU, their memory and utilisation.

Opening NVML may fail for good (no driver: the source is disabled, with the reason) or a call may
fail at runtime (counted; the scrape goes on without NVML data). Opening is retried every
`retry_s`, because a driver can be installed or reloaded under a running DaemonSet.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from gpulens.ground.logs import get_logger

from ..health import SourceHealth
from .api import GpuDevice, GpuProcess, NvmlApi, NvmlCallError, NvmlUnavailable

__all__ = ["NvmlSnapshot", "NvmlSource"]

log = get_logger("exporter")


@dataclass(frozen=True)
class NvmlSnapshot:
    devices: tuple[GpuDevice, ...] = ()
    processes: dict[int, tuple[GpuProcess, ...]] = field(default_factory=dict)   # gpu index -> processes
    util: dict[tuple[int, int], float] = field(default_factory=dict)              # (gpu, pid) -> 0..1

    def gpus_of(self, pid: int) -> list[int]:
        return sorted(i for i, procs in self.processes.items() if any(p.pid == pid for p in procs))

    def gpu_label(self, pid: int) -> str | None:
        """The `gpu` label for a process: its GPU index, "0,1" if it uses several, None if unseen."""
        gpus = self.gpus_of(pid)
        return ",".join(str(g) for g in gpus) if gpus else None


class NvmlSource:
    def __init__(self, opener: Callable[[], NvmlApi] | None, health: SourceHealth, *,
                 disabled_reason: str = "NVML disabled (--nvml off)", retry_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        self._opener = opener
        self.health = health
        self._retry = retry_s
        self._clock = clock
        self._api: NvmlApi | None = None
        self._next_open = 0.0
        self._last_seen_us: dict[int, int] = {}
        self._util: dict[tuple[int, int], float] = {}
        self.latest = NvmlSnapshot()
        if opener is None:
            health.disabled(disabled_reason)
        else:
            self._open()

    @property
    def enabled(self) -> bool:
        return self._api is not None

    def _open(self) -> None:
        self._next_open = self._clock() + self._retry
        try:
            self._api = self._opener()
        except NvmlUnavailable as exc:
            self._api = None
            if self.health.view()[1] != str(exc):
                log.info("nvml.unavailable", reason=str(exc))
            self.health.disabled(str(exc))
        else:
            self.health.ok()
            log.info("nvml.opened")

    def snapshot(self) -> NvmlSnapshot:
        """A fresh read (empty when NVML is off or failing); also kept as `latest`."""
        if self._api is None:
            if self._opener is not None and self._clock() >= self._next_open:
                self._open()
            if self._api is None:
                self.latest = NvmlSnapshot()
                return self.latest
        try:
            devices = tuple(self._api.devices())
            processes = {d.index: tuple(self._api.compute_processes(d.index)) for d in devices}
            for d in devices:
                since = self._last_seen_us.get(d.index, 0)
                for s in self._api.process_utilization(d.index, since):
                    self._util[(d.index, s.pid)] = max(0.0, min(1.0, s.sm_percent / 100.0))
                    self._last_seen_us[d.index] = max(self._last_seen_us.get(d.index, 0), s.timestamp_us)
        except NvmlCallError as exc:
            self.health.failing(str(exc))
            self.latest = NvmlSnapshot()
            return self.latest
        running = {(i, p.pid) for i, procs in processes.items() for p in procs}
        self._util = {k: v for k, v in self._util.items() if k in running}
        self.health.ok()
        self.latest = NvmlSnapshot(devices=devices, processes=processes, util=dict(self._util))
        return self.latest

    def close(self) -> None:
        if self._api is not None:
            self._api.close()
            self._api = None
