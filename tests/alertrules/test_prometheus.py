"""The rules on a real Prometheus (Debian 2.42) that scrapes over HTTP on 127.0.0.1.

1. With an exporter double that serves every catalogue metric and scripts the host_sync incident,
   the time-scaled rules (as `gpulens up` would load them) load, evaluate healthily, record the
   per-pod series, evaluate every dashboard query, and fire GPUWorkloadHostSync with diagnosis
   host_sync and nothing else.
2. With the real exporter (`gpulens exporter`), the source rules load and the target is up.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from gpulens.alertrules import generate, promql
from gpulens.dashboards import build
from tests import rule_signals
from tests.conftest import free_port

from . import prom
from tests.conftest import missing

pytestmark = [pytest.mark.slow]

SCALE = 1 / 60     # 5m -> 5s, 35m of history -> 35s, for: 5m -> 5s
SWITCH_S = 45.0    # the host_sync change happens here, after the baseline exists
VARIABLES = {"$__rate_interval": "30s", "$namespace": ".*", "$pod": ".*", "$node": ".*", "$gpu": ".*"}


def host_sync(t: float) -> dict[str, float]:
    """Per-second rates: a steady trainer that starts copying tensors to the host at SWITCH_S."""
    after = t >= SWITCH_S
    return {"gpulens_kernel_launches_total": 2000.0, "gpulens_graph_launches_total": 5.0,
            "gpulens_sync_wait_seconds_total": 0.6 if after else 0.3, "gpulens_sync_calls_total": 100.0,
            "gpulens_memcpy_bytes_total:h2d": 50e6, "gpulens_memcpy_bytes_total:d2h": 40e6 if after else 0.2e6,
            "gpulens_memcpy_calls_total:h2d": 20.0, "gpulens_memcpy_calls_total:d2h": 20.0,
            "gpulens_dcgm_pcie_bytes_total:tx": 60e6, "gpulens_dcgm_pcie_bytes_total:rx": 10e6}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    if not Path(prom.PROMETHEUS).exists():
        missing("prometheus not installed")
    tmp = tmp_path_factory.mktemp("prometheus")
    _, plain = generate.render(time_scale=SCALE)
    rule_files = []
    for name, text in plain.items():
        (tmp / name).write_text(text)
        rule_files.append(tmp / name)
    double = prom.ExporterDouble(host_sync)
    with double.serve(free_port()) as target:
        with prom.prometheus(tmp, free_port(), [target], rule_files) as base:
            yield base, double


def _query(base: str, expr: str) -> list[dict]:
    answer = prom.post_query(base, expr)
    assert answer["status"] == "success", (expr, answer)
    return answer["data"]["result"]


@pytest.mark.timeout(180)
def test_rules_load_evaluate_and_record(stack):
    base, _ = stack
    prom.wait_for("target up", lambda: prom.get_json(f"{base}/api/v1/targets")["data"]["activeTargets"][0]["health"] == "up", 30)
    prom.wait_for("rules evaluated", lambda: prom.rules_evaluated_ok(base)[0], 30)
    groups = prom.get_json(f"{base}/api/v1/rules")["data"]["groups"]
    assert {g["name"] for g in groups} == {"gpulens.workload.recording", "gpulens.workload.alerts", "gpulens.exporter.alerts",
                                                "gpulens.capture.alerts"}
    prom.wait_for("per-pod demand recorded", lambda: _query(base, "namespace_pod:gpulens_launches:rate5m"), 30)
    series = _query(base, "namespace_pod:gpulens_launches:rate5m")
    assert [s["metric"] for s in series] == [{"__name__": "namespace_pod:gpulens_launches:rate5m",
                                              "namespace": "ml", "node": "test-node", "pod": "trainer-0",
                                              "gpulens_job": "llama-ft"}]
    # kernels + graphs once the 5s window holds a full run of samples (the first ones start at 0)
    prom.wait_for("demand settles at 2005/s", lambda: abs(float(
        _query(base, "namespace_pod:gpulens_launches:rate5m")[0]["value"][1]) - 2005.0) < 200, 30)


@pytest.mark.timeout(180)
def test_every_dashboard_query_evaluates(stack):
    base, _ = stack
    for where, expr in build.all_queries():
        m = re.match(r"^label_values\((.+),\s*\w+\)$", expr)
        expr = m.group(1) if m else expr
        for var, value in VARIABLES.items():
            expr = expr.replace(var, value)
        answer = prom.post_query(base, expr)
        assert answer["status"] == "success", f"{where}: {answer.get('error')}"
    assert prom.post_query(base, "sum(rate(gpulens_kernel_launches_total[5m])")["status"] == "error"


@pytest.mark.timeout(240)
def test_host_sync_incident_fires_host_sync_and_nothing_else(stack):
    base, double = stack
    fired: dict[str, dict] = {}
    deadline = time.monotonic() + SWITCH_S + 90
    while time.monotonic() < deadline and "GPUWorkloadHostSync" not in fired:
        for alert in prom.get_json(f"{base}/api/v1/alerts")["data"]["alerts"]:
            if alert["state"] == "firing":
                fired.setdefault(alert["labels"]["alertname"], alert)
        time.sleep(0.5)
    elapsed = time.monotonic() - double.started
    assert set(fired) == {"GPUWorkloadHostSync"}, (sorted(fired), elapsed)
    assert elapsed > SWITCH_S, "fired before the change"
    alert = fired["GPUWorkloadHostSync"]
    assert {k: v for k, v in alert["labels"].items()} == {
        "alertname": "GPUWorkloadHostSync", "diagnosis": "host_sync", "severity": "warning",
        "gpulens_capture": "auto", "namespace": "ml", "pod": "trainer-0", "node": "test-node",
        "gpulens_job": "llama-ft"}          # the exporter's job label reaches the alert (gateway routing)
    assert alert["annotations"]["dashboard_url"].endswith("var-namespace=ml&var-pod=trainer-0")
    assert alert["annotations"]["runbook_url"].endswith("/host_sync.md")
    # The failure messages of the e2e and cluster alert tests name the signals by these recorded
    # series: each must exist (a renamed rule would leave those messages silently empty).
    described = rule_signals.describe(base, "ml").splitlines()
    for name in rule_signals.SIGNALS:
        assert any(line.startswith(f"{name} {{") for line in described), (name, described)
    assert any(line.startswith("demand/baseline {") and "pod=trainer-0" in line for line in described), described
    assert "unreadable" not in "\n".join(described)


@pytest.mark.timeout(180)
def test_real_exporter_is_scraped_and_rules_load(tmp_path, gpulens_bin):
    """The real exporter: `gpulens exporter --listen 127.0.0.1:PORT --node test`."""
    if not Path(prom.PROMETHEUS).exists():
        missing("prometheus not installed")
    port = free_port()
    help_text = subprocess.run([gpulens_bin, "exporter", "--help"], capture_output=True, text=True).stdout
    cmd = [gpulens_bin, "exporter", "--listen", f"127.0.0.1:{port}", "--node", "test"]
    if "--no-kubernetes" in help_text:
        cmd.append("--no-kubernetes")
    log = open(tmp_path / "exporter.log", "w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        try:
            prom.wait_for("exporter /metrics", lambda: prom.urllib.request.urlopen(
                f"http://127.0.0.1:{port}/metrics", timeout=2).status == 200, 60, proc)
        except RuntimeError:
            log.seek(0)
            output = log.read()
            raise AssertionError(f"exporter exited: {output[-2000:]}")
        rule_files = sorted(Path(generate.__file__).parent.joinpath("rules").glob("*.rules.yml"))
        with prom.prometheus(tmp_path, free_port(), [f"127.0.0.1:{port}"], rule_files) as base:
            prom.wait_for("exporter target up", lambda: prom.get_json(f"{base}/api/v1/targets")
                          ["data"]["activeTargets"][0]["health"] == "up", 60)
            prom.wait_for("rules evaluated", lambda: prom.rules_evaluated_ok(base)[0], 60)
            names = set(prom.get_json(f"{base}/api/v1/label/__name__/values")["data"])
            exported = {n for n in names if n.startswith("gpulens_")}
            assert exported, "no gpulens_ metric scraped"
            assert exported <= promql.catalogue_metrics(), exported - promql.catalogue_metrics()
    finally:
        import os
        import signal
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
        log.close()
