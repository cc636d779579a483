"""After convergence: the manifest write (and its failure), analysis as a child process (and its
failure), both visible in the status without ever un-converging a capture."""

from __future__ import annotations

import os
import sys

from gpulens.capture.archive import ArchiveError
from gpulens.capture.coordinator import Phase
from gpulens.capture.coordinator.analysis_runner import AnalysisRunner
from gpulens.capture.models import CaptureRequest, Manifest

from .agent_double import AgentDouble, RunningAgent
from .conftest import AGENT_TOKEN, make_coordinator, write_job


async def test_real_analysis_runs_on_the_manifest_and_its_report_is_linked(tmp_path, http):
    write_job(tmp_path / "registry", pods={"train-0": ("node-a", 0)}, local_world_size=2)
    async with RunningAgent(AgentDouble("node-a", AGENT_TOKEN)) as a:
        c = make_coordinator(tmp_path, http, {"node-a": a.url}, analysis=AnalysisRunner(timeout_s=300))
        rec, _ = c.start(CaptureRequest(job_id="train", duration_ms=200))
        await c.wait(rec.capture_id)
        await c.close()
    assert rec.phase == Phase.CONVERGED
    # `gpulens analyze` ran on exactly this manifest and wrote its report next to it
    assert rec.analysis["state"] == "done", rec.analysis
    assert rec.report_uri == rec.manifest_uri.replace("manifest.json", "analysis/report.html")
    assert os.path.exists(rec.report_uri.removeprefix("file://"))


async def test_a_failing_analysis_is_a_visible_state_and_the_capture_stays_converged(tmp_path, http):
    write_job(tmp_path / "registry", pods={"train-0": ("node-a", 0)}, local_world_size=1)
    script = tmp_path / "analyze.py"
    script.write_text("import sys; print('boom: HTA exploded', file=sys.stderr); sys.exit(1)\n")
    async with RunningAgent(AgentDouble("node-a", AGENT_TOKEN)) as a:
        c = make_coordinator(tmp_path, http, {"node-a": a.url},
                             analysis=AnalysisRunner(command=(sys.executable, str(script))))
        rec, _ = c.start(CaptureRequest(job_id="train", duration_ms=200))
        await c.wait(rec.capture_id)
        await c.close()
    assert rec.phase == Phase.CONVERGED and rec.fully_succeeded
    assert rec.analysis == {"state": "failed", "reason": "gpulens analyze exit code 1: boom: HTA exploded",
                            "exit_code": 1}


async def test_nothing_archived_means_no_analysis(tmp_path, http):
    write_job(tmp_path / "registry", pods={"train-0": ("node-a", 0)}, local_world_size=1)
    ran = tmp_path / "ran"
    script = tmp_path / "analyze.py"
    script.write_text(f"open({str(ran)!r}, 'w').close()\n")
    async with RunningAgent(AgentDouble("node-a", AGENT_TOKEN, outcome=lambda d, t: ("fail", "process_gone", "x"))) as a:
        c = make_coordinator(tmp_path, http, {"node-a": a.url},
                             analysis=AnalysisRunner(command=(sys.executable, str(script))))
        rec, _ = c.start(CaptureRequest(job_id="train", duration_ms=200))
        await c.wait(rec.capture_id)
        await c.close()
    assert rec.analysis["state"] == "skipped" and not ran.exists()
    assert Manifest.from_json(open(rec.manifest_uri.removeprefix("file://")).read()).failures[0].reason == "process_gone"


async def test_an_unwritable_archive_fails_the_capture_visibly(tmp_path, http):
    write_job(tmp_path / "registry", pods={"train-0": ("node-a", 0)}, local_world_size=1)
    calls = []

    class Refusing:
        def __init__(self, prefix):
            self.prefix = prefix

        def put_bytes(self, data, key, content_type="application/json"):
            calls.append(key)
            raise ArchiveError("disk full", retryable=True)

    async with RunningAgent(AgentDouble("node-a", AGENT_TOKEN)) as a:
        c = make_coordinator(tmp_path, http, {"node-a": a.url}, open_store=Refusing)
        rec, _ = c.start(CaptureRequest(job_id="train", duration_ms=200))
        await c.wait(rec.capture_id)
        await c.close()
    assert rec.phase == Phase.FAILED and "disk full" in rec.error and rec.manifest_uri is None
    assert calls == ["manifest.json"] * 4      # retried, then given up
    assert rec.to_status()["fully_succeeded"] is False


async def test_a_manifest_is_schema_valid_and_lists_every_expected_target(tmp_path, http):
    write_job(tmp_path / "registry", pods={"train-0": ("node-a", 0), "train-1": ("node-b", 2)}, local_world_size=2,
              skip={3})
    async with RunningAgent(AgentDouble("node-a", AGENT_TOKEN)) as a, RunningAgent(AgentDouble("node-b", AGENT_TOKEN)) as b:
        c = make_coordinator(tmp_path, http, {"node-a": a.url, "node-b": b.url})
        rec, _ = c.start(CaptureRequest(job_id="train", duration_ms=200))
        await c.wait(rec.capture_id)
        await c.close()
    m = Manifest.from_json(open(rec.manifest_uri.removeprefix("file://")).read())   # validates on read
    assert [t.rank for t in m.expected_targets] == [0, 1, 2, 3]
    assert [(a.rank, a.node) for a in m.artifacts] == [(0, "node-a"), (1, "node-a"), (2, "node-b")]
    assert m.missing_ranks == [3] and m.request["namespace"] == "ml" and m.request["capture_id"] == rec.capture_id
    assert m.deadline == rec.deadline and m.converged_at == rec.converged_at
    for art in m.artifacts:
        assert art.uri.startswith(rec.archive_prefix + "/traces/")
