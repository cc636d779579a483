"""A hang capture is followed by a Kineto window of every rank (issue 45): a trace capture of its
own, started by the coordinator once the hang's analysis is done, named in the hang's status as
`followed_by`; none when the window is off, when nothing was archived, or when another capture
holds the job (noted, never raised). Against the agent double (the real agents' run is in
test_hang_capture.py)."""

from __future__ import annotations

from dataclasses import replace

from gpulens.capture.coordinator import Phase
from gpulens.capture.models import CaptureRequest

from .agent_double import AgentDouble, RunningAgent
from .conftest import AGENT_TOKEN, make_coordinator, write_job


async def test_a_hang_capture_is_followed_by_a_window_of_every_rank(tmp_path, http):
    write_job(tmp_path / "registry", pods={"train-0": ("node-a", 0)}, local_world_size=2)
    async with RunningAgent(AgentDouble("node-a", AGENT_TOKEN)) as a:
        c = make_coordinator(tmp_path, http, {"node-a": a.url})
        hang, _ = c.start(CaptureRequest(job_id="train", duration_ms=200, kind="hang"))
        await c.wait(hang.capture_id)
        assert hang.phase == Phase.CONVERGED and hang.fully_succeeded
        window = c.get(hang.followed_by)
        assert window is not None and hang.to_status()["followed_by"] == window.capture_id
        await c.wait(window.capture_id)
        await c.close()
    assert (window.request.kind, window.request.duration_ms, window.request.requested_by) == ("trace", 1000, "gpulens-hang")
    assert hang.capture_id in window.request.reason.text
    assert window.phase == Phase.CONVERGED and len(window.targets) == 2
    assert window.to_status().get("followed_by") is None        # a window is not followed by another


async def test_no_window_when_it_is_off_or_nothing_was_archived(tmp_path, http):
    write_job(tmp_path / "registry", pods={"train-0": ("node-a", 0)}, local_world_size=1)
    async with RunningAgent(AgentDouble("node-a", AGENT_TOKEN)) as a:
        c = make_coordinator(tmp_path, http, {"node-a": a.url})
        c.settings = replace(c.settings, hang_window_ms=0)
        off, _ = c.start(CaptureRequest(job_id="train", duration_ms=200, kind="hang"))
        await c.wait(off.capture_id)
        await c.close()
    assert off.fully_succeeded and off.followed_by is None and list(c.captures) == [off.capture_id]
    async with RunningAgent(AgentDouble("node-a", AGENT_TOKEN, outcome=lambda d, t: ("fail", "no_hang_evidence", "x"))) as a:
        (tmp_path / "2").mkdir()
        c = make_coordinator(tmp_path / "2", http, {"node-a": a.url}, registry=tmp_path / "registry")
        failed, _ = c.start(CaptureRequest(job_id="train", duration_ms=200, kind="hang"))
        await c.wait(failed.capture_id)
        await c.close()
    assert not failed.fully_succeeded and failed.followed_by is None and list(c.captures) == [failed.capture_id]
