"""A newcomer's first session with `gpulens up --demo`, scripted: it follows only what `up` prints.

Reads the process table (every pid alive, every log there), opens every printed link, makes the
classic first mistake (the printed capture line without its token file), runs the printed capture
line, opens the report link `up` announces and the one `capture status` gives, opens every link
the loaded alert rules carry, then presses Ctrl-C and checks nothing is left behind (processes,
Kineto socket folders). No incident: a manual capture shows the loop in about a minute.

Needs root (eBPF uprobes on the CUDA stand-in), Prometheus and Alertmanager (scripts/setup.sh).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from gpulens.up.layout import Layout
from tests.e2e.test_up import free_port_base, interrupt, processes_mentioning, up_env  # noqa: F401  (fixture)

pytestmark = [pytest.mark.slow, pytest.mark.root]


def fetch(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def wait_for(log: Path, pattern: str, proc: subprocess.Popen, timeout_s: float) -> re.Match:
    deadline = time.monotonic() + timeout_s
    rx = re.compile(pattern, re.M)
    while time.monotonic() < deadline:
        text = log.read_text()
        m = rx.search(text)
        if m:
            return m
        assert proc.poll() is None, f"gpulens up exited ({proc.returncode}):\n{text[-4000:]}"
        time.sleep(0.5)
    raise AssertionError(f"no line matching {pattern!r} within {timeout_s} s:\n{log.read_text()[-5000:]}")


def run(argv: list[str], env: dict, timeout_s: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s)


def test_a_newcomer_follows_only_what_up_prints(tmp_path, up_env):
    workdir = tmp_path / "up"
    base = free_port_base()
    out = tmp_path / "up.out"
    env = {k: v for k, v in up_env.items() if k not in ("GPULENS_TOKEN", "GPULENS_URL")}
    cmd = [sys.executable, "-m", "gpulens.cli", "up", "--demo", "--work-dir", str(workdir), "--port-base", str(base),
           "--status-interval-s", "1"]
    with open(out, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    socket_dir = Layout(workdir.resolve()).socket_dir
    try:
        wait_for(out, r"Ctrl-C stops everything", proc, 120)
        text = out.read_text()

        # 1. the process table: every pid is alive, every log file exists
        table = text.split("gpulens up: processes:\n", 1)[1].split("gpulens up: ready.", 1)[0]
        rows = [line.split() for line in table.splitlines()[1:] if line.strip()]
        names = {r[0] for r in rows}
        assert {"exporter", "agent", "gateway", "alertmanager", "prometheus", "demo-trainer"} <= names, table
        for row in rows:
            pid = int(row[-2] if row[0] != "gpulens" else row[-3])
            assert Path(f"/proc/{pid}").exists(), row
            if row[0] != "gpulens":
                assert Path(row[-1]).is_file(), row

        # 2. every printed link opens
        block = text.split("gpulens up: ready. Open:\n", 1)[1].split("  start a capture by hand", 1)[0]
        links = re.findall(r"(http://\S+)", block)
        assert len(links) >= 7 and any(u.endswith("/classic/alerts") for u in links), block
        for url in links:
            status, _ = fetch(url)
            assert status == 200, (url, status)

        # 3. the printed capture line, first without its token file (the classic mistake)
        line = re.search(r"start a capture by hand:  (.+)$", text, re.M).group(1)
        argv = shlex.split(line)
        assert argv[0].endswith("gpulens") and "--token-file" in argv and "--wait" in argv
        without_token = [a for i, a in enumerate(argv) if a != "--token-file" and argv[i - 1] != "--token-file"]
        bad = run([sys.executable, "-m", "gpulens.cli", *without_token[1:]], env)
        assert bad.returncode == 4 and "none was given" in bad.stderr and "GPULENS_TOKEN" in bad.stderr, bad.stderr
        assert "HTTP" not in bad.stderr and "Error" not in bad.stderr

        # 4. once the demo job registered (up says so), the printed line works as printed
        wait_for(out, r"job demo/demo attempt 0 registered: coordinator at http://\S+ \(pid \d+, log \S+\)", proc, 180)
        good = run([sys.executable, "-m", "gpulens.cli", *argv[1:]], env, timeout_s=240)
        assert good.returncode == 0, (good.stdout, good.stderr)
        cid, manifest_uri = good.stdout.split()
        assert "all 2 ranks archived" in good.stderr and manifest_uri.startswith("file://")
        wait_for(out, rf"gateway: manual capture {cid} of demo/demo started", proc, 30)

        # 5. the report link up announces opens; capture status gives the same http link
        report = wait_for(out, rf"capture {cid}: report (http://\S+)", proc, 300).group(1)
        status, body = fetch(report)
        assert status == 200 and b"<html" in body.lower()[:2000]
        token = ["--token-file", argv[argv.index("--token-file") + 1]]
        url = ["--url", argv[argv.index("--url") + 1]]
        deadline = time.monotonic() + 180        # the report file lands before the analysis process returns
        while True:
            shown = run([sys.executable, "-m", "gpulens.cli", "capture", "status", cid, *url, *token], env)
            assert shown.returncode == 0, shown.stderr
            if "analysis  running" not in shown.stdout or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert report in shown.stdout and "file://" not in shown.stdout.split("analysis")[-1], shown.stdout

        # 6. every link the loaded alert rules carry opens; none points at a Grafana that is not there
        prom = next(u for u in links if u.endswith("/classic/alerts")).removesuffix("/classic/alerts")
        rules = json.loads(fetch(f"{prom}/api/v1/rules")[1])["data"]["groups"]
        alerting = [r for g in rules for r in g["rules"] if r["type"] == "alerting"]
        assert len(alerting) >= 5
        for rule in alerting:
            notes = rule.get("annotations", {})
            assert "dashboard_url" not in notes, rule["name"]
            status, _ = fetch(notes["runbook_url"])
            assert status == 200, (rule["name"], notes["runbook_url"])
        assert socket_dir.is_dir() and any(p.name.startswith("dynoconfigclient") for p in socket_dir.iterdir())
    finally:
        interrupt(proc)
    text = out.read_text()
    assert proc.returncode == 0, text[-3000:]
    assert re.search(r"gpulens up: stopped \d+ processes.*removed \d+ Kineto socket folders", text), text[-1000:]
    assert not socket_dir.exists()
    deadline = time.monotonic() + 10
    while processes_mentioning(str(workdir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_mentioning(str(workdir)) == []
