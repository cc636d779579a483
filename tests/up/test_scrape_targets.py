"""`gpulens up` scrapes the capture plane as the chart's PodMonitors do: the agent as a static target,
the coordinators from a file_sd file that follows them starting and stopping. Judged by the real
promtool (config check, and its service discovery reading the very file `up` writes) and the real
supervisor with real processes."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from gpulens.up.configs import AGENT_JOB, COORDINATOR_JOB, prometheus_config, write_yaml
from gpulens.up.layout import Layout
from gpulens.up.local_operator import LocalOperator
from gpulens.up.scrape_targets import CoordinatorTarget, write_file_sd
from gpulens.up.supervisor import ChildSpec, Supervisor
from tests.conftest import missing
from tests.up.test_local_operator import record

REPO = Path(__file__).resolve().parents[2]
RULES = sorted((REPO / "alertrules" / "rules").glob("*.yml"))
PROMTOOL = "/usr/bin/promtool"


@pytest.fixture(scope="module")
def promtool() -> str:
    if not Path(PROMTOOL).exists():
        missing("promtool not installed (scripts/setup.sh installs it)")
    return PROMTOOL


def config_file(tmp_path: Path, coordinators: Path) -> Path:
    return write_yaml(tmp_path / "prometheus.yml", prometheus_config(
        exporter="127.0.0.1:9450", rule_files=RULES, alertmanager="127.0.0.1:9461", agent="127.0.0.1:9451",
        coordinators_file=coordinators))


def discovered(promtool: str, config: Path, job: str) -> list[dict]:
    """The targets (after relabelling) Prometheus's own discovery finds for `job`."""
    out = subprocess.run([promtool, "check", "service-discovery", "--timeout=2s", str(config), job],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [t["labels"] for t in json.loads(out.stdout)]


def test_generated_config_passes_promtool_and_discovers_the_capture_plane(tmp_path, promtool):
    coordinators = write_file_sd(tmp_path / "coordinators.json", [
        CoordinatorTarget("demo", "coordinator-demo-demo-a0", "http://127.0.0.1:9470")])
    config = config_file(tmp_path, coordinators)
    check = subprocess.run([promtool, "check", "config", str(config)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {len(RULES)} rule files found" in check.stdout
    [agent] = discovered(promtool, config, AGENT_JOB)
    assert agent["instance"] == "127.0.0.1:9451" and agent["job"] == AGENT_JOB
    assert agent["namespace"] and agent["pod"]  # what GPULensAgentDown's summary names
    [coord] = discovered(promtool, config, COORDINATOR_JOB)
    assert coord["instance"] == "127.0.0.1:9470"
    assert (coord["namespace"], coord["pod"]) == ("demo", "coordinator-demo-demo-a0")


def test_the_capture_alerts_select_these_jobs_and_only_them():
    """GPULensAgentDown selects by job name (as the chart's `<ns>/<release>-agent`); the failing-captures
    rule sums by namespace and pod, which every coordinator target carries."""
    rules = {r["alert"]: r for g in yaml.safe_load((REPO / "alertrules/rules/gpulens-capture.rules.yml").read_text())
             ["groups"] for r in g["rules"]}
    selector = re.search(r'up\{job=~"([^"]+)"\}', rules["GPULensAgentDown"]["expr"]).group(1)
    assert re.fullmatch(selector, AGENT_JOB)
    assert re.fullmatch(selector, "gpulens/gpulens-agent")  # the chart's PodMonitor, for comparison
    assert not re.fullmatch(selector, COORDINATOR_JOB) and not re.fullmatch(selector, "gpulens-exporter")
    assert "sum by (namespace, pod)" in rules["GPULensCapturesFailing"]["expr"]


def sleeper_runner(tmp_path: Path) -> SimpleNamespace:
    """A runner whose coordinators are real (sleeping) processes under the real supervisor."""
    layout = Layout.create(tmp_path / "w")
    runner = SimpleNamespace(layout=layout, sup=Supervisor(layout.logs), said=[])
    runner.say = runner.said.append
    runner.coordinator_spec = lambda ns, job, attempt, index, serving=False: ChildSpec(
        f"coordinator-{ns}-{job}-a{attempt}", [sys.executable, "-c", "import time; time.sleep(120)"],
        url=f"http://127.0.0.1:{9470 + index}", restart=False)
    return runner


def scraped(layout: Layout) -> dict[str, dict]:
    return {g["targets"][0]: g["labels"] for g in json.loads(layout.coordinator_targets_file.read_text())}


async def test_file_sd_follows_coordinators_starting_and_stopping(tmp_path):
    runner = sleeper_runner(tmp_path)
    op = LocalOperator(runner)
    try:
        op.write_scrape_targets()
        assert scraped(runner.layout) == {}  # before any job: an empty list, not a missing file
        record(runner.layout.registry, "a.json", namespace="ns", job_id="train")
        record(runner.layout.registry, "b.json", namespace="other", job_id="eval", pod="q0")
        await op.reconcile()
        assert scraped(runner.layout) == {
            "127.0.0.1:9470": {"namespace": "ns", "pod": "coordinator-ns-train-a0"},
            "127.0.0.1:9471": {"namespace": "other", "pod": "coordinator-other-eval-a0"}}
        # stopped by `up`: gone from the file at once
        await op.stop_coordinator(("ns", "train", 0))
        assert "127.0.0.1:9470" not in scraped(runner.layout)
        assert "127.0.0.1:9471" in scraped(runner.layout)
        # exits for good on its own (no restart): gone after the next pass, and not started again
        os.killpg(runner.sup.children["coordinator-other-eval-a0"].pid, signal.SIGKILL)
        end = time.monotonic() + 20
        while scraped(runner.layout):
            assert time.monotonic() < end, scraped(runner.layout)
            await asyncio.sleep(0.1)
            await op.reconcile()
        assert [c for c in runner.sup.children] == ["coordinator-ns-train-a0", "coordinator-other-eval-a0"]
        assert not list(runner.layout.state.glob("*.tmp"))  # written by rename, never in place
    finally:
        await runner.sup.stop_all()
