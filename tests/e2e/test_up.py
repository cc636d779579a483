"""End to end on one machine: `gpulens up --demo --incident host_sync` takes an induced incident
through the whole loop (exporter -> Prometheus -> rule -> Alertmanager -> gateway -> coordinator
-> agent -> real Kineto traces -> verify -> archive -> manifest -> analysis -> annotation) and
then shuts down without leaving a process behind.

Needs root (eBPF uprobes on the CUDA stand-in), Prometheus and Alertmanager (scripts/setup.sh).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpulens.up.layout import Ports
from tests.conftest import missing

pytestmark = [pytest.mark.slow, pytest.mark.root]


def free_port_base(span: int = 40) -> int:
    for _ in range(50):
        base = random.randrange(20000, 40000, 50)
        ok = True
        for p in range(base, base + span):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free port range")


def get_json(url: str):
    import urllib.request
    with urllib.request.urlopen(url, timeout=3) as r:
        return json.load(r)


def processes_mentioning(text: str) -> list[str]:
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmd and str(os.getpid()) != d.name:
                found.append(f"{d.name}: {cmd[:200]}")
    return found


def linked(notes: list[dict], capture_id: str) -> list[dict] | None:
    found = [n for n in notes if capture_id in json.dumps(n) and "report.html" in n.get("text", "")]
    return found or None


def wait_for(probe, *, timeout: float, what: str, last=None):
    """The first truthy value of probe() within timeout (polled every 0.5 s); else fail with the last state."""
    end = time.monotonic() + timeout
    while True:
        try:
            value = probe()
        except OSError:
            value = None
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"{what}: not reached within {timeout} s; last: {last() if last else value!r}")
        time.sleep(0.5)


@pytest.fixture
def up_env():
    if os.geteuid() != 0:
        missing("needs root for eBPF")
    for tool in ("prometheus", "prometheus-alertmanager"):
        if not shutil.which(tool):
            missing(f"{tool} not installed (scripts/setup.sh installs it)")
    return dict(os.environ, PYTHONUNBUFFERED="1")


@pytest.mark.xfail(strict=True, reason=(
    "open finding (issue 14 follow-up): with the per-workload baselines, under `up`'s 1/30 time "
    "scale the demo's induced host_sync fires no alert (the workload baseline appears for two "
    "evaluations and is gone; measured on a quiet machine, 2026-12-01). Strict: passing again flags it."))
def test_incident_to_annotated_report_then_clean_shutdown(tmp_path, up_env):
    workdir = tmp_path / "up"
    base = free_port_base()
    log_path = tmp_path / "up.out"
    cmd = [sys.executable, "-m", "gpulens.cli", "up", "--demo", "--incident", "host_sync", "--incident-after", "80",
           "--workdir", str(workdir), "--port-base", str(base), "--status-interval", "2"]
    with open(log_path, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=up_env, start_new_session=True)
    ui = f"http://127.0.0.1:{Ports(base).ui}"
    capture = None
    try:
        deadline = time.monotonic() + 420
        while time.monotonic() < deadline:
            assert proc.poll() is None, log_path.read_text()[-4000:]
            try:
                caps = get_json(f"{ui}/api/captures")["captures"]
            except OSError:
                caps = []
            # the demo takes its own healthy baseline capture first: wait for the alert-started one
            done = [c for c in caps if c["report"] and c["reason"].startswith("alert ")]
            if done:
                capture = done[0]
                break
            time.sleep(3)
        text = log_path.read_text()
        assert capture is not None, f"no analysed capture within the time limit:\n{text[-6000:]}"
        # the alert that started it carried the right diagnosis
        assert "alert firing: GPUWorkloadHostSync diagnosis=host_sync" in text, text[-4000:]
        assert not any(f"diagnosis={d}" in text for d in ("noisy_neighbor", "input_starvation"))
        # the capture covered both ranks with real, verified, archived Kineto traces
        manifest = json.loads((workdir / "archive" / capture["manifest"]).read_text())
        assert manifest["fully_succeeded"], manifest["failures"]
        assert sorted(a["rank"] for a in manifest["artifacts"]) == [0, 1]
        assert manifest["request"]["reason"]["kind"] == "alert"
        for art in manifest["artifacts"]:
            trace = json.loads(Path(art["uri"].removeprefix("file://")).read_text())
            assert any(ev.get("cat") == "cpu_op" for ev in trace["traceEvents"])
        # the analysis report exists and the annotation links to it
        assert (workdir / "archive" / capture["report"]).stat().st_size > 1000
        # the report link reaches the annotation after the report file exists (the coordinator syncs
        # the annotation once analysis is done): wait for that condition, not for a fixed time
        notes = wait_for(lambda: linked(get_json(f"{ui}/api/annotations")["annotations"], capture["capture_id"]),
                         timeout=90, what="the annotation linking the report")
        assert notes
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, log_path.read_text()[-3000:]
    assert wait_for(lambda: processes_mentioning(str(workdir)) == [] or None, timeout=30,
                    what="no process left", last=lambda: processes_mentioning(str(workdir)))
    assert list((workdir / "registry").glob("*.json")) == []
    assert (workdir / "archive" / capture["manifest"]).exists()  # archive intact after shutdown
