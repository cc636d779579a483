"""DESIGN.md's three incidents, reproduced by the workload on the stand-in, seen through the exporter.

One trainer ("victim", GPU-bound: 100 kernels x 100 µs per step, 4 MB batch copy, 3 ms of host
work, loss.item() every 20 steps) runs a baseline window, then the incident; rates are computed
from two scrapes per window. The signatures asserted are the relationships, with wide margins:

    incident          demand        back-pressure    contention   transfers
    host_sync         ~flat         way up           1            D2H way up, H2D ~flat
    noisy_neighbor    down          not up           2            H2D down with demand
    input_starvation  down          down             1            H2D down
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass

import pytest

from gpulens.exporter.nvml.stub_api import StubNvmlApi
from gpulens.exporter.service import Exporter

from .conftest import make_config, registration, requires_ebpf, wait_for

pytestmark = [*requires_ebpf, pytest.mark.slow]

VICTIM = ["--kernels", "100", "--kernel-us", "100", "--h2d-bytes", "4000000", "--host-us", "3000",
          "--host-work", "sleep", "--sync-every", "20", "--duration", "60"]
WINDOW = 3.0


@dataclass
class Rates:
    demand: float
    blocked: float
    h2d: float
    d2h: float
    gpu_pods: int
    gpu_processes: int


class Scenario:
    def __init__(self, stub, libcuda, tmp_path):
        self.stub, self.lib = stub, libcuda
        self.state = tmp_path / "stub-state"
        self.state.mkdir()
        self.reg = tmp_path / "registry"
        self.control = tmp_path / "control"
        self.control.write_text("")
        self.env = stub.env(GPULENS_STUB_STATE_DIR=str(self.state))
        self.exp = Exporter(make_config(tmp_path, libcuda, registry_dir=self.reg, nvml="off"),
                            nvml_opener=lambda: StubNvmlApi(self.state))
        self.exp.start()
        self.procs: list[subprocess.Popen] = []

    def start(self, pod: str, args: list[str], namespace: str = "ml", wait: bool = True) -> subprocess.Popen:
        cmd = [str(self.stub.workload), "--lib", str(self.lib), *(["--wait-stdin"] if wait else []), *args]
        p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=self.env)
        self.procs.append(p)
        if wait:
            assert p.stdout.readline().startswith("ready")
        registration(self.reg, p.pid, pod, namespace=namespace)
        return p

    def go(self, p) -> None:
        def ready():
            self.exp.tick()
            return bool(self.exp.probes.libraries)
        wait_for(ready, what="probes attached")
        p.stdin.write("go\n")
        p.stdin.flush()

    def set(self, **knobs) -> None:
        self.control.write_text("".join(f"{k}={v}\n" for k, v in knobs.items()))

    def _totals(self, pod: str):
        self.exp.tick()
        d = self.exp.scrape_data()
        mine = [t for k, t in d.workload_totals.items() if k.pod == pod]
        return (time.monotonic(), sum(t.launches for t in mine), sum(t.sync_seconds for t in mine),
                sum(t.h2d_bytes for t in mine), sum(t.d2h_bytes for t in mine),
                d.gpu_pods.get("0", 0), d.gpu_processes.get("0", 0))

    def measure(self, pod: str = "victim", settle: float = 1.0) -> Rates:
        time.sleep(settle)
        a = self._totals(pod)
        time.sleep(WINDOW)
        b = self._totals(pod)
        dt = b[0] - a[0]
        return Rates(*((y - x) / dt for x, y in zip(a[1:5], b[1:5])), gpu_pods=b[5], gpu_processes=b[6])

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(10)
            for f in (p.stdin, p.stdout):
                if f:
                    f.close()
        self.exp.close()


@pytest.fixture
def scenario(stub, libcuda, tmp_path):
    s = Scenario(stub, libcuda, tmp_path)
    yield s
    s.close()


def test_host_sync(scenario):
    victim = scenario.start("victim", [*VICTIM, "--control", str(scenario.control)])
    scenario.go(victim)
    base = scenario.measure()
    scenario.set(incident="host_sync")          # a 16 MiB synchronous D2H copy every step
    inc = scenario.measure()
    assert base.gpu_pods == inc.gpu_pods == 1
    assert 0.7 * base.demand <= inc.demand <= 1.3 * base.demand, (base, inc)
    assert inc.blocked >= 0.3 and inc.blocked >= 5 * base.blocked, (base, inc)
    assert inc.d2h >= 1e8 and inc.d2h >= 100 * base.d2h, (base, inc)
    assert 0.7 * base.h2d <= inc.h2d <= 1.3 * base.h2d, (base, inc)


def test_noisy_neighbor(scenario):
    victim = scenario.start("victim", VICTIM)
    scenario.go(victim)
    base = scenario.measure()
    scenario.start("batch-job", ["--incident", "noisy_neighbor", "--kernels", "100", "--kernel-us", "100",
                                 "--duration", "30"], namespace="other-team", wait=False)
    inc = scenario.measure(settle=1.5)
    neighbour = scenario.measure(pod="batch-job", settle=0)
    assert base.gpu_pods == 1 and base.gpu_processes == 1
    assert inc.gpu_pods == 2 and inc.gpu_processes == 2, inc
    assert inc.demand <= 0.75 * base.demand, (base, inc)
    assert inc.h2d <= 0.75 * base.h2d, (base, inc)
    assert inc.blocked <= 1.5 * base.blocked + 0.02, (base, inc)       # back-pressure does not rise
    assert neighbour.demand > 0.2 * base.demand                         # the second pod adds its own


def test_input_starvation(scenario):
    victim = scenario.start("victim", [*VICTIM, "--control", str(scenario.control), "--throttle", "6"])
    scenario.go(victim)
    base = scenario.measure()
    scenario.set(incident="input_starvation")   # host work per step x6: the feed can't keep up
    inc = scenario.measure()
    assert base.gpu_pods == inc.gpu_pods == 1
    assert inc.demand <= 0.7 * base.demand, (base, inc)
    assert inc.h2d <= 0.7 * base.h2d, (base, inc)
    assert inc.blocked <= 0.75 * base.blocked, (base, inc)
    assert base.blocked > 0.005, base                                   # there was something to drop
