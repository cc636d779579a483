"""Worker registry: records -> host pids through NSpid, across real pid namespaces."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpulens.capture.agent.registry import ProcFs, WorkerRegistry
from tests.agent.conftest import wait_until
from tests.conftest import is_root
from tests.conftest import requires


def record(**over) -> dict:
    rec = {"schema_version": 1, "job_id": "j", "attempt": 0, "namespace": "ns", "pod": "p", "pod_uid": "u",
           "container": "c", "node": "n", "global_rank": 0, "local_rank": 0, "world_size": 2, "local_world_size": 2,
           "pid": os.getpid(), "host_pid": None, "pid_namespace": os.readlink("/proc/self/ns/pid"),
           "kineto_job_id": 5, "start_time": time.time(), "trace_dir": "/t", "socket_dir": ""}
    rec.update(over)
    return rec


def write(reg: Path, name: str, rec: dict) -> Path:
    path = reg / name
    path.write_text(json.dumps(rec))
    return path


@pytest.fixture
def sleeper():
    procs = []

    def start(*prefix: str) -> subprocess.Popen:
        p = subprocess.Popen([*prefix, sys.executable, "-c", "import time; time.sleep(60)"])
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.kill()
        p.wait()


def innermost_child(pid: int) -> int:
    """The process `unshare --fork` started (pid 1 in its new namespace)."""
    def child():
        try:
            kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            return None
        return int(kids[0]) if kids else None
    return wait_until(child, 10)


def test_a_live_worker_resolves_even_with_a_wrong_hint(tmp_path, sleeper):
    p = sleeper()
    write(tmp_path, "a.json", record(pid=p.pid, host_pid=1, start_time=time.time() + 1))
    [w] = WorkerRegistry(tmp_path).workers()
    assert w.alive and w.host_pid == p.pid
    assert w.to_dict()["host_pid"] == p.pid and w.to_dict()["alive"] is True


def test_a_reused_pid_is_not_the_worker(tmp_path, sleeper):
    p = sleeper()
    # the record was written 100 s before this process started: the pid was reused
    write(tmp_path, "a.json", record(pid=p.pid, host_pid=p.pid, start_time=time.time() - 100))
    [w] = WorkerRegistry(tmp_path).workers()
    assert not w.alive and w.host_pid is None


def test_exited_workers_are_gone_and_their_stale_records_removed(tmp_path, sleeper):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive = sleeper()
    gone_path = write(tmp_path, "gone.json", record(pid=dead.pid, global_rank=1))
    live_path = write(tmp_path, "live.json", record(pid=alive.pid, start_time=time.time() + 1))
    reg = WorkerRegistry(tmp_path, stale_grace_s=3600)
    assert reg.remove_stale() == []  # within the grace period nothing is removed
    gone = reg.find("j", 0, 1)
    assert gone is not None and not gone.alive
    reg.stale_grace_s = 0
    assert reg.remove_stale() == [gone_path]
    assert not gone_path.exists() and live_path.exists()


def test_bad_files_are_skipped_and_temp_files_ignored(tmp_path, sleeper):
    p = sleeper()
    write(tmp_path, "good.json", record(pid=p.pid, start_time=time.time() + 1))
    (tmp_path / "broken.json").write_text("{not json")
    bad = record()
    del bad["kineto_job_id"]
    write(tmp_path, "schema.json", bad)
    write(tmp_path, ".good.json.123.tmp", record())
    (tmp_path / "notes.txt").write_text("x")
    for i, shape in enumerate(("null", "[]", '"rec"', "5", '{"pid": "x"}')):  # valid JSON, wrong shape
        (tmp_path / f"shape{i}.json").write_text(shape)
    workers = WorkerRegistry(tmp_path).workers()
    assert [w.path.name for w in workers] == ["good.json"]
    # the hook's files belong to live workers: skipped, never moved or deleted by a reader
    assert len(list(tmp_path.glob("shape*.json"))) == 5


def test_find_prefers_the_live_record_of_a_rank(tmp_path, sleeper):
    p = sleeper()
    write(tmp_path, "old.json", record(pid=999999, start_time=time.time() - 50))
    write(tmp_path, "new.json", record(pid=p.pid, start_time=time.time() + 1))
    w = WorkerRegistry(tmp_path).find("j", 0, 0)
    assert w is not None and w.alive and w.record.pid == p.pid
    assert WorkerRegistry(tmp_path).find("j", 1, 0) is None
    assert WorkerRegistry(tmp_path).find("j", 0, 0, pod_uid="another-pod") is None


def test_two_replicas_without_pod_uids_are_told_apart_by_pod_name(tmp_path, sleeper):
    """Two serving replicas on one node are both rank 0 of one revision. Armed without the
    downward-API uid, only the pod's name tells them apart: each dispatch must find its own pod's
    process (the serving demo once archived the healthy replica's trace twice)."""
    a, b = sleeper(), sleeper()
    write(tmp_path, "a.json", record(pod="web-a", pod_uid="", pid=a.pid))
    write(tmp_path, "b.json", record(pod="web-b", pod_uid="", pid=b.pid, start_time=time.time() + 1))
    reg = WorkerRegistry(tmp_path)
    assert reg.find("j", 0, 0, pod="web-a").record.pid == a.pid
    assert reg.find("j", 0, 0, pod="web-b").record.pid == b.pid
    assert reg.find("j", 0, 0, pod="web-c") is None
    # a uid on both sides decides alone: a pod name reused by a new pod (new uid, newer record) is not it
    write(tmp_path, "c.json", record(pod="web-a", pod_uid="uid-new", pid=b.pid, start_time=time.time() + 2))
    found = reg.find("j", 0, 0, pod_uid="uid-old", pod="web-a")
    assert (found.record.pod_uid, found.record.pid) == ("", a.pid)
    assert reg.find("j", 0, 0, pod_uid="uid-new", pod="web-a").record.pod_uid == "uid-new"


@pytest.mark.root
@requires(None if is_root() else "needs root for unshare --pid")
def test_two_pid_namespaces_with_the_same_pid_resolve_to_different_processes(tmp_path, sleeper):
    a = sleeper("unshare", "--pid", "--fork", "--mount-proc")
    b = sleeper("unshare", "--pid", "--fork", "--mount-proc")
    host_a, host_b = innermost_child(a.pid), innermost_child(b.pid)
    ns_a, ns_b = os.readlink(f"/proc/{host_a}/ns/pid"), os.readlink(f"/proc/{host_b}/ns/pid")
    assert ns_a != ns_b
    assert ProcFs().nspids(host_a)[-1] == 1 == ProcFs().nspids(host_b)[-1]  # both are pid 1 inside
    later = time.time() + 1
    # what the hook writes inside such a namespace: pid 1, and a host_pid hint of 1 (its own /proc)
    write(tmp_path, "a.json", record(pid=1, host_pid=1, pid_namespace=ns_a, global_rank=0, start_time=later))
    write(tmp_path, "b.json", record(pid=1, host_pid=1, pid_namespace=ns_b, global_rank=1, start_time=later))
    reg = WorkerRegistry(tmp_path)
    assert reg.find("j", 0, 0).host_pid == host_a
    assert reg.find("j", 0, 1).host_pid == host_b
    assert reg.is_same_process(host_a, 1, ns_a, later) and not reg.is_same_process(host_a, 1, ns_b, later)


def test_proc_stat_parsing_survives_odd_command_names(tmp_path):
    proc = tmp_path / "proc"
    (proc / "42").mkdir(parents=True)
    fields = ["S"] + ["0"] * 18 + ["500"] + ["0"] * 10  # field 22 (starttime) = 500 ticks
    (proc / "42" / "stat").write_text("42 (evil) name (x)) " + " ".join(fields) + "\n")
    (proc / "stat").write_text("cpu 1 2 3\nbtime 1000\n")
    (proc / "42" / "status").write_text("Name:\tx\nNSpid:\t42\t7\n")
    fs = ProcFs(proc)
    assert fs.start_time(42) == 1000 + 500 / os.sysconf("SC_CLK_TCK")
    assert fs.nspids(42) == [42, 7]
    assert fs.pids() == [42]
