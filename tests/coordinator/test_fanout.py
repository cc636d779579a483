"""Fan-out and convergence against agent doubles: one slow or dead node costs only its own
targets, dispatch is at-least-once, and the manifest says exactly which ranks are missing."""

from __future__ import annotations

import asyncio
import json

from gpulens.capture.coordinator import Phase
from gpulens.capture.models import CaptureRequest, Manifest

from .agent_double import AgentDouble, RunningAgent
from .conftest import AGENT_TOKEN, make_coordinator, write_job

TWO_PODS = {"train-0": ("node-a", 0), "train-1": ("node-b", 2)}


def manifest_of(rec) -> Manifest:
    return Manifest.from_json(open(rec.manifest_uri.removeprefix("file://")).read())


async def drain(sub) -> list[dict]:
    out = []
    while (e := sub.get_nowait()) is not None:
        out.append(e)
    return out


async def test_a_dead_agent_costs_only_its_targets_and_the_manifest_names_the_missing_ranks(tmp_path, http):
    write_job(tmp_path / "registry", pods=TWO_PODS, local_world_size=2)
    dead = AgentDouble("node-b", AGENT_TOKEN, black_hole=True)     # accepts connections, never answers
    async with RunningAgent(AgentDouble("node-a", AGENT_TOKEN)) as a, RunningAgent(dead) as b:
        c = make_coordinator(tmp_path, http, {"node-a": a.url, "node-b": b.url})
        rec, _ = c.start(CaptureRequest(job_id="train", duration_ms=200))
        sub = rec.bus.subscribe()
        await c.wait(rec.capture_id)
        events = await drain(sub)
        await c.close()
    assert rec.phase == Phase.CONVERGED and rec.fully_succeeded is False
    m = manifest_of(rec)
    assert sorted(a.rank for a in m.artifacts) == [0, 1]
    assert m.missing_ranks == [2, 3]
    assert {(f.rank, f.reason) for f in m.failures} == {(2, "agent_unreachable"), (3, "agent_unreachable")}
    # node-a's targets were archived while node-b's were still open: the dead node delayed only itself
    order = [(e["target_id"], e["state"]) for e in events if e.get("event") == "target"]
    last_a = max(i for i, (t, s) in enumerate(order) if t in ("rank-0", "rank-1") and s == "archived")
    first_b_end = min(i for i, (t, s) in enumerate(order) if t in ("rank-2", "rank-3") and s == "failed")
    assert last_a < first_b_end


async def test_an_agent_killed_mid_capture_ends_its_accepted_targets_agent_unreachable(tmp_path, http):
    write_job(tmp_path / "registry", pods=TWO_PODS, local_world_size=2)
    b_double = AgentDouble("node-b", AGENT_TOKEN, outcome=lambda d, t: "hang")   # stays queued until killed
    async with RunningAgent(AgentDouble("node-a", AGENT_TOKEN)) as a:
        b = await RunningAgent(b_double).__aenter__()
        c = make_coordinator(tmp_path, http, {"node-a": a.url, "node-b": b.url})
        rec, _ = c.start(CaptureRequest(job_id="train", duration_ms=200))
        while rec.targets.get("rank-2") is None or rec.targets["rank-2"].state.value != "queued_by_dynolog":
            await asyncio.sleep(0.02)
        await b.__aexit__(None, None, None)                 # the node goes away with its agent
        await c.wait(rec.capture_id)
        await c.close()
    m = manifest_of(rec)
    assert m.missing_ranks == [2, 3]
    fails = {f.rank: f for f in m.failures}
    assert fails[2].reason == "agent_unreachable" and "stopped answering" in fails[2].detail
    assert "queued_by_dynolog" in fails[2].detail


