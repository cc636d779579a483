"""Capture after capture on one process (issue 34), with the Kineto stand-in: every outcome a fact,
no trace ever lost, no config sent to a Kineto that would ignore it, a rank past the capture's
start iteration never asked. Real PyTorch runs the same paths in test_start_iteration_torch.py."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import threading
import time
from pathlib import Path

import aiohttp
import pytest

from gpulens.capture.agent.client import AgentClient
from gpulens.hooks import hook_path
from tests.agent.test_agent import TOKEN, Node, agent, converge, dispatch, node  # noqa: F401  (fixtures)

sys.path.insert(0, str(hook_path()))
from _gpulens_steps import StepPublisher, steps_filename  # noqa: E402  (the hook's own writer)


async def wait_state(client: AgentClient, capture_id: str, target_id: str, pred, timeout: float = 30):
    end = time.time() + timeout
    last = None
    while time.time() < end:
        last = {s.target_id: s for s in await client.status(capture_id) or []}.get(target_id)
        if last is not None and pred(last):
            return last
        await asyncio.sleep(0.05)
    raise AssertionError(f"{capture_id}/{target_id}: {last}")


async def test_an_iteration_trace_never_seen_busy_does_not_make_the_next_capture_refused(node, agent):
    """Real Kineto polls every 5 s, and an iteration trace of a few fast steps starts and ends
    between two polls: no poll ever says busy. The next capture's config is then taken and traced
    as usual. On main the agent still believed the first config held unstarted, called the second
    `kineto_refused` ("held by" the capture that was already archived) and removed its folder,
    so the trace Kineto then wrote met ENOENT and was lost."""
    node.worker(0, kineto="between_polls", poll_s=0.2, trace_delay_s=3.0)   # a time trace's warm-up takes seconds
    async with AgentClient(agent.url, TOKEN) as client:
        await client.dispatch("c-iter-first", "rank-0", dispatch(node, "c-iter-first", 0, iterations=3,
                                                                 iteration_roundup=1))
        first = (await converge(client, "c-iter-first"))["rank-0"]
        assert first.state.value == "archived", first
        for n in range(3):   # capture after capture, the way an incident goes
            cid = f"c-after-{n}"
            await client.dispatch(cid, "rank-0", dispatch(node, cid, 0))
            st = (await converge(client, cid))["rank-0"]
            assert st.state.value == "archived", st
            assert "refused" not in (st.detail or ""), st.detail
    assert not node.kinetos[0].failed, node.kinetos[0].failed     # no "Failed to open": no trace lost
    assert len(node.kinetos[0].written) == 4


async def test_a_trace_that_lands_after_its_target_ended_finds_its_folder_and_is_archived_late(node, agent):
    """Kineto traced past the target's deadline: the target ends `trace_timeout`, but the folder
    stays while Kineto may still write, and the file that lands is archived as `.late.json`."""
    gate = threading.Event()
    node.worker(0, start_gate=gate)
    folder = node.base / "traces" / "c-outran"
    async with AgentClient(agent.url, TOKEN) as client:
        await client.dispatch("c-outran", "rank-0", dispatch(node, "c-outran", 0, deadline=time.time() + 14))
        st = (await converge(client, "c-outran", timeout=40))["rank-0"]
        assert st.reason.value == "trace_timeout", st
        assert folder.is_dir(), "the folder went while Kineto was still tracing into it"
        gate.set()
        late = await wait_state(client, "c-outran", "rank-0", lambda s: "late trace" in (s.detail or ""))
    assert late.reason.value == "trace_timeout"          # the final state stays what was reported
    assert not node.kinetos[0].failed, node.kinetos[0].failed
    archived = node.base / "archive" / "ns" / "train" / "0" / "c-outran" / "traces" / "rank-0.late.json"
    assert json.loads(archived.read_text())["traceEvents"], archived
    assert f"archived to file://{archived}" in late.detail and "verified" in late.detail
    end = time.time() + 10
    while folder.exists():   # the local copy and the folder go once it is archived
        assert time.time() < end, sorted(p.name for p in folder.iterdir())
        await asyncio.sleep(0.05)
    assert "gpulens_agent_late_traces_total 1.0" in await metrics_text(agent.url)


async def metrics_text(url: str) -> str:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as resp:
        return await resp.text()


async def test_no_config_is_sent_while_the_process_may_still_hold_an_earlier_one(node, agent):
    """A config sent while Kineto holds another would be ignored by Kineto; the agent keeps it
    until the earlier one's trace lands, then sends it, and both captures end archived/late."""
    gate = threading.Event()
    node.worker(0, start_gate=gate)
    kineto = node.kinetos[0]
    async with AgentClient(agent.url, TOKEN) as client:
        await client.dispatch("c-holder", "rank-0", dispatch(node, "c-holder", 0, deadline=time.time() + 14))
        await converge(client, "c-holder", timeout=40)
        await client.dispatch("c-next-one", "rank-0", dispatch(node, "c-next-one", 0, deadline=time.time() + 40))
        waiting = await wait_state(client, "c-next-one", "rank-0", lambda s: s.state.value == "waiting_for_slot")
        assert "capture c-holder target rank-0" in waiting.detail, waiting.detail
        await asyncio.sleep(1.0)   # a negative fact needs time to show: nothing was sent meanwhile
        assert len(kineto.configs) == 1, kineto.configs
        gate.set()
        nxt = (await converge(client, "c-next-one", timeout=40))["rank-0"]
    assert nxt.state.value == "archived", nxt
    assert len(kineto.configs) == 2 and not kineto.failed


