"""Fixtures for the exporter tests: the CUDA stand-in, workload processes, exporters, scrapes."""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpulens.exporter.config import ExporterConfig
from gpulens.exporter.stub import StubBuild, build_stub
from tests.conftest import missing, requires

DATA = Path(__file__).parent / "data"


def bcc_usable() -> str | None:
    """Why real-probe tests cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root for eBPF"
    try:
        import bcc  # noqa: F401
    except ImportError:
        return "bcc (python3-bpfcc) not installed"
    if shutil.which("gcc") is None:
        return "gcc not installed"
    return None


requires_ebpf = [pytest.mark.root, requires(bcc_usable())]


@pytest.fixture(scope="session")
def stub(tmp_path_factory) -> StubBuild:
    if shutil.which("gcc") is None:
        missing("gcc not installed")
    return build_stub(tmp_path_factory.mktemp("stub-cache"))


@pytest.fixture
def libcuda(stub, tmp_path) -> Path:
    """A private copy of the stand-in (its own inode), so only this test's processes use it."""
    d = tmp_path / "driver"
    d.mkdir()
    shutil.copy2(stub.libcuda, d / "libcuda.so.1")
    return d / "libcuda.so.1"


class Workload:
    """One cuda-workload process started with --wait-stdin: ready -> go() -> report -> finish()."""

    def __init__(self, stub: StubBuild, lib: Path, args: list[str], env: dict[str, str] | None = None):
        self.proc = subprocess.Popen([str(stub.workload), "--lib", str(lib), "--wait-stdin", *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=stub.env(**(env or {})))
        line = self.proc.stdout.readline()
        if not line.startswith("ready"):
            self.kill()
            raise RuntimeError(f"workload did not start: {line!r} {self.proc.stderr.read()}")
        self.pid = self.proc.pid
        self.unloaded = False

    def go(self) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def report(self, timeout: float = 120) -> dict:
        """Wait for the end of the loop; the process then waits on stdin (still alive)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"workload exited early: {self.proc.stderr.read()}")
            if line.startswith("unloaded"):
                self.unloaded = True
                continue
            if line.startswith("{"):
                return json.loads(line)
        raise TimeoutError("workload report")

    def finish(self, timeout: float = 30) -> int:
        try:
            self.proc.stdin.write("exit\n")
            self.proc.stdin.flush()
            self.proc.stdin.close()
        except (BrokenPipeError, ValueError):
            pass
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                f.close()
            except Exception:
                pass


@pytest.fixture
def workloads(stub):
    """Start workloads; every one still running at the end of the test is killed."""
    started: list[Workload] = []

    def start(lib: Path, *args: str, env: dict[str, str] | None = None) -> Workload:
        w = Workload(stub, lib, list(args), env)
        started.append(w)
        return w

    yield start
    for w in started:
        w.kill()


def make_config(tmp_path: Path, lib: Path | None = None, **kw) -> ExporterConfig:
    globs = (glob.escape(str(lib.parent)) + "/libcuda.so*",) if lib is not None else ("libcuda.so*",)
    base = dict(node="test-node", library_globs=globs, nvml="off", scan_interval_s=0.2,
                rescan_interval_s=0.5, attribution_grace_s=2.0, max_processes=1024, max_inflight=1024)
    base.update(kw)
    return ExporterConfig(**base)


def scrape(exporter, tick: bool = True) -> dict[tuple[str, frozenset], float]:
    """Everything on /metrics (through the real text exposition) as {(sample name, labels): value}.

    By default the discovery tick runs first, as the exporter's background loop would have by the
    time Prometheus scrapes again (a scrape alone does not pick up new or exited processes).
    """
    if tick and hasattr(exporter, "tick"):
        exporter.tick()
    text = generate_latest(exporter.registry).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: dict, name: str, **labels) -> float | None:
    """The one sample of `name` whose labels include `labels` (None if absent, error if several)."""
    hits = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    if len(hits) > 1:
        raise AssertionError(f"{len(hits)} samples of {name} match {labels}")
    return hits[0] if hits else None


def wait_for(predicate, timeout: float = 20.0, interval: float = 0.1, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)


def registration(directory: Path, pid: int, pod: str, *, namespace: str = "team-a", container: str = "trainer",
                 start_time: float | None = None, **extra) -> Path:
    """A registration record as the trainer hook writes it (capture/schemas/registration.schema.json)."""
    pidns = os.readlink(f"/proc/{pid}/ns/pid")
    rec = {
        "schema_version": 1, "job_id": "job1", "attempt": 0, "namespace": namespace, "pod": pod,
        "pod_uid": "", "container": container, "node": "test-node", "global_rank": 0, "local_rank": 0,
        "world_size": 1, "local_world_size": 1, "pid": pid, "host_pid": pid, "pid_namespace": pidns,
        "kineto_job_id": 1, "start_time": time.time() if start_time is None else start_time,
        "trace_dir": "/tmp", "socket_dir": "", **extra,
    }
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"job1__a0__r0__ns0__p{pid}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(rec))
    tmp.rename(path)
    return path


@pytest.fixture
def exporter_for():
    """Exporters started by a test, closed after it (probes detached even when the test fails)."""
    from gpulens.exporter.service import Exporter

    made: list[Exporter] = []

    def make(config, **kw) -> Exporter:
        e = Exporter(config, **kw)
        e.start()
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()
