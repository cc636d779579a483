"""In-memory NVML for tests.

Stands for NVML as seen through PynvmlApi: devices by index, host pids with used memory, and
utilisation samples newer than the caller's timestamp. `fail_with` makes the next calls raise
NvmlCallError, like an NVML call failing at runtime (GPU fallen off the bus, driver reset).
"""

from __future__ import annotations

from .api import GpuDevice, GpuProcess, NvmlApi, NvmlCallError, UtilSample

__all__ = ["FakeNvml"]


class FakeNvml:
    def __init__(self, gpus: int = 1):
        self.gpus = [GpuDevice(i, f"GPU-fake-{i:04d}", "Fake GPU") for i in range(gpus)]
        self.processes: dict[int, list[GpuProcess]] = {i: [] for i in range(gpus)}
        self.samples: dict[int, list[UtilSample]] = {i: [] for i in range(gpus)}
        self.fail_with: str | None = None
        self.closed = False

    def _check(self) -> None:
        if self.fail_with:
            raise NvmlCallError(self.fail_with)

    def devices(self) -> list[GpuDevice]:
        self._check()
        return list(self.gpus)

    def compute_processes(self, index: int) -> list[GpuProcess]:
        self._check()
        return list(self.processes.get(index, []))

    def process_utilization(self, index: int, since_us: int) -> list[UtilSample]:
        self._check()
        return [s for s in self.samples.get(index, []) if s.timestamp_us > since_us]

    def close(self) -> None:
        self.closed = True


_: type[NvmlApi] = FakeNvml