async def test_a_tmp_kineto_left_behind_after_going_idle_does_not_hold_its_process(node, agent):
    """Kineto renames its file before it goes idle, so a `.tmp` still there after its polls said
    the trace ran and ended is a write that failed, not one in progress. The process is free for
    the next capture at once; before, the `.tmp` alone kept it "held" for the whole 10 min linger
    and every later capture of that rank waited and ended `busy_timeout` (seen in the soak)."""
    node.worker(0, kineto="no_rename")
    kineto = node.kinetos[0]
    async with AgentClient(agent.url, TOKEN) as client:
        await client.dispatch("c-torn-write", "rank-0", dispatch(node, "c-torn-write", 0, deadline=time.time() + 14))
        torn = (await converge(client, "c-torn-write", timeout=40))["rank-0"]
        assert torn.state.value == "failed", torn
        assert list((node.base / "traces" / "c-torn-write").glob("*.json.tmp")), "the stand-in left no .tmp"
        kineto.mode = "honest"
        await client.dispatch("c-after-torn-write", "rank-0", dispatch(node, "c-after-torn-write", 0, deadline=time.time() + 30))
        after = (await converge(client, "c-after-torn-write", timeout=50))["rank-0"]
    assert after.state.value == "archived", after
    assert len(kineto.configs) == 2, kineto.configs


def publish_steps(node: Node, rank: int, pid: int, count: int, *, per_s: float = 20.0, ahead_s: float = 0.0) -> Path:
    """The hook's own step file for a stand-in worker, `count` steps at `per_s` up to now (+ `ahead_s`:
    steps stamped that far into the future, as a trainer will have stepped by then)."""
    class Tracker:
        _current_step = 0
    path = node.base / "reg" / steps_filename("pid:[1]", pid)
    pub = StepPublisher(str(path), Tracker)
    now = time.time_ns() + int(ahead_s * 1e9)
    import struct
    for step in range(max(1, count - 50), count + 1):
        t = now - int((count - step) / per_s * 1e9)
        struct.pack_into("<qq", pub.map, 64 + (step % 4096) * 16, step, t)
        struct.pack_into("<qq", pub.map, 16, step, t)
    pub.map.flush()
    rec_path = node.base / "reg" / f"r{rank}.json"
    rec = json.loads(rec_path.read_text())
    rec["steps_file"] = path.name
    rec_path.write_text(json.dumps(rec))
    return path


async def test_a_rank_already_past_the_start_iteration_is_not_asked_and_says_missed_start(node, agent):
    p = node.worker(0)
    publish_steps(node, 0, p.pid, count=120)          # Kineto's iteration 119
    async with AgentClient(agent.url, TOKEN) as client:
        workers = (await client.workers())
        assert workers[0].steps is not None and workers[0].steps.count == 120 and workers[0].steps.per_s > 10
        await client.dispatch("c-too-late", "rank-0", dispatch(node, "c-too-late", 0, iterations=3,
                                                               start_iteration=100))
        st = (await converge(client, "c-too-late"))["rank-0"]
    assert st.reason.value == "missed_start", st
    assert "Kineto iteration 119" in st.detail and "iteration 100" in st.detail
    assert node.kinetos[0].configs == []                # never sent: Kineto would have started it late


