"""The narrow NVML surface the exporter uses, as a Protocol with plain dataclasses.

Four calls are enough for contention and per-process device use: the devices, the compute
processes on each (host pids), per-process utilisation samples, and close. Implementations: the
real one over pynvml, one over the CUDA stand-in's state directory (no GPU), and an in-memory
fake for tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = ["GpuDevice", "GpuProcess", "UtilSample", "NvmlApi", "NvmlUnavailable", "NvmlCallError"]


@dataclass(frozen=True)
class GpuDevice:
    index: int
    uuid: str
    name: str


@dataclass(frozen=True)
class GpuProcess:
    pid: int                               # host pid (the driver does not know pid namespaces)
    used_memory_bytes: int | None = None   # None when NVML cannot say (e.g. some vGPU/MIG setups)


@dataclass(frozen=True)
class UtilSample:
    pid: int
    timestamp_us: int
    sm_percent: float


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used on this node; the message is the reason shown in self-metrics."""


class NvmlCallError(RuntimeError):
    """An NVML call failed at runtime (counted as a source error; the next scrape retries)."""


@runtime_checkable
class NvmlApi(Protocol):
    def devices(self) -> list[GpuDevice]: ...

    def compute_processes(self, index: int) -> list[GpuProcess]: ...

    def process_utilization(self, index: int, since_us: int) -> list[UtilSample]: ...

    def close(self) -> None: ...
