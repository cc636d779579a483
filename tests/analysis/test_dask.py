"""The per-rank map on Dask: a worker that dies costs its rank (retried, then `unanalysable` with the
reason) and never the report; an existing cluster (`--scheduler`) runs the ranks; the local
cluster's workers are sized from the largest trace."""

from __future__ import annotations

import gzip
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpulens.capture.analysis import AnalyzeOptions, analyze_manifest
from gpulens.capture.analysis.dask_map import (GZIP_EXPANSION, JSON_FACTOR, MIN_WORKER_BYTES, RETRIES, WORKER_BASE_BYTES,
                                       plan_cluster)

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

WORKER_LIMIT = 450 << 20   # holds a worker with HTA and the small rank (~180 MB), not the big one


def _big_trace(small: Path, target_json_bytes: int) -> bytes:
    """The real rank-1 events repeated (shifted in time) until the JSON is about `target_json_bytes`."""
    doc = json.loads(gzip.decompress(small.read_bytes()))
    events = doc["traceEvents"]
    xs = [e for e in events if e.get("ph") == "X" and isinstance(e.get("ts"), (int, float))]
    span = max(e["ts"] + e.get("dur", 0) for e in xs) - min(e["ts"] for e in xs) + 1
    one = len(json.dumps(events))
    copies = []
    for k in range(max(1, target_json_bytes // one)):
        copies.extend(dict(e, ts=e["ts"] + k * span) if "ts" in e else e for e in events)
    doc["traceEvents"] = copies
    return json.dumps(doc).encode()


def test_a_rank_whose_worker_dies_is_reported_and_the_others_analysed(builder, trace_filter):
    big = _big_trace(trace_filter[1], 120 << 20)   # parsing it needs several times its 120 MB
    capture = builder().add(0, trace_filter[0]).add(1, big, file_name="rank-1.json").write()
    run = analyze_manifest(capture.manifest_uri, AnalyzeOptions(jobs=2, worker_memory=WORKER_LIMIT))
    ranks = {r["rank"]: r for r in run.summary["ranks"]}
    assert ranks[0]["status"] == "analysed"
    assert (ranks[1]["status"], ranks[1]["reason"]) == ("excluded", "unanalysable")
    assert f"died {RETRIES + 1} time(s)" in ranks[1]["detail"] and "memory limit 450 MiB" in ranks[1]["detail"]
    assert run.analysed and run.summary["counts"]["analysed"] == 1
    assert [r["rank"] for r in run.summary["analyses"]["temporal_breakdown"]["result"]["per_rank"]] == [0]
    html = (capture.dir / "analysis" / "report.html").read_text()
    assert "unanalysable" in html
    assert not (capture.dir / "traces" / "rank-1.analysis.json").exists()  # no worker lived to write it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_cluster(tmp_path, workers: int):
    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    dask = str(Path(sys.executable).with_name("dask"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    procs = [subprocess.Popen([dask, "scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)]
    try:
        for _ in range(workers):
            procs.append(subprocess.Popen([dask, "worker", address, "--nworkers", "1", "--nthreads", "1",
                                           "--no-nanny", "--no-dashboard", "--memory-limit", "2GiB"],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=tmp_path))
        from distributed import Client
        deadline = time.monotonic() + 120
        while True:
            try:
                with Client(address, timeout=5) as c:
                    if len(c.scheduler_info()["workers"]) == workers:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the Dask cluster did not come up"
            time.sleep(0.5)
        yield address, [p.pid for p in procs[1:]]
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.fixture
def external_cluster(tmp_path):
    """A real Dask cluster started with its own CLIs (`dask scheduler`, `dask worker`), as a
    deployment runs it: one worker; yields (address, [worker pid])."""
    yield from _start_cluster(tmp_path, 1)


@pytest.fixture
def two_worker_cluster(tmp_path):
    yield from _start_cluster(tmp_path, 2)


def test_an_existing_cluster_runs_the_ranks(builder, trace_filter, external_cluster):
    address, (worker_pid,) = external_cluster
    capture = builder().add(0, trace_filter[0]).add(1, trace_filter[1]).write()
    out = subprocess.run([sys.executable, "-m", "gpulens.cli", "analyze", capture.manifest_uri, "--scheduler", address],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "event=dask.connected" in out.stderr and "event=dask.started" not in out.stderr
    for r in (0, 1):
        doc = json.loads((capture.dir / "traces" / f"rank-{r}.analysis.json").read_text())
        assert doc["status"] == "analysed" and doc["worker"]["pid"] == worker_pid  # ran on that cluster's worker
    summary = json.loads((capture.dir / "analysis" / "summary.json").read_text())
    assert summary["counts"]["analysed"] == 2
    # the summary and the report say where: that cluster, and each rank's worker host
    assert summary["analysed_on"] == {"scheduler": address, "workers": 1}
    assert [r["worker"] for r in summary["ranks"]] == [socket.gethostname()] * 2
    assert f"Ranks analysed on the Dask cluster {address} (1 worker)" in (
        capture.dir / "analysis" / "report.html").read_text()


def test_a_worker_lost_mid_analysis_costs_a_retry_not_the_rank(builder, trace_filter, two_worker_cluster):
    """As when a worker pod is deleted: the worker holding rank 1 is killed while it works on it;
    the scheduler gives the rank to the other worker and the capture is analysed whole."""
    import signal
    import threading

    from distributed import Client

    address, pids = two_worker_cluster
    capture = builder().add(0, trace_filter[0]).add(1, trace_filter[1]).write()
    killed = []

    def kill_rank_1_worker():
        with Client(address, timeout=10) as c:
            pid_of = c.run(os.getpid)  # worker address -> its process
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline and not killed:
                for addr, keys in c.processing().items():
                    if any("gpulens-rank-1-" in str(k) for k in keys) and addr in pid_of:
                        os.kill(pid_of[addr], signal.SIGKILL)
                        killed.append(pid_of[addr])
                        return
                time.sleep(0.05)

    killer = threading.Thread(target=kill_rank_1_worker)
    killer.start()
    out = subprocess.run([sys.executable, "-m", "gpulens.cli", "analyze", capture.manifest_uri, "--scheduler", address],
                         capture_output=True, text=True, timeout=300)
    killer.join()
    assert out.returncode == 0, out.stderr[-3000:]
    assert killed and killed[0] in pids
    doc = json.loads((capture.dir / "traces" / "rank-1.analysis.json").read_text())
    assert doc["status"] == "analysed" and doc["worker"]["pid"] != killed[0]  # redone on the surviving worker
    summary = json.loads((capture.dir / "analysis" / "summary.json").read_text())
    assert summary["counts"]["analysed"] == 2


def test_an_unreachable_scheduler_is_a_clear_error(builder, trace_filter):
    capture = builder().add(0, trace_filter[0]).write()
    address = f"tcp://127.0.0.1:{_free_port()}"
    out = subprocess.run([sys.executable, "-m", "gpulens.cli", "analyze", capture.manifest_uri, "--scheduler", address],
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT="2s"))
    assert out.returncode == 1 and out.stdout == ""
    assert f"cannot reach the Dask scheduler {address}" in out.stderr
    assert not (capture.dir / "analysis").exists()


@pytest.mark.parametrize("args, message", [
    (["--scheduler", "http://127.0.0.1:8786"], "--scheduler must be tcp://"),
    (["--worker-memory", "lots"], "not a size"),
    (["--worker-memory", "100MB"], "below 256 MiB"),
    (["--jobs", "0"], "--jobs must be between 1 and 64"),
])
def test_bad_cluster_arguments_are_refused(builder, trace_filter, args, message):
    capture = builder().add(0, trace_filter[0]).write()
    out = subprocess.run([sys.executable, "-m", "gpulens.cli", "analyze", capture.manifest_uri, *args],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and message in out.stderr and out.stdout == ""


class _A:
    def __init__(self, size: int, uri: str = "file:///x/rank.json"):
        self.size, self.uri = size, uri


def test_workers_are_sized_from_the_largest_trace(monkeypatch):
    monkeypatch.setattr("gpulens.capture.analysis.dask_map._total_memory", lambda: 64 << 30)
    p = plan_cluster([_A(10 << 20), _A(300 << 20)], jobs=4, scheduler=None, memory_limit=None)
    assert p.workers == 2  # no more workers than ranks
    assert p.memory_limit == WORKER_BASE_BYTES + JSON_FACTOR * (300 << 20)
    gz = plan_cluster([_A(10 << 20, "file:///x/rank.json.gz")], jobs=1, scheduler=None, memory_limit=None)
    assert gz.memory_limit == WORKER_BASE_BYTES + JSON_FACTOR * GZIP_EXPANSION * (10 << 20)  # opened by suffix
    huge = plan_cluster([_A(4 << 30)], jobs=1, scheduler=None, memory_limit=None)
    assert huge.memory_limit == int((64 << 30) * 0.9) and "capped" in huge.why  # never more than the machine
    tiny = plan_cluster([_A(1 << 10)], jobs=1, scheduler=None, memory_limit=None)
    assert tiny.memory_limit == MIN_WORKER_BYTES


def test_fewer_workers_when_they_would_not_fit(monkeypatch):
    monkeypatch.setattr("gpulens.capture.analysis.dask_map._total_memory", lambda: 10 << 30)
    p = plan_cluster([_A(1 << 30)] * 8, jobs=8, scheduler=None, memory_limit=None)
    per = WORKER_BASE_BYTES + JSON_FACTOR * (1 << 30)
    assert p.workers == max(1, int((10 << 30) * 0.9) // per) < 8 and "fit" in p.why
    assert re.search(r"only \d+ fit", p.why)


def test_workers_are_sized_from_the_real_manifests_uncompressed_size(monkeypatch, shared_traces):
    """Issue 43: the real `Artifact` (as a manifest file holds it), not a stand-in: the JSON size is
    `sizes["uncompressed"]`, what the agent counted while it verified. A real Kineto trace that
    compresses better than 12x (repeated names and keys) must not be sized as if it did not."""
    import gzip as _gzip

    from gpulens.capture.models import Manifest
    monkeypatch.setattr("gpulens.capture.analysis.dask_map._total_memory", lambda: 256 << 30)
    stored = (shared_traces / "hta_trace_filter_2rank" / "sampled_rank-0.json.gz").read_bytes()
    json_bytes = len(_gzip.decompress(stored))          # a real Kineto trace: its own ratio, not a guess
    art = {"target_id": "rank-0", "rank": 0, "local_rank": 0, "node": "n", "pod": "p", "pid": 1, "attempt": 0,
           "uri": "file:///x/traces/rank-0.json.gz", "size": len(stored), "sha256": "0" * 64, "trace_id": None,
           "sizes": {"budget": None, "estimate": None, "uncompressed": json_bytes, "stored": len(stored),
                     "encoding": "gzip"}}
    m = Manifest.from_dict({"schema_version": 1, "capture_id": "c-1", "job_id": "j", "attempt": 0,
                            "window": {"requested_at": 0, "duration_ms": 1}, "expected_targets": [],
                            "artifacts": [art], "failures": [], "created_at": 0})
    plan = plan_cluster(m.artifacts, jobs=1, scheduler=None, memory_limit=None)
    assert json_bytes > GZIP_EXPANSION * len(stored)     # this one compresses better than the guess
    from gpulens.capture.analysis import dask_map
    assert dask_map._json_bytes(m.artifacts[0]) == json_bytes   # the size that sizes the worker, read from the model
    assert plan.memory_limit == max(MIN_WORKER_BYTES, WORKER_BASE_BYTES + JSON_FACTOR * json_bytes), plan.why