async def test_a_rank_behind_the_start_iteration_gets_that_absolute_start(node, agent):
    p = node.worker(0)
    publish_steps(node, 0, p.pid, count=40)
    async with AgentClient(agent.url, TOKEN) as client:
        await client.dispatch("c-on-time", "rank-0", dispatch(node, "c-on-time", 0, iterations=3, start_iteration=400))
        await converge(client, "c-on-time")
    cfg = node.kinetos[0].configs[0]
    assert (cfg["PROFILE_START_ITERATION"], cfg["PROFILE_START_ITERATION_ROUNDUP"]) == ("400", "1")


async def test_a_trace_that_started_at_another_iteration_is_archived_as_evidence_not_deleted(node, agent):
    """Issue 43: Kineto took the config after the chosen iteration (steps 150.. instead of 101..). Not
    the capture's photo, but this rank's evidence: archived as `traces/rank-0.misaligned.json.gz`, the
    target `missed_start` naming it and the steps it holds; before, the file was deleted."""
    gate = threading.Event()
    p = node.worker(0, start_gate=gate, profiler_span=True)
    publish_steps(node, 0, p.pid, count=40)                       # behind iteration 100: the config is sent
    async with AgentClient(agent.url, TOKEN) as client:
        await client.dispatch("c-misaligned", "rank-0", dispatch(node, "c-misaligned", 0, iterations=3,
                                                                 start_iteration=100))
        end = time.time() + 20
        while not node.kinetos[0].configs:
            assert time.time() < end, await client.status("c-misaligned")
            await asyncio.sleep(0.05)
        publish_steps(node, 0, p.pid, count=200, per_s=20, ahead_s=2.5)   # meanwhile it stepped far past 100
        gate.set()
        st = (await converge(client, "c-misaligned"))["rank-0"]
    assert st.reason is not None and st.reason.value == "missed_start", st
    assert "started at its next step" in st.detail and "archived as this rank's evidence" in st.detail, st.detail
    kept = node.base / "archive" / "ns" / "train" / "0" / "c-misaligned" / "traces" / "rank-0.misaligned.json.gz"
    assert kept.is_file() and f"file://{kept}" in st.detail
    traced = re.search(r"traced optimizer steps (\d+)\.\.(\d+)", st.detail)
    assert traced and int(traced.group(1)) > 101, st.detail        # the steps it holds, not the chosen ones
    import gzip
    assert json.loads(gzip.decompress(kept.read_bytes()))["traceEvents"]
    assert not list((node.base / "traces").rglob("*.json"))        # moved to the archive, not left on the node


@pytest.mark.parametrize("bad", [-1, 1.5, "7", True])
def test_a_dispatch_with_a_bad_start_iteration_is_refused(bad):
    from gpulens.capture import schemas
    from gpulens.capture.models import Dispatch
    body = {"job_id": "j", "attempt": 0, "rank": 0, "duration_ms": 300, "activities": ["cpu_op"], "deadline": 1.0,
            "archive_prefix": "file:///a", "iterations": 3, "start_iteration": bad}
    with pytest.raises(schemas.SchemaError) as err:
        Dispatch.from_dict(body)
    assert "start_iteration" in str(err.value)


async def test_a_restarted_agent_keeps_watching_for_a_late_trace(node):
    """The agent is restarted (a DaemonSet rollout) while a failed target's config may still make
    Kineto write: the new agent resumes the watch from disk, keeps the folder, and archives the
    trace that lands as `.late.json`. Before, lingering lived only in the old process: the new one
    skipped the ended target, and the trace met no watcher (and, on the last target, no folder)."""
    from tests.agent.test_agent import start_agent
    gate = threading.Event()
    node.worker(0, start_gate=gate)
    folder = node.base / "traces" / "c-restart-late"
    running = await start_agent(node.options())
    try:
        async with AgentClient(running.url, TOKEN) as client:
            await client.dispatch("c-restart-late", "rank-0", dispatch(node, "c-restart-late", 0,
                                                                       deadline=time.time() + 14))
            st = (await converge(client, "c-restart-late", timeout=40))["rank-0"]
            assert st.reason.value == "trace_timeout", st
    finally:
        await running.stop()
    assert folder.is_dir()
    running = await start_agent(node.options())
    try:
        async with AgentClient(running.url, TOKEN) as client:
            gate.set()                                   # Kineto writes now, with only the new agent there
            late = await wait_state(client, "c-restart-late", "rank-0", lambda s: "late trace" in (s.detail or ""))
        assert late.reason.value == "trace_timeout"
        archived = node.base / "archive" / "ns" / "train" / "0" / "c-restart-late" / "traces" / "rank-0.late.json"
        assert json.loads(archived.read_text())["traceEvents"], archived
        assert not node.kinetos[0].failed, node.kinetos[0].failed
    finally:
        await running.stop()