async def test_an_agent_that_lost_its_state_gets_the_targets_again(tmp_path, http):
    write_job(tmp_path / "registry", pods={"train-0": ("node-a", 0)}, local_world_size=2)
    double = AgentDouble("node-a", AGENT_TOKEN, step_s=0.2)
    async with RunningAgent(double) as a:
        c = make_coordinator(tmp_path, http, {"node-a": a.url})
        rec, _ = c.start(CaptureRequest(job_id="train", duration_ms=200))
        while len(double.dispatches) < 2:
            await asyncio.sleep(0.01)
        double.forget()                                    # e.g. a restarted agent on an emptied disk
        await c.wait(rec.capture_id)
        await c.close()
    assert rec.fully_succeeded
    assert [t for _, t in double.dispatches].count("rank-0") >= 2   # sent again: at least once, never lost


async def test_transient_5xx_is_retried_and_a_refused_dispatch_is_a_visible_failure(tmp_path, http):
    write_job(tmp_path / "registry", pods=TWO_PODS, local_world_size=2)
    flaky = AgentDouble("node-a", AGENT_TOKEN, down=True)
    async with RunningAgent(flaky) as a, RunningAgent(AgentDouble("node-b", "wrong-token")) as b:
        c = make_coordinator(tmp_path, http, {"node-a": a.url, "node-b": b.url})
        rec, _ = c.start(CaptureRequest(job_id="train", duration_ms=200))
        while sum(1 for m, _ in flaky.requests if m == "PUT") < 4:
            await asyncio.sleep(0.02)
        flaky.down = False
        await c.wait(rec.capture_id)
        await c.close()
    m = manifest_of(rec)
    assert sorted(a.rank for a in m.artifacts) == [0, 1]
    refused = {f.rank: f for f in m.failures}
    assert refused[2].reason == "internal_error" and "refused" in refused[2].detail and "401" in refused[2].detail


async def test_an_artifact_outside_the_capture_prefix_is_never_believed(tmp_path, http):
    write_job(tmp_path / "registry", pods={"train-0": ("node-a", 0)}, local_world_size=1)

    class Liar(AgentDouble):
        def _archive(self, capture_id, target_id, d):
            a = super()._archive(capture_id, target_id, d)
            from dataclasses import replace
            return replace(a, uri=a.uri.replace(capture_id, "c-20000101t000000-00000000"))

    async with RunningAgent(Liar("node-a", AGENT_TOKEN)) as a:
        c = make_coordinator(tmp_path, http, {"node-a": a.url})
        rec, _ = c.start(CaptureRequest(job_id="train", duration_ms=200))
        await c.wait(rec.capture_id)
        await c.close()
    m = manifest_of(rec)
    assert m.artifacts == [] and m.failures[0].reason == "verification_failed"
    assert "outside" in m.failures[0].detail


async def test_agent_verdicts_reach_the_manifest_and_cancel_is_logical(tmp_path, http):
    write_job(tmp_path / "registry", pods=TWO_PODS, local_world_size=2)
    outcomes = {"rank-1": ("fail", "busy_timeout", "slot busy"), "rank-3": "hang"}
    double = AgentDouble("node-a", AGENT_TOKEN, step_s=0.1, outcome=lambda d, t: outcomes.get(t))
    async with RunningAgent(double) as a, RunningAgent(AgentDouble("node-b", AGENT_TOKEN, outcome=lambda d, t: "hang",
                                                                   step_s=0.1)) as b:
        c = make_coordinator(tmp_path, http, {"node-a": a.url, "node-b": b.url})
        rec, _ = c.start(CaptureRequest(job_id="train", duration_ms=200))
        while not rec.targets or not all(p.accepted for p in rec.targets.values()):
            await asyncio.sleep(0.01)
        c.cancel(rec.capture_id)
        await c.wait(rec.capture_id)
        await c.close()
    m = manifest_of(rec)
    reasons = {f.rank: f.reason for f in m.failures}
    assert reasons[1] == "busy_timeout"
    # hanging targets were queued by dynolog: a logical cancel cannot retract them, so they time out
    assert reasons[2] == "trace_timeout" and reasons[3] == "trace_timeout"
    assert rec.cancelled and len(double.cancels) == 1


