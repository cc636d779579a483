"""StubDriver: call the CUDA driver stand-in from Python (ctypes), e.g. once per training step.

For demo trainers without a GPU (a torchrun CPU job that also "launches kernels" so the exporter
has something to count). The calls go through the library's exported driver symbols, so they hit
the uprobes exactly as cuBLAS or Triton launches would. Made for the stand-in: against a real
libcuda the module image it loads is not a valid cubin and construction fails.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

__all__ = ["StubDriver", "CudaError"]

_P = ctypes.c_void_p
_U = ctypes.c_uint


class CudaError(RuntimeError):
    def __init__(self, call: str, code: int):
        super().__init__(f"{call} returned CUresult {code}")
        self.call, self.code = call, code


class StubDriver:
    """One context on `device`; launches, copies and synchronisation through driver symbols."""

    def __init__(self, library: str | Path, device: int = 0, *, kernel_us: int = 0, buffer_bytes: int = 1 << 20):
        self._lib = ctypes.CDLL(str(library), mode=os.RTLD_NOW | os.RTLD_LOCAL)
        self._closed = False
        ctx, self._module, self._stream = _P(), _P(), _P()
        dev = ctypes.c_int()
        self._call("cuInit", _U(0))
        self._call("cuDeviceGet", ctypes.byref(dev), ctypes.c_int(device))
        self._call("cuCtxCreate_v2", ctypes.byref(ctx), _U(0), dev)
        self._ctx = ctx
        self._image = ctypes.create_string_buffer(b"gpulens stub module")
        self._call("cuModuleLoadData", ctypes.byref(self._module), self._image)
        self._call("cuStreamCreate", ctypes.byref(self._stream), _U(0))
        self._dptr = ctypes.c_ulonglong()
        self._call("cuMemAlloc_v2", ctypes.byref(self._dptr), ctypes.c_size_t(buffer_bytes))
        self._host = ctypes.create_string_buffer(1)
        self._kernels: dict[int, _P] = {}
        self.default_kernel_us = kernel_us
        self.device = device

    def _call(self, name: str, *args) -> None:
        rc = getattr(self._lib, name)(*args)
        if rc != 0:
            raise CudaError(name, rc)

    def _kernel(self, us: int) -> _P:
        if us not in self._kernels:
            f = _P()
            self._call("cuModuleGetFunction", ctypes.byref(f), self._module, f"gpulens_stub_kernel_{us}us".encode())
            self._kernels[us] = f
        return self._kernels[us]

    def launch(self, n: int = 1, *, kernel_us: int | None = None) -> None:
        f = self._kernel(self.default_kernel_us if kernel_us is None else kernel_us)
        fn = self._lib.cuLaunchKernel
        for _ in range(n):
            rc = fn(f, _U(1), _U(1), _U(1), _U(128), _U(1), _U(1), _U(0), self._stream, None, None)
            if rc != 0:
                raise CudaError("cuLaunchKernel", rc)

    def h2d(self, nbytes: int, *, sync: bool = False) -> None:
        if sync:
            self._call("cuMemcpyHtoD_v2", self._dptr, self._host, ctypes.c_size_t(nbytes))
        else:
            self._call("cuMemcpyHtoDAsync_v2", self._dptr, self._host, ctypes.c_size_t(nbytes), self._stream)

    def d2h(self, nbytes: int, *, sync: bool = True) -> None:
        """A synchronous copy blocks until the queued work is done (what `.cpu()` does)."""
        if sync:
            self._call("cuMemcpyDtoH_v2", self._host, self._dptr, ctypes.c_size_t(nbytes))
        else:
            self._call("cuMemcpyDtoHAsync_v2", self._host, self._dptr, ctypes.c_size_t(nbytes), self._stream)

    def synchronize(self) -> None:
        self._call("cuStreamSynchronize", self._stream)

    def step(self, *, kernels: int = 100, kernel_us: int | None = None, h2d_bytes: int = 0,
             d2h_sync_bytes: int = 0, sync: bool = True) -> None:
        """One training step: batch to device, forward, optional logging copy, backward, loss.item()."""
        if h2d_bytes:
            self.h2d(h2d_bytes)
        self.launch(kernels // 2, kernel_us=kernel_us)
        if d2h_sync_bytes:
            self.d2h(d2h_sync_bytes, sync=True)
        self.launch(kernels - kernels // 2, kernel_us=kernel_us)
        if sync:
            self.d2h(4, sync=False)
            self.synchronize()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._call("cuCtxDestroy_v2", self._ctx)

    def __enter__(self) -> "StubDriver":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
