"""End to end on one machine: `gpulens up --demo --incident X` takes an induced incident through the
whole loop (exporter -> Prometheus -> rule -> Alertmanager -> gateway -> coordinator -> agent -> real
Kineto traces -> verify -> archive -> manifest -> analysis -> verdict -> annotation) and then shuts
down without leaving a process behind. host_sync and input_starvation arrive as they do in a
cluster, with a new pod of the same job, judged by the workload's baseline (issue 14); the report's
verdict answers the alert from the trace (issue 15). The serving demo (`--serving`, issue 30): a
neighbour on one replica's GPU, the alert on that replica, a capture of it and a healthy peer, and
a verdict judged against the peer.

Needs root (eBPF uprobes on the CUDA stand-in), Prometheus and Alertmanager (scripts/setup.sh).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import pytest

from gpulens.capture import schemas
from gpulens.up.layout import Ports
from gpulens.up.runner import SERVING_PODS, SERVING_REVISION, SERVING_WORKLOAD
from tests import rule_signals
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


def up_environment() -> dict:
    """The environment `up` runs in, or missing(...) when this machine cannot run it."""
    if os.geteuid() != 0:
        missing("needs root for eBPF")
    for tool in ("prometheus", "prometheus-alertmanager"):
        if not shutil.which(tool):
            missing(f"{tool} not installed (scripts/setup.sh installs it)")
    return dict(os.environ, PYTHONUNBUFFERED="1")


@pytest.fixture
def up_env():
    return up_environment()


def interrupt(proc: subprocess.Popen) -> None:
    """Ctrl-C for `up` (its whole session), as a person stops it; SIGKILL only if it hangs 60 s."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def running_up(tmp_path: Path, env: dict, incident: str, *extra: str, gpulens: list[str] | None = None,
               cwd: Path | None = None):
    """`gpulens up --demo --incident <incident> [extra]` running; on exit: Ctrl-C, then a clean shutdown is checked.

    Yields (workdir, captures page URL, up's output file, process, ports). The incident is induced once the
    workload has its baseline (up waits for the recorded series), so no fixed delay here decides it.
    `gpulens` is the command to run (default: this interpreter's `-m gpulens.cli`), `cwd` its folder."""
    workdir, log_path, base = tmp_path / "up", tmp_path / "up.out", free_port_base()
    cmd = [*(gpulens or [sys.executable, "-m", "gpulens.cli"]), "up", "--demo", *extra, "--incident", incident,
           "--incident-after", "80", "--workdir", str(workdir), "--port-base", str(base), "--status-interval", "2"]
    with open(log_path, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=cwd)
    try:
        yield workdir, f"http://127.0.0.1:{Ports(base).ui}", log_path, proc, Ports(base)
    finally:
        interrupt(proc)
    assert proc.returncode == 0, log_path.read_text()[-3000:]
    assert wait_for(lambda: processes_mentioning(str(workdir)) == [] or None, timeout=30,
                    what="no process left", last=lambda: processes_mentioning(str(workdir)))
    assert list((workdir / "registry").glob("*.json")) == []


def alert_capture(ui: str, proc: subprocess.Popen, log_path: Path, timeout: float = 480) -> dict:
    """The first capture an alert started, once it has its report (the demo's own healthy baseline
    capture, taken first, is not one)."""
    def probe():
        assert proc.poll() is None, log_path.read_text()[-4000:]
        done = [c for c in get_json(f"{ui}/api/captures")["captures"] if c["report"] and c["reason"].startswith("alert ")]
        return done[0] if done else None
    return wait_for(probe, timeout=timeout, what="an analysed alert-started capture",
                    last=lambda: log_path.read_text()[-6000:])


def prometheus_query(ports: Ports, query: str) -> list[dict]:
    url = f"http://127.0.0.1:{ports.prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    return get_json(url)["data"]["result"]


def assert_capture_plane_scraped(ports: Ports) -> None:
    """Prometheus scrapes the agent and the coordinators as the capture alerts expect (the same
    selectors as with the chart's PodMonitors): a finished capture shows in a coordinator's counters."""
    agent = wait_for(lambda: prometheus_query(ports, 'up{job=~".*gpulens.*agent.*"} == 1'), timeout=30,
                     what="the agent scraped", last=lambda: prometheus_query(ports, "up"))
    assert [r["metric"]["instance"] for r in agent] == [f"127.0.0.1:{ports.agent}"]  # not the exporter
    coordinators = prometheus_query(ports, 'up{job="gpulens-coordinator"} == 1')
    assert any(r["metric"]["namespace"] == "demo" and r["metric"]["pod"].startswith("coordinator-demo-demo")
               for r in coordinators), coordinators
    succeeded = wait_for(lambda: prometheus_query(
        ports, 'sum by (namespace, pod) (gpulens_coordinator_captures_total{outcome="succeeded"}) >= 1'),
        timeout=30, what="a coordinator's finished captures in Prometheus",
        last=lambda: prometheus_query(ports, "gpulens_coordinator_captures_total"))
    assert {r["metric"]["namespace"] for r in succeeded} == {"demo"}
    assert prometheus_query(ports, 'gpulens_agent_targets_total{job="gpulens-agent",outcome="archived"} >= 1')


