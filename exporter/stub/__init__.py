"""A CUDA driver stand-in (libcuda.so.1 exporting the probed symbols), a workload program that
reproduces DESIGN.md's three incidents, a gcc build helper, and a ctypes driver for Python.
"""

from .build import StubBuild, StubBuildError, build_stub, default_cache_dir
from .driver import CudaError, StubDriver

__all__ = ["StubBuild", "StubBuildError", "build_stub", "default_cache_dir", "StubDriver", "CudaError"]
