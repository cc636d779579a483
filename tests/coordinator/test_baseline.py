"""The coordinator's automatic baseline: one capture marked `baseline`, once the job has run for the
configured time, never while another capture runs, and never when switched off."""

from __future__ import annotations

import asyncio
import dataclasses
import json

from gpulens.capture.models import CaptureRequest, Manifest

from .agent_double import AgentDouble, RunningAgent
from .conftest import AGENT_TOKEN, make_coordinator, write_job


async def _until(predicate, timeout: float = 30.0):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():
        assert loop.time() < end, "condition not reached"
        await asyncio.sleep(0.05)


async def test_one_baseline_after_the_steady_time_waits_for_a_running_capture(tmp_path, http):
    write_job(tmp_path / "registry", pods={"train-0": ("node-a", 0)}, local_world_size=2)
    async with RunningAgent(AgentDouble("node-a", AGENT_TOKEN)) as a:
        c = make_coordinator(tmp_path, http, {"node-a": a.url})
        c.settings = dataclasses.replace(c.settings, baseline_after_s=0.3, baseline_duration_ms=150)
        manual, _ = c.start(CaptureRequest(job_id="train", duration_ms=2500))   # still running at 0.3 s
        c.schedule_baseline()
        await _until(lambda: len(c.captures) == 2)
        await c.wait(manual.capture_id)
        base = next(r for r in c.captures.values() if r.capture_id != manual.capture_id)
        assert manual.converged_at <= base.requested_at          # it waited its turn, no CaptureBusy
        await c.wait(base.capture_id)
        assert base.request.baseline and base.request.requested_by == "gpulens-baseline"
        await asyncio.sleep(0.5)
        assert len(c.captures) == 2                               # once, not every 0.3 s
        await c.close()
    manifest = Manifest.from_dict(json.loads(open(base.manifest_uri.removeprefix("file://")).read()))
    assert manifest.request["baseline"] is True                    # the analysis finds it by this


async def test_no_baseline_when_switched_off(tmp_path, http):
    write_job(tmp_path / "registry", pods={"train-0": ("node-a", 0)}, local_world_size=2)
    async with RunningAgent(AgentDouble("node-a", AGENT_TOKEN)) as a:
        c = make_coordinator(tmp_path, http, {"node-a": a.url})
        assert c.schedule_baseline() is None and c.captures == {}
        await c.close()