async def test_a_target_that_never_registered_is_not_dispatched(tmp_path, http):
    write_job(tmp_path / "registry", pods={"train-0": ("node-a", 0)}, local_world_size=2, skip={1})
    double = AgentDouble("node-a", AGENT_TOKEN)
    async with RunningAgent(double) as a:
        c = make_coordinator(tmp_path, http, {"node-a": a.url})
        rec, _ = c.start(CaptureRequest(job_id="train", duration_ms=200))
        await c.wait(rec.capture_id)
        await c.close()
    assert [t for _, t in double.dispatches] == ["rank-0"]
    m = manifest_of(rec)
    assert [(f.rank, f.reason) for f in m.failures] == [(1, "not_registered")]
    saved = json.loads(open(rec.manifest_uri.removeprefix("file://")).read())
    assert saved["fully_succeeded"] is False and saved["expected_targets"][1]["target_id"] == "rank-1"


def test_agents_are_polled_less_often_while_no_trace_can_exist_yet():
    import time as _time

    from gpulens.capture.coordinator.fanout import AgentWorker, FanoutSettings
    from gpulens.capture.coordinator.progress import CaptureRecord

    rec = CaptureRecord("c-x", CaptureRequest(job_id="train"), "ml", "train", 0)
    w = AgentWorker(rec, "http://a", [], client=None, settings=FanoutSettings(poll_interval_s=1, quiet_poll_interval_s=3,
                                                                               max_poll_interval_s=5))
    w.answering = True
    rec.quiet_until = _time.time() + 60
    assert w._next_interval(1) == 3                 # Kineto still warming up: every 3 s is enough
    rec.quiet_until = _time.time() - 1
    assert w._next_interval(3) == 1                 # traces may land now: the normal interval
    w.answering = False
    assert w._next_interval(1) == 2 and w._next_interval(4) == 5   # an agent that does not answer: back off


async def test_a_wall_capture_starts_every_rank_at_one_instant_the_coordinator_chose(tmp_path, http):
    """Issue 47: no rank's Kineto derives its own start from the tick it read the config on. Every
    dispatch of a wall capture carries the same absolute start, that far ahead of the dispatch, and
    the manifest records it; an iteration capture carries none (it has its start iteration)."""
    import time as _time

    from gpulens.capture.coordinator.fanout import FanoutSettings

    from .conftest import FAST_FANOUT
    write_job(tmp_path / "registry", pods=TWO_PODS, local_world_size=2)
    fanout = FanoutSettings(**{**FAST_FANOUT.__dict__, "wall_start_lead_s": 3.0})
    da, db = AgentDouble("node-a", AGENT_TOKEN), AgentDouble("node-b", AGENT_TOKEN)
    async with RunningAgent(da) as a, RunningAgent(db) as b:
        c = make_coordinator(tmp_path, http, {"node-a": a.url, "node-b": b.url}, fanout=fanout)
        before = _time.time()
        rec, _ = c.start(CaptureRequest(job_id="train", duration_ms=200))
        await c.wait(rec.capture_id)
        it, _ = c.start(CaptureRequest(job_id="train", duration_ms=200, iterations=2))
        await c.wait(it.capture_id)
        wall2, _ = c.start(CaptureRequest(job_id="train", duration_ms=200))
        await c.wait(wall2.capture_id)
        await c.close()
    starts = {e.dispatch.start_time_ms for d in (da, db) for e in d.captures[rec.capture_id].values()}
    assert len(starts) == 1 and sum(len(d.captures[rec.capture_id]) for d in (da, db)) == 4
    [start] = starts
    assert before + 3.0 <= start / 1000 <= before + 3.0 + 2.0, (start / 1000 - before)
    # on Kineto's tick grid: the first wall capture on a whole second, the next where the first's
    # 200 ms window ended (tick_aligned_start_ms; tests/agent/test_tick_grid_torch.py shows the grid)
    assert start % 1000 == 0, start
    [after] = {e.dispatch.start_time_ms for d in (da, db) for e in d.captures[wall2.capture_id].values()}
    assert after % 1000 == 200 and after >= start + 3000, (start, after)
    assert manifest_of(rec).start_time_ms == start
    assert json.loads(open(rec.manifest_uri.removeprefix("file://")).read())["window"]["start_time_ms"] == start
    assert {e.dispatch.start_time_ms for d in (da, db) for e in d.captures[it.capture_id].values()} == {None}
