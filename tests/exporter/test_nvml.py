"""NVML as a source: missing NVML, runtime failures, contention, and the stand-in's NVML view."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpulens.exporter.config import ExporterConfig
from gpulens.exporter.health import SourceHealth
from gpulens.exporter.nvml import NvmlSource, NvmlUnavailable, open_nvml
from gpulens.exporter.nvml.api import GpuProcess, UtilSample
from gpulens.exporter.nvml.fake import FakeNvml
from gpulens.exporter.nvml.pynvml_api import PynvmlApi
from gpulens.exporter.nvml.stub_api import StubNvmlApi
from gpulens.exporter.service import Exporter

from .conftest import missing, registration, scrape, value


@pytest.fixture
def sleepers():
    procs = []

    def start(n):
        for _ in range(n):
            procs.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]))
        return procs[-n:]
    yield start
    for p in procs:
        p.kill()
        p.wait(10)


def test_no_driver_here_means_disabled_with_reason():
    try:
        api = PynvmlApi()
    except NvmlUnavailable as exc:
        reason = str(exc)
    else:   # pragma: no cover - a machine with a GPU
        api.close()
        pytest.skip("NVML is available on this machine")
    src = NvmlSource(PynvmlApi, SourceHealth("nvml"))
    assert src.health.view()[:2] == ("disabled", reason)
    assert not src.enabled and src.snapshot().devices == ()


def test_off_and_bad_spec():
    assert open_nvml("off") is None
    src = NvmlSource(None, SourceHealth("nvml"))
    assert src.health.view()[:2] == ("disabled", "NVML disabled (--nvml off)")
    with pytest.raises(ValueError):
        open_nvml("maybe")


def test_opening_is_retried_later():
    clock = [0.0]
    state = {"available": False}
    fake = FakeNvml()

    def opener():
        if not state["available"]:
            raise NvmlUnavailable("driver not loaded")
        return fake
    src = NvmlSource(opener, SourceHealth("nvml"), retry_s=60, clock=lambda: clock[0])
    assert not src.enabled
    state["available"] = True
    clock[0] = 30
    src.snapshot()
    assert not src.enabled                 # not before the retry interval
    clock[0] = 61
    src.snapshot()
    assert src.enabled and src.health.view()[0] == "ok"


def test_runtime_failure_is_counted_and_recovers():
    fake = FakeNvml(gpus=1)
    fake.processes[0] = [GpuProcess(123, 10)]
    src = NvmlSource(lambda: fake, SourceHealth("nvml"))
    assert src.snapshot().gpu_label(123) == "0"
    fake.fail_with = "Unknown Error: GPU is lost"
    snap = src.snapshot()
    assert snap.processes == {} and src.health.view() == ("failing", "Unknown Error: GPU is lost", 1)
    fake.fail_with = None
    assert src.snapshot().gpu_label(123) == "0" and src.health.view()[0] == "ok"


def test_utilisation_keeps_latest_sample_and_drops_gone_processes():
    fake = FakeNvml(gpus=2)
    fake.processes[0] = [GpuProcess(1, 0)]
    fake.processes[1] = [GpuProcess(1, 0), GpuProcess(2, 0)]
    fake.samples[0] = [UtilSample(1, 100, 40.0), UtilSample(1, 200, 55.0)]
    src = NvmlSource(lambda: fake, SourceHealth("nvml"))
    snap = src.snapshot()
    assert snap.util[(0, 1)] == pytest.approx(0.55)
    assert snap.gpu_label(1) == "0,1" and snap.gpu_label(2) == "1" and snap.gpu_label(3) is None
    fake.samples[0] = []                       # no new samples: the last one stays
    assert src.snapshot().util[(0, 1)] == pytest.approx(0.55)
    fake.processes[0] = []
    assert (0, 1) not in src.snapshot().util


def test_contention_memory_and_utilisation_per_pod(sleepers, tmp_path):
    a1, a2, b, c = sleepers(4)
    reg = tmp_path / "reg"
    registration(reg, a1.pid, "trainer-a")
    registration(reg, a2.pid, "trainer-a")             # two processes of one pod
    registration(reg, b.pid, "batch-b", namespace="team-b", container="job", job_id="nightly-batch")
    registration(reg, c.pid, "alone", namespace="team-c")
    fake = FakeNvml(gpus=3)
    fake.processes[0] = [GpuProcess(a1.pid, 2 << 30), GpuProcess(a2.pid, 1 << 30), GpuProcess(b.pid, 3 << 30)]
    fake.processes[1] = [GpuProcess(c.pid, None)]
    fake.samples[0] = [UtilSample(a1.pid, 10, 30.0), UtilSample(a2.pid, 10, 20.0), UtilSample(b.pid, 10, 45.0)]
    exp = Exporter(ExporterConfig(node="n1", ebpf=False, registry_dir=reg, nvml="off"), nvml_opener=lambda: fake)
    exp.start()
    try:
        exp.tick()
        s = scrape(exp)
        assert value(s, "gpulens_gpu_pods", gpu="0") == 2
        assert value(s, "gpulens_gpu_processes", gpu="0") == 3
        assert value(s, "gpulens_gpu_pods", gpu="1") == 1
        assert value(s, "gpulens_gpu_pods", gpu="2") == 0 and value(s, "gpulens_gpu_processes", gpu="2") == 0
        assert value(s, "gpulens_process_gpu_memory_bytes", gpu="0", pod="trainer-a") == 3 << 30
        assert value(s, "gpulens_process_gpu_memory_bytes", gpu="0", pod="batch-b", namespace="team-b",
                     container="job", gpulens_job="nightly-batch") == 3 << 30
        # each pod's series carries its own record's job_id
        assert value(s, "gpulens_process_gpu_memory_bytes", gpu="0", pod="trainer-a", gpulens_job="job1") == 3 << 30
        assert value(s, "gpulens_process_gpu_memory_bytes", gpu="0", pod="batch-b", gpulens_job="job1") is None
        assert value(s, "gpulens_process_gpu_memory_bytes", gpu="1", pod="alone") is None      # unknown memory
        assert value(s, "gpulens_process_gpu_utilization_ratio", gpu="0", pod="trainer-a") == pytest.approx(0.5)
        assert value(s, "gpulens_exporter_source_up", source="nvml") == 1
        fake.fail_with = "NVML call failed"
        s = scrape(exp, tick=False)
        assert value(s, "gpulens_gpu_pods", gpu="0") is None
        assert value(s, "gpulens_exporter_source_up", source="nvml") == 0
        assert value(s, "gpulens_exporter_source_errors_total", source="nvml") == 1
    finally:
        exp.close()


def test_stub_nvml_view_of_real_stand_in_processes(stub, workloads, libcuda, tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    env = {"GPULENS_STUB_STATE_DIR": str(state), "GPULENS_STUB_DEVICES": "2"}
    w0 = workloads(libcuda, "--steps", "2000", "--kernels", "10", "--kernel-us", "50", "--sync-every", "1", env=env)
    w1 = workloads(libcuda, "--device", "1", "--steps", "1", env=env)
    killed = workloads(libcuda, "--steps", "1", env=env)
    api = StubNvmlApi(state, devices=1)
    assert [d.index for d in api.devices()] == [0, 1]
    assert {p.pid for p in api.compute_processes(0)} == {w0.pid, killed.pid}
    assert api.compute_processes(1) == [GpuProcess(w1.pid, 1 << 20)]
    killed.kill()                          # SIGKILL: its state file stays behind, its pid does not
    assert {p.pid for p in api.compute_processes(0)} == {w0.pid}
    api.process_utilization(0, 0)
    w0.go()
    time.sleep(0.5)
    (sample,) = api.process_utilization(0, 0)
    assert sample.pid == w0.pid and sample.sm_percent > 20
    w0.report()
    assert w0.finish() == 0
    assert not [f for f in (state / "gpu0").iterdir() if f.name.endswith(f".{w0.pid}")]   # a clean exit removes its file


def _in_own_pid_namespace(stub, libcuda, env) -> tuple[subprocess.Popen, int]:
    """A stand-in process as a container runs it: pid 1 of a PID namespace of its own (unshare), so
    the pid it writes is not the node's. Returns the unshare process and the workload's node pid."""
    proc = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", str(stub.workload), "--lib", str(libcuda),
                             "--wait-stdin", "--steps", "1"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=stub.env(**env))
    line = proc.stdout.readline()
    assert line.startswith("ready"), (line, proc.stderr.read() if proc.poll() is not None else "")
    (child,) = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    return proc, int(child)


def test_stub_nvml_reports_the_node_pid_of_a_process_in_its_own_pid_namespace(stub, libcuda, tmp_path):
    """NVML reports node pids. Two containers' processes that are each pid 1 in their own namespace
    are two processes, each reported by its node pid (the exporter attributes pods by it)."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        missing("unshare as root (util-linux)")
    state = tmp_path / "state"
    state.mkdir()
    env = {"GPULENS_STUB_STATE_DIR": str(state)}
    started = []
    try:
        for _ in range(2):
            started.append(_in_own_pid_namespace(stub, libcuda, env))
        node_pids = {pid for _, pid in started}
        files = sorted(f.name for f in (state / "gpu0").iterdir())
        assert len(files) == 2 and all(f.endswith(".1") for f in files), files     # each is pid 1 to itself
        api = StubNvmlApi(state)
        assert {p.pid for p in api.compute_processes(0)} == node_pids
        assert {p.pid for p in api.compute_processes(0)} == node_pids                # again, from what it found
        proc, pid = started.pop()
        proc.kill()                                                                  # --kill-child: the workload too
        proc.wait(10)
        wait_gone = time.monotonic() + 10
        while Path(f"/proc/{pid}").exists() and time.monotonic() < wait_gone:
            time.sleep(0.05)
        assert {p.pid for p in api.compute_processes(0)} == node_pids - {pid}       # its file stays; it is not listed
    finally:
        for proc, _ in started:
            proc.kill()
            proc.wait(10)


def test_stub_nvml_needs_its_directory(tmp_path):
    with pytest.raises(NvmlUnavailable, match="does not exist"):
        StubNvmlApi(tmp_path / "missing")
