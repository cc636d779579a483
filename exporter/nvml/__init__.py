"""NVML behind a narrow Protocol: real (pynvml), stand-in state directory, in-memory fake."""

from .api import GpuDevice, GpuProcess, NvmlApi, NvmlCallError, NvmlUnavailable, UtilSample
from .source import NvmlSnapshot, NvmlSource

__all__ = ["GpuDevice", "GpuProcess", "NvmlApi", "NvmlCallError", "NvmlUnavailable", "UtilSample",
           "NvmlSnapshot", "NvmlSource", "open_nvml"]


def open_nvml(spec: str, *, proc_root: str = "/proc"):
    """An opener for --nvml: "auto" (pynvml), "stub:DIR" (CUDA stand-in state), or None for "off"."""
    if spec == "off":
        return None
    if spec == "auto":
        from .pynvml_api import PynvmlApi
        return PynvmlApi
    if spec.startswith("stub:"):
        from .stub_api import StubNvmlApi
        directory = spec.split(":", 1)[1]
        return lambda: StubNvmlApi(directory, proc_root=proc_root)
    raise ValueError(f"--nvml must be auto, off or stub:DIR, not {spec!r}")
