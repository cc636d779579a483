"""The CUDA driver stand-in: build helper, driver semantics, workload knobs, StubDriver from Python."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpulens.exporter.stub import StubBuildError, build_stub
from gpulens.exporter.stub.build import default_cache_dir

from .conftest import bcc_usable, make_config, scrape, value, wait_for
from tests.conftest import requires

REPO = Path(__file__).resolve().parents[2]


def test_build_is_cached_and_laid_out_like_the_real_driver(stub):
    assert stub.libcuda.name == "libcuda.so.1" and os.readlink(stub.lib_dir / "libcuda.so") == "libcuda.so.1"
    mtime = stub.libcuda.stat().st_mtime_ns
    again = build_stub(stub.root.parent)
    assert again == stub and stub.libcuda.stat().st_mtime_ns == mtime
    assert not [p for p in stub.root.parent.iterdir() if p.name.startswith(".build-")]   # no leftovers
    soname = subprocess.run(["readelf", "-d", str(stub.libcuda)], capture_output=True, text=True).stdout
    assert "Library soname: [libcuda.so.1]" in soname


def test_build_errors_are_clear(tmp_path):
    with pytest.raises(StubBuildError, match="not found"):
        build_stub(tmp_path, cc="no-such-cc-gpulens")
    with pytest.raises(StubBuildError, match="not usable"):
        build_stub(tmp_path, cc="false")


def test_cache_dir_follows_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("GPULENS_STUB_CACHE", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("GPULENS_STUB_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert default_cache_dir() == tmp_path / "x" / "gpulens" / "stub"


def _run_python(code: str, stub, **env) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=stub.env(**env),
                         cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_driver_error_codes_follow_cuda(stub):
    """Separate process: the stand-in keeps per-process driver state, as a driver does."""
    code = f"""
import ctypes
lib = ctypes.CDLL({str(stub.libcuda)!r})
dev, ctx = ctypes.c_int(), ctypes.c_void_p()
print(lib.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, None, None, None))   # before cuInit
print(lib.cuInit(1))                                                       # flags must be 0
print(lib.cuInit(0))
print(lib.cuCtxSynchronize())                                              # no context yet
print(lib.cuDeviceGet(ctypes.byref(dev), 3))                               # one device
print(lib.cuDeviceGet(ctypes.byref(dev), 0), lib.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev))
print(lib.cuLaunchKernel(None, 1, 1, 1, 1, 1, 1, 0, None, None, None))   # null function
"""
    assert _run_python(code, stub).split() == ["3", "1", "0", "201", "101", "0", "0", "400"]


def test_sync_waits_for_queued_work_and_full_queue_blocks_launches(stub, tmp_path):
    rep = tmp_path / "r.json"
    # 20 kernels of 10 ms run one after another: the final sync cannot return before 200 ms after
    # the first launch, however the 4-deep queue splits the waiting between launches and the sync.
    # (Only a lower bound on the whole is safe: a sleep can end late, never early.)
    subprocess.run([str(stub.workload), "--lib", str(stub.libcuda), "--steps", "1", "--kernels", "20",
                    "--kernel-us", "10000", "--sync-every", "1", "--queue-depth", "4", "--report", str(rep)],
                   check=True, capture_output=True, env=stub.env(), timeout=60)
    r = json.loads(rep.read_text())
    assert r["wall_seconds"] >= 0.2 * 0.99
    assert 0 < r["sync_seconds"] < r["wall_seconds"]


def test_control_file_stops_and_switches_a_running_workload(stub, tmp_path):
    control = tmp_path / "control"
    control.write_text("")
    p = subprocess.Popen([str(stub.workload), "--lib", str(stub.libcuda), "--duration", "60", "--kernels", "5",
                          "--control", str(control), "--host-us", "1000", "--host-work", "sleep"],
                         stdout=subprocess.PIPE, text=True, env=stub.env())
    try:
        time.sleep(0.3)
        control.write_text("incident=host_sync\n")
        time.sleep(0.3)
        control.write_text("stop=1\n")
        out = p.communicate(timeout=30)[0]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    r = json.loads(out.splitlines()[-1])
    assert r["wall_seconds"] < 30
    assert r["d2h_bytes"] >= 16 << 20        # at least one host_sync copy happened


def test_unknown_flag_and_missing_library(stub):
    p = subprocess.run([str(stub.workload), "--bogus"], capture_output=True, text=True, env=stub.env())
    assert p.returncode == 1 and "usage" in p.stderr
    p = subprocess.run([str(stub.workload), "--lib", "/nonexistent/libcuda.so.1"], capture_output=True, text=True)
    assert p.returncode == 2 and "dlopen" in p.stderr


def test_stub_driver_from_python(stub):
    code = """
from gpulens.exporter.stub import StubDriver, CudaError
d = StubDriver("libcuda.so.1", kernel_us=5)   # found through LD_LIBRARY_PATH, like the real driver
for _ in range(3):
    d.step(kernels=10, h2d_bytes=1000, d2h_sync_bytes=500)
d.launch(4)
d.h2d(10, sync=True)
d.d2h(20, sync=False)
d.synchronize()
d.close()
try:
    StubDriver("libcuda.so.1", device=7)
except CudaError as e:
    print(e.call, e.code)
"""
    assert _run_python(code, stub).split() == ["cuDeviceGet", "101"]


@pytest.mark.root
@requires(bcc_usable())
def test_stub_driver_calls_are_counted_by_the_exporter(stub, libcuda, tmp_path):
    from gpulens.exporter.service import Exporter
    exp = Exporter(make_config(tmp_path, libcuda))
    exp.start()
    code = f"""
import sys
from gpulens.exporter.stub import StubDriver
d = StubDriver({str(libcuda)!r})
print("ready", flush=True)
sys.stdin.readline()
for _ in range(5):
    d.step(kernels=20, h2d_bytes=4096, d2h_sync_bytes=100)
d.close()
print("done", flush=True)
sys.stdin.readline()
"""
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         cwd=REPO, env=stub.env())
    try:
        assert p.stdout.readline().startswith("ready")

        def attached():
            exp.tick()
            return bool(exp.probes.libraries)
        wait_for(attached, what="probes attached")
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.stdout.readline().startswith("done")
        s = scrape(exp)
        name = {"pod": Path(f"/proc/{p.pid}/comm").read_text().strip()}
        assert value(s, "gpulens_kernel_launches_total", **name) == 100
        assert value(s, "gpulens_memcpy_bytes_total", direction="h2d", **name) == 5 * 4096
        assert value(s, "gpulens_memcpy_bytes_total", direction="d2h", **name) == 5 * (100 + 4)
        assert value(s, "gpulens_sync_calls_total", **name) == 10      # 5 DtoH copies + 5 stream syncs
    finally:
        p.kill()
        p.wait(10)
        p.stdin.close()
        p.stdout.close()
        exp.close()

