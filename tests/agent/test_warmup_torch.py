"""Kineto's warm-up refusal with real torch 2.13, made to happen at will (issue 47).

A wall-clock config must be activated by Kineto's 1 s profiler tick with at least its 5 s warm-up
left before its start, or Kineto cancels it ("Not starting tracing - insufficient time for warmup")
after it has already opened an empty `<file>.tmp`. A late tick (a loaded machine) does that by
chance; a rank stopped (SIGSTOP) across the tick does it every time. The trainer is a plain loop of
someone else's shape (plain_trainer.py: optimizer steps, no profiler.step(), no markers), one rank.

- With Kineto's own start (`PROFILE_START_TIME=0`, what every wall capture sent before), a rank
  stopped for 3 s right after it fetched the config was refused ("Time to warmup (ms): 3994", issue
  47's report) and then held its process: the target waited for its deadline (`trace_timeout`) and
  the next capture ended `busy_timeout` on the empty `.tmp` (reproduced here once before the change;
  as a test it is not deterministic: Kineto's config thread may itself be descheduled past the stop).
- With the start the coordinator chooses (20 s ahead, the same instant for every rank), the same
  stop right after the fetch costs nothing: the trace runs at the chosen instant.
- Stopped across the tick that must activate the chosen start, the rank is refused; again reported
  within two polls, and the next capture archives.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpulens.capture.agent.client import AgentClient
from gpulens.capture.agent.runtime import start_agent
from gpulens.capture.coordinator.fanout import FanoutSettings
from tests.agent.test_torch import TOKEN, Site, converge, trainer_env
from tests.conftest import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

HERE = Path(__file__).parent
JOB = "warmup"
LEAD_S = FanoutSettings().wall_start_lead_s
POLL_S = 5.0


@pytest.fixture(scope="module")
def site():
    s = Site()
    s.log = s.base / "trainer.log"
    out = open(s.log, "w")
    s.procs.append(subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", f"--master-port={free_port()}",
         str(HERE / "plain_trainer.py"), str(s.stop_file), "400"],
        env=trainer_env(s.base, s.sock, GPULENS_JOB_ID=JOB), stdout=out, stderr=subprocess.STDOUT,
        start_new_session=True))
    try:
        s.wait_records(JOB, 1)
        yield s
    finally:
        s.close()
        out.close()


def body(site: Site, rec: dict, capture_id: str, *, start_in_s: float | None) -> dict:
    b = {"job_id": JOB, "attempt": 0, "rank": 0, "duration_ms": 1000, "activities": ["cpu_op"],
         "deadline": time.time() + (start_in_s or 0) + 60,
         "archive_prefix": f"file://{site.base}/archive/default/{JOB}/0/{capture_id}"}
    if start_in_s is not None:      # as the coordinator chooses it for a wall capture
        b["start_time_ms"] = int((time.time() + start_in_s) * 1000)
    return b


async def known(running, pid: int, timeout: float = 30) -> None:
    """A fresh agent's endpoint knows the rank once its Kineto polled it (every 5 s)."""
    end = time.time() + timeout
    while not any(p.leaf == pid for p in running.endpoint.processes()):
        assert time.time() < end, "Kineto never polled the agent's endpoint"
        await asyncio.sleep(0.2)


async def fetched_at(client: AgentClient, capture_id: str, timeout: float = 30) -> float:
    """When the rank's Kineto fetched the config from the agent's endpoint (the detail says so)."""
    end = time.time() + timeout
    while True:
        [st] = await client.status(capture_id)
        m = re.search(r"Kineto fetched the config at ([0-9.]+)", st.detail or "")
        if m:
            return float(m.group(1))
        assert time.time() < end and not st.terminal, st
        await asyncio.sleep(0.05)


async def stopped(pid: int, seconds: float) -> None:
    os.kill(pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)


async def until(t: float) -> None:
    await asyncio.sleep(max(0.0, t - time.time()))


async def next_capture_archives(client: AgentClient, site: Site, rec: dict, capture_id: str):
    """The rank's next wall capture, right away, at a chosen start: it must archive."""
    await client.dispatch(capture_id, "rank-0", body(site, rec, capture_id, start_in_s=LEAD_S))
    return (await converge(client, capture_id, timeout=LEAD_S + 60))["rank-0"]


async def test_a_stop_right_after_the_fetch_costs_nothing_with_the_chosen_start(site):
    running = await start_agent(site.options())
    rec = site.records(JOB)[0]
    try:
        await known(running, rec["pid"])
        async with AgentClient(running.url, TOKEN) as client:
            b = body(site, rec, "c-chosen-first", start_in_s=LEAD_S)
            await client.dispatch("c-chosen-first", "rank-0", b)
            await fetched_at(client, "c-chosen-first")
            await stopped(rec["pid"], 3.0)
            done = (await converge(client, "c-chosen-first", timeout=LEAD_S + 60))["rank-0"]
    finally:
        await running.stop()
    assert done.state.value == "archived", done.detail
    w = done.artifact.window
    assert w["chosen_start"] == b["start_time_ms"] / 1000
    assert 0 <= w["start_skew_s"] <= 1.5, w          # the first profiler tick at or after the chosen instant


async def test_a_stop_across_the_activation_tick_of_the_chosen_start_is_reported_and_frees_the_rank(site):
    running = await start_agent(site.options())
    rec = site.records(JOB)[0]
    try:
        await known(running, rec["pid"])
        async with AgentClient(running.url, TOKEN) as client:
            b = body(site, rec, "c-across-first", start_in_s=LEAD_S)
            start = b["start_time_ms"] / 1000
            await client.dispatch("c-across-first", "rank-0", b)
            await fetched_at(client, "c-across-first")
            await until(start - 7.5)                   # the tick that must activate it falls in [start - 7, start - 6)
            await stopped(rec["pid"], 4.0)             # resumed at start - 3.5: Kineto activates with < 5 s left
            first = (await converge(client, "c-across-first", timeout=60))["rank-0"]
            after = await next_capture_archives(client, site, rec, "c-across-next")
    finally:
        await running.stop()
    assert first.reason is not None and first.reason.value == "kineto_refused", first
    assert "warm-up refusal" in first.detail
    # refused on the first idle poll 6 s past start - 5 s; two polls' latitude
    assert first.updated_at - start <= 1 + 2 * POLL_S + 2, (first.updated_at - start, first.detail)
    assert after.state.value == "archived", after
    assert site.log.read_text().count("insufficient time for warmup") + \
        site.log.read_text().count("start timestamp is in the past") >= 1


async def test_a_chosen_start_too_close_to_meet_still_archives_on_kinetos_own_clock_flagged(site):
    """What an agent restarted mid-capture meets (the cluster's churn test): the chosen instant is 4 s
    away, less than poll + tick + warm-up. Sending it would be refused for warm-up; dropping the rank
    would lose its evidence. The config goes out with Kineto's own start and the window says so."""
    running = await start_agent(site.options())
    rec = site.records(JOB)[0]
    try:
        await known(running, rec["pid"])
        async with AgentClient(running.url, TOKEN) as client:
            b = body(site, rec, "c-late-start", start_in_s=4.0)
            await client.dispatch("c-late-start", "rank-0", b)
            done = (await converge(client, "c-late-start", timeout=90))["rank-0"]
    finally:
        await running.stop()
    assert done.state.value == "archived", done.detail
    w = done.artifact.window
    assert w["chosen_start"] == b["start_time_ms"] / 1000
    assert "Kineto's own clock" in w["late_start"], w
    assert w["start_skew_s"] > 0, w                   # after the instant it could not meet, and said so