def summary_of(workdir: Path, capture: dict) -> dict:
    summary = json.loads((workdir / "archive" / capture["report"]).with_name("summary.json").read_text())
    schemas.validate("summary", summary)
    return summary


def test_input_starvation_in_a_new_pod_is_diagnosed_and_host_sync_is_not_supported(tmp_path, up_env):
    """The resize incident (a lower CPU limit recreates the pod): a new pod whose data loader is
    starved. Diagnosed as input_starvation; the report's host_sync check, the control, says no."""
    with running_up(tmp_path, up_env, "input_starvation") as (workdir, ui, log_path, proc, ports):
        capture = alert_capture(ui, proc, log_path)
        text = log_path.read_text()
        assert "replacing pod demo/demo-trainer-0 with demo/demo-trainer-1" in text, text[-4000:]
        assert "alert firing: GPUWorkloadInputStarvation diagnosis=input_starvation demo/demo-trainer-1" in text, \
            text[-4000:] + "\n" + rule_signals.describe(f"http://127.0.0.1:{ports.prometheus}")
        assert not any(f"diagnosis={d}" in text for d in ("noisy_neighbor", "host_sync", "unclassified"))
        v = summary_of(workdir, capture)["verdict"]
        assert v["diagnosis"] == "input_starvation"
        assert v["verdict"] == "supported", v["why"]
        assert v["checks"]["input_starvation"]["numbers"]["spans"] > 0
        assert v["checks"]["host_sync"]["verdict"] == "not_supported", v["checks"]["host_sync"]["why"]


def test_serving_noisy_neighbour_on_one_replica_is_captured_with_its_peer_and_supported(tmp_path, up_env):
    """Two replicas of Deployment demo/demo-serve, one stand-in GPU each; a neighbour joins the first
    one's GPU. The rule fires on that replica (its workload, its revision), the gateway captures it
    plus one healthy peer in a wall-clock window, and the report, comparing the two from the same
    window, supports noisy_neighbor although a CPU-only trace has no kernels."""
    affected, peer = SERVING_PODS
    with running_up(tmp_path, up_env, "noisy_neighbor", "--serving") as (workdir, ui, log_path, proc, ports):
        capture = alert_capture(ui, proc, log_path)
        text = log_path.read_text()
        assert f"serving revision demo/{SERVING_REVISION} attempt 0 registered" in text, text[-4000:]
        assert text.index("has its baseline") < text.index("inducing incident 'noisy_neighbor'"), text[-4000:]
        # the alert is about the affected replica only, and names its serving workload and revision
        assert f"alert firing: GPUWorkloadNoisyNeighbor diagnosis=noisy_neighbor demo/{affected}" in text, \
            text[-4000:] + "\n" + rule_signals.describe(f"http://127.0.0.1:{ports.prometheus}")
        assert f"alert firing: GPUWorkloadNoisyNeighbor diagnosis=noisy_neighbor demo/{peer}" not in text
        assert not any(f"diagnosis={d}" in text for d in ("host_sync", "input_starvation", "unclassified"))
        fired = prometheus_query(ports, 'max_over_time(ALERTS{alertname="GPUWorkloadNoisyNeighbor",'
                                        'alertstate="firing"}[30m])')
        assert [{k: r["metric"].get(k) for k in ("namespace", "pod", "gpulens_workload", "gpulens_job")}
                for r in fired] == [{"namespace": "demo", "pod": affected, "gpulens_workload": SERVING_WORKLOAD,
                                     "gpulens_job": SERVING_REVISION}], fired
        # the capture: the alerted replica plus one healthy peer, wall-clock, both traces archived
        manifest = json.loads((workdir / "archive" / capture["manifest"]).read_text())
        assert manifest["fully_succeeded"], manifest["failures"]
        assert manifest["job_id"] == SERVING_REVISION and manifest["request"]["reason"]["kind"] == "alert"
        assert manifest["request"]["pods"] == [affected] and manifest["request"]["peers"] == 1
        assert not manifest["request"].get("iterations")
        assert sorted((a["rank"], a["pod"]) for a in manifest["artifacts"]) == [(0, affected), (1, peer)]
        assert len({a["pid"] for a in manifest["artifacts"]}) == 2         # two processes, not one twice
        # the report compares the affected replica with its peer and supports the diagnosis
        summary = summary_of(workdir, capture)
        v, r = summary["verdict"], summary["replicas"]
        assert r["affected_pods"] == [affected] and r["peer_pods"] == [peer]
        assert [(p["pod"], p["peer_pod"]) for p in r["pairs"]] == [(affected, peer)]
        assert v["alert"]["alertname"] == "GPUWorkloadNoisyNeighbor" and v["diagnosis"] == "noisy_neighbor"
        assert v["verdict"] == "supported", v["why"]
        assert v["baseline"]["capture_id"] == f"{capture['capture_id']} (healthy peer {peer}, same capture)"
        n = v["checks"]["noisy_neighbor"]["numbers"]
        assert v["trace_kind"] == "cpu_only" and n["slowdown"] >= 1.2 and n["lost_outside_own_work"] >= 1.2, n
        # what the service's users saw: each replica's own load generator, over HTTP, reports its p95;
        # the affected replica's doubled since its first (healthy) report, the peer's did not
        p95 = {pod: [float(x) for x in re.findall(r"p95_ms=([\d.]+)", (workdir / "logs" / f"demo-replica-{i}.log")
                                                   .read_text())] for i, pod in enumerate(SERVING_PODS)}
        assert len(p95[affected]) >= 3 and p95[affected][-1] >= 2 * p95[affected][0], p95
        assert p95[peer][-1] < 1.5 * p95[peer][0], p95


