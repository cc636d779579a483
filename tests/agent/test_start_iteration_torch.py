"""One absolute start iteration with real PyTorch 2.13 (CPU): a plain DDP loop (no torch.profiler)
on two gloo ranks, both triggers (builtin endpoint; stock dynolog's protocol via its double).

The ranks step freely, as a real job does (no pausing). The agent reports their published step
counts (`GET /v1/workers`), the coordinator's rule chooses one start iteration ahead of them, and
both ranks must trace the identical optimizer steps, the first one `first_traced_step(start)`
(this is where that constant is measured). A rank asked only after the ranks passed the start
says `missed_start`, and the other rank's trace is still the capture's.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

import pytest

from gpulens.capture.agent.client import AgentClient
from gpulens.capture.agent.runtime import start_agent
from gpulens.capture.agent.steps import first_traced_step
from gpulens.capture.coordinator.fanout import FanoutSettings
from gpulens.capture.coordinator.start_iteration import plan_start
from tests.agent.test_torch import TOKEN, TORCHRUN, Site, archived_trace, converge, trainer_env
from tests.conftest import free_port
from tests.doubles.dynolog_double import DynologDouble

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

HERE = Path(__file__).parent
ITERATIONS = 3


@pytest.fixture(scope="module")
def site():
    s = Site()
    log = open(s.base / "trainer.log", "w")
    s.procs.append(subprocess.Popen(
        [TORCHRUN, "--nproc-per-node=2", f"--master-port={free_port()}", str(HERE / "plain_trainer.py"),
         str(s.stop_file), "380"],
        env=trainer_env(s.base, s.sock, GPULENS_JOB_ID="plain"), stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True))
    try:
        s.wait_records("plain", 2)
        yield s
    finally:
        s.close()
        log.close()


async def readings(client: AgentClient, min_count: int = 20, timeout: float = 90) -> dict:
    end = time.time() + timeout
    while True:
        views = {w.record.global_rank: w.steps for w in await client.workers() if w.record.job_id == "plain" and w.alive}
        if len(views) == 2 and all(r is not None and r.count >= min_count for r in views.values()):
            return views
        assert time.time() < end, views
        await asyncio.sleep(0.2)


def body(site: Site, capture_id: str, rank: int, start: int) -> dict:
    return {"job_id": "plain", "attempt": 0, "rank": rank, "duration_ms": 30_000, "iterations": ITERATIONS,
            "start_iteration": start, "activities": ["cpu_op"], "deadline": time.time() + 120,
            "archive_prefix": f"file://{site.base}/archive/default/plain/0/{capture_id}"}


async def aligned(site: Site, running, capture_id: str) -> tuple[int, dict]:
    async with AgentClient(running.url, TOKEN) as client:
        plan = plan_start(await readings(client), ITERATIONS, now=time.time(), lead_s=FanoutSettings().start_lead_s)
        assert plan.iteration is not None, plan.detail
        for rank in (0, 1):
            await client.dispatch(capture_id, f"rank-{rank}", body(site, capture_id, rank, plan.iteration))
        return plan.iteration, await converge(client, capture_id, timeout=150)


def check(start: int, done: dict) -> None:
    firsts = set()
    for rank in (0, 1):
        st = done[f"rank-{rank}"]
        assert st.state.value == "archived", st
        it = st.artifact.iterations
        assert it["numbering"] == "optimizer_step" and it["start"] == start and it["roundup"] == 1, it
        assert it["optimizer_steps"] == ITERATIONS and it["last"] - it["first"] == ITERATIONS - 1, it
        trace = archived_trace(st)["traceEvents"]
        assert any(e.get("cat") == "cpu_op" for e in trace) and not any(e.get("cat") == "user_annotation" for e in trace)
        assert f"optimizer steps {it['first']}..{it['last']}" in st.detail
        firsts.add(it["first"])
    assert firsts == {first_traced_step(start)}, (firsts, start)   # identical on both ranks, where Kineto says


async def test_builtin_both_ranks_trace_the_same_optimizer_steps_from_one_start(site):
    running = await start_agent(site.options())
    try:
        start, done = await aligned(site, running, "c-start-builtin")
    finally:
        await running.stop()
    check(start, done)


async def test_dynolog_both_ranks_trace_the_same_optimizer_steps_from_one_start(site):
    async with DynologDouble(socket_dir=site.sock) as double:
        running = await start_agent(site.options(trigger="dynolog", dynolog_addr=f"127.0.0.1:{double.port}"))
        try:
            start, done = await aligned(site, running, "c-start-dynolog")
        finally:
            await running.stop()
    check(start, done)
    config = next(d.config for d in double.deliveries)
    assert f"PROFILE_START_ITERATION={start}" in config and "PROFILE_START_ITERATION_ROUNDUP=1" in config


async def test_a_rank_held_back_past_the_start_misses_it_and_the_other_stays_aligned(site):
    running = await start_agent(site.options())
    try:
        async with AgentClient(running.url, TOKEN) as client:
            plan = plan_start(await readings(client), ITERATIONS, now=time.time(), lead_s=FanoutSettings().start_lead_s)
            await client.dispatch("c-held-back", "rank-0", body(site, "c-held-back", 0, plan.iteration))
            # rank 1's dispatch is held back until the ranks are past the start (a slow node, say)
            end = time.time() + 120
            while (await readings(client))[1].kineto_iteration < plan.iteration + ITERATIONS:
                assert time.time() < end
                await asyncio.sleep(0.2)
            await client.dispatch("c-held-back", "rank-1", body(site, "c-held-back", 1, plan.iteration))
            done = await converge(client, "c-held-back", timeout=150)
    finally:
        await running.stop()
    late = done["rank-1"]
    assert late.reason.value == "missed_start", late
    assert f"iteration {plan.iteration}" in late.detail
    on_time = done["rank-0"]
    assert on_time.state.value == "archived", on_time
    assert on_time.artifact.iterations["first"] == first_traced_step(plan.iteration), on_time
