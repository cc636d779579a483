"""Compile the CUDA driver stand-in and its workload with gcc, into a content-addressed cache.

The library is laid out like the real one (`<dir>/libcuda.so.1` plus a `libcuda.so` link) so that
discovery finds it by the same glob and `dlopen("libcuda.so.1")` finds it through
LD_LIBRARY_PATH. A build is keyed by the sources, flags and compiler, written to a temporary
directory and renamed into place, so concurrent builders (parallel tests, the demo) never see a
half-written library.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["StubBuild", "StubBuildError", "build_stub", "default_cache_dir", "STUB_SOURCES"]

_HERE = Path(__file__).parent
STUB_SOURCES = {"libcuda": _HERE / "libcuda_stub.c", "workload": _HERE / "workload.c"}
# -fno-ipa-icf: identical functions (cuLaunchKernel and its _ptsz twin) must stay separate symbols,
# or one would become a jump into the other and a probe on each would count one call twice.
_LIB_FLAGS = ["-O2", "-g", "-Wall", "-fPIC", "-shared", "-fvisibility=hidden", "-fno-ipa-icf", "-pthread",
              "-Wl,-soname,libcuda.so.1"]
_BIN_FLAGS = ["-O2", "-g", "-Wall"]
_BIN_LIBS = ["-ldl"]


class StubBuildError(RuntimeError):
    """gcc is missing or failed; the message carries its output."""


@dataclass(frozen=True)
class StubBuild:
    root: Path
    lib_dir: Path        # holds libcuda.so.1 and libcuda.so (put it on LD_LIBRARY_PATH)
    libcuda: Path
    workload: Path       # the cuda-workload program (see workload.c for its flags)

    def env(self, **extra: str) -> dict[str, str]:
        """Environment for a process that should load this stand-in as its libcuda.so.1."""
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = str(self.lib_dir) + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
        env.update(extra)
        return env


def default_cache_dir() -> Path:
    if os.environ.get("GPULENS_STUB_CACHE"):
        return Path(os.environ["GPULENS_STUB_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gpulens" / "stub"


def _key(cc: str) -> str:
    h = hashlib.sha256()
    for name in sorted(STUB_SOURCES):
        h.update(STUB_SOURCES[name].read_bytes())
    h.update(" ".join(_LIB_FLAGS + _BIN_FLAGS + _BIN_LIBS).encode())
    try:
        h.update(subprocess.run([cc, "--version"], capture_output=True, check=True).stdout)
    except (OSError, subprocess.CalledProcessError) as exc:
        raise StubBuildError(f"C compiler {cc!r} not usable: {exc}") from exc
    return h.hexdigest()[:16]


def _layout(root: Path) -> StubBuild:
    return StubBuild(root=root, lib_dir=root / "lib", libcuda=root / "lib" / "libcuda.so.1",
                     workload=root / "bin" / "cuda-workload")


def _compile(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise StubBuildError(f"{' '.join(cmd)} failed:\n{proc.stderr}")


def build_stub(cache_dir: str | Path | None = None, *, cc: str = "gcc") -> StubBuild:
    """Build (or reuse) the stand-in; returns where the library and the workload are."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    if shutil.which(cc) is None:
        raise StubBuildError(f"C compiler {cc!r} not found (install gcc)")
    build = _layout(cache / _key(cc))
    if build.libcuda.exists() and build.workload.exists():
        return build
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=cache))
    try:
        staged = _layout(tmp)
        staged.lib_dir.mkdir()
        staged.workload.parent.mkdir()
        _compile([cc, *_LIB_FLAGS, "-o", str(staged.libcuda), str(STUB_SOURCES["libcuda"])])
        (staged.lib_dir / "libcuda.so").symlink_to("libcuda.so.1")
        _compile([cc, *_BIN_FLAGS, "-o", str(staged.workload), str(STUB_SOURCES["workload"]), *_BIN_LIBS])
        try:
            os.rename(tmp, build.root)
        except OSError:
            if not build.libcuda.exists():   # lost a race to a builder that failed? surface it
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return build