def test_a_hang_in_the_demo_is_named_by_the_stalled_alerts_hang_capture(tmp_path, up_env):
    """Issue 45: rank 1 of the demo job stops before an all_reduce (`stop_before_collective`) and
    rank 0 waits in it; both stop launching while they hold the GPU. GPUWorkloadStalled fires with
    `gpulens_capture="hang"`, the gateway starts a hang capture, each rank's hook writes its Flight
    Recorder dump and py-spy reads its stacks, and the report, the summary, up's line and the
    annotation name rank 1, the collective, its sequence id and the frame it is stuck in. Without
    the hooks' dumps no sequence id could be named."""
    with running_up(tmp_path, up_env, "hang") as (workdir, ui, log_path, proc, ports):
        capture = alert_capture(ui, proc, log_path)
        text = log_path.read_text()
        assert "alert firing: GPUWorkloadStalled diagnosis=stalled" in text, \
            text[-4000:] + "\n" + rule_signals.describe(f"http://127.0.0.1:{ports.prometheus}")
        assert capture["reason"] == "alert GPUWorkloadStalled (stalled)" and capture["kind"] == "hang", capture
        manifest = json.loads((workdir / "archive" / capture["manifest"]).read_text())
        assert manifest["request"]["kind"] == "hang" and manifest["fully_succeeded"], manifest["failures"]
        assert sorted((a["rank"], a["kind"]) for a in manifest["artifacts"]) == [(0, "hang_evidence"),
                                                                                  (1, "hang_evidence")]
        summary = json.loads((workdir / "archive" / capture["report"]).with_name("summary.json").read_text())
        schemas.validate("hang_summary", summary)
        v = summary["verdict"]
        print(f"[hang] stalled -> report: {v['line']}")
        assert v["kind"] == "never_entered" and "all_reduce" in v["op"] and v["seq"] and v["seq"] > 1, v
        (suspect,) = v["suspects"]
        assert suspect["rank"] == 1 and suspect["pod"] and suspect["node"], suspect
        assert "stop_before_collective" in (suspect["now_at"] or ""), suspect     # where rank 1 is stuck
        for needle in ("rank 1", suspect["pod"], suspect["node"], f"collective_seq_id {v['seq']}"):
            assert needle in v["line"], (needle, v["line"])
        assert f"capture {capture['capture_id']}: hang: {v['line']}" in wait_for(
            lambda: log_path.read_text() if "hang: rank 1" in log_path.read_text() else None, timeout=30,
            what="up's verdict line", last=lambda: log_path.read_text()[-3000:])
        notes = wait_for(lambda: [n for n in get_json(f"{ui}/api/annotations")["annotations"]
                                  if capture["capture_id"] in json.dumps(n) and v["line"][:60] in n.get("text", "")]
                         or None, timeout=30, what="the annotation leading with the verdict",
                         last=lambda: get_json(f"{ui}/api/annotations"))
        assert "hang" in notes[0]["tags"], notes
