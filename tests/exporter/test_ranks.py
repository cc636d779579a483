"""One series per worker: the `rank` label from the worker's LOCAL_RANK (its environment, else its
registration record), bounded to small integers; real processes, real /proc."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from gpulens.exporter.attribution import Attributor, rank_label
from gpulens.exporter.procfs import ProcFS
from gpulens.exporter.registrations import RegistrationIndex

from tests.conftest import requires

from .conftest import bcc_usable, make_config, registration, scrape, value, wait_for


@pytest.fixture
def spawn():
    procs: list[subprocess.Popen] = []

    def start(env: dict[str, str] | None = None) -> subprocess.Popen:
        full = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
        full.update(env or {})
        p = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE, env=full)
        procs.append(p)
        return p
    yield start
    for p in procs:
        p.kill()
        p.wait(10)
        p.stdin.close()


@pytest.mark.parametrize("raw,label", [
    ("0", "0"), ("7", "7"), ("1023", "1023"), (" 3 ", "3"), (5, "5"),
    ("1024", ""), ("99999", ""), ("-1", ""), ("x", ""), ("", ""), ("٣", ""), (None, ""), (True, ""), (-2, ""),
    ("0" * 5, ""),
])
def test_rank_label_is_a_small_integer_or_nothing(raw, label):
    assert rank_label(raw) == label


def test_rank_comes_from_the_workers_environment(spawn, tmp_path):
    workers = [spawn({"LOCAL_RANK": str(i)}) for i in range(3)]
    plain, hostile = spawn(), spawn({"LOCAL_RANK": "../../etc"})
    time.sleep(0.05)
    attributor = Attributor(ProcFS())
    assert [attributor.attribute(p.pid).rank for p in workers] == ["0", "1", "2"]
    assert attributor.attribute(plain.pid).rank == "" and attributor.attribute(hostile.pid).rank == ""
    assert ProcFS().environ(workers[2].pid, "LOCAL_RANK") == "2"
    assert ProcFS().environ(plain.pid, "LOCAL_RANK") is None
    assert ProcFS().environ(999_999_999, "LOCAL_RANK") is None


def test_rank_falls_back_to_the_registration_record(spawn, tmp_path):
    p = spawn()
    time.sleep(0.05)
    registration(tmp_path, p.pid, "trainer-0", local_rank=5)
    index = RegistrationIndex(tmp_path, ProcFS())
    index.refresh()
    w = Attributor(ProcFS(), registrations=index).attribute(p.pid)
    assert (w.pod, w.rank) == ("trainer-0", "5")
    # the environment wins over the record (it is the process's own)
    q = spawn({"LOCAL_RANK": "2"})
    time.sleep(0.05)
    registration(tmp_path, q.pid, "trainer-0", local_rank=6)
    index.refresh()
    assert Attributor(ProcFS(), registrations=index).attribute(q.pid).rank == "2"


@pytest.mark.parametrize("bad", ["3", -1, True, None, 1.5])
def test_a_records_bad_local_rank_is_ignored(spawn, tmp_path, bad):
    p = spawn()
    time.sleep(0.05)
    registration(tmp_path, p.pid, "trainer-0", local_rank=bad)
    index = RegistrationIndex(tmp_path, ProcFS())
    index.refresh()
    assert index.match(p.pid).local_rank is None
    assert Attributor(ProcFS(), registrations=index).attribute(p.pid).rank == ""


@pytest.mark.root
@requires(bcc_usable())
def test_two_workers_of_one_pod_are_two_series(libcuda, tmp_path, exporter_for, workloads):
    """torchrun --nproc-per-node=2 in one container: each worker's launches and blocked time in its
    own series (rank 0, rank 1), never summed into one."""
    reg = tmp_path / "registry"
    exp = exporter_for(make_config(tmp_path, libcuda, registry_dir=reg))
    workers = [workloads(libcuda, "--steps", str(steps), "--kernels", "10", "--sync-every", "1",
                         env={"LOCAL_RANK": str(rank)}) for rank, steps in ((0, 10), (1, 30))]
    for w in workers:
        registration(reg, w.pid, "trainer-0", namespace="ml")
    wait_for(lambda: (exp.tick(), bool(exp.probes.libraries))[1], what="probes attached")
    for w in workers:
        w.go()
    for w in workers:
        w.report()

    def counted():
        s = scrape(exp)
        return s if value(s, "gpulens_kernel_launches_total", rank="1") == 300 else None
    s = wait_for(counted, what="both workers counted")
    assert value(s, "gpulens_kernel_launches_total", pod="trainer-0", rank="0") == 100
    assert value(s, "gpulens_sync_calls_total", pod="trainer-0", rank="1") >= 30
    assert value(s, "gpulens_kernel_launches_total", pod="trainer-0", rank="") is None
