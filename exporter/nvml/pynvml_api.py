"""NvmlApi over pynvml (nvidia-ml-py), the maintained NVML binding."""

from __future__ import annotations

from .api import GpuDevice, GpuProcess, NvmlApi, NvmlCallError, NvmlUnavailable, UtilSample

__all__ = ["PynvmlApi"]


class PynvmlApi:
    def __init__(self):
        try:
            import pynvml
        except ImportError as exc:
            raise NvmlUnavailable(f"pynvml is not installed ({exc})") from exc
        self._nv = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError_LibraryNotFound as exc:
            raise NvmlUnavailable("NVML library not found (no NVIDIA driver on this node)") from exc
        except pynvml.NVMLError_DriverNotLoaded as exc:
            raise NvmlUnavailable("NVIDIA driver not loaded") from exc
        except pynvml.NVMLError as exc:
            raise NvmlUnavailable(f"nvmlInit failed: {exc}") from exc
        self._handles: dict[int, object] = {}

    def _handle(self, index: int):
        if index not in self._handles:
            self._handles[index] = self._nv.nvmlDeviceGetHandleByIndex(index)
        return self._handles[index]

    def devices(self) -> list[GpuDevice]:
        nv = self._nv
        try:
            out = []
            for i in range(nv.nvmlDeviceGetCount()):
                h = self._handle(i)
                uuid, name = nv.nvmlDeviceGetUUID(h), nv.nvmlDeviceGetName(h)
                out.append(GpuDevice(i, uuid.decode() if isinstance(uuid, bytes) else str(uuid),
                                     name.decode() if isinstance(name, bytes) else str(name)))
            return out
        except nv.NVMLError as exc:
            raise NvmlCallError(f"listing devices: {exc}") from exc

    def compute_processes(self, index: int) -> list[GpuProcess]:
        nv = self._nv
        try:
            procs = list(nv.nvmlDeviceGetComputeRunningProcesses(self._handle(index)))
            try:   # MPS clients are listed separately
                procs += list(nv.nvmlDeviceGetMPSComputeRunningProcesses(self._handle(index)))
            except nv.NVMLError:
                pass
        except nv.NVMLError as exc:
            raise NvmlCallError(f"processes on GPU {index}: {exc}") from exc
        seen: dict[int, GpuProcess] = {}
        for p in procs:
            mem = getattr(p, "usedGpuMemory", None)
            seen[int(p.pid)] = GpuProcess(int(p.pid), int(mem) if isinstance(mem, int) else None)
        return list(seen.values())

    def process_utilization(self, index: int, since_us: int) -> list[UtilSample]:
        nv = self._nv
        try:
            samples = nv.nvmlDeviceGetProcessUtilization(self._handle(index), since_us)
        except (nv.NVMLError_NotFound, nv.NVMLError_NotSupported):
            return []          # no samples since `since_us`, or not on this GPU (MIG)
        except nv.NVMLError as exc:
            raise NvmlCallError(f"utilisation on GPU {index}: {exc}") from exc
        return [UtilSample(int(s.pid), int(s.timeStamp), float(s.smUtil)) for s in samples]

    def close(self) -> None:
        try:
            self._nv.nvmlShutdown()
        except self._nv.NVMLError:
            pass


_: type[NvmlApi] = PynvmlApi   # structural conformance (checked by mypy and at import)
