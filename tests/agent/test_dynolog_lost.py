"""dynolog's raw answers are kept per trigger attempt, and a trace that never comes is told apart:
`dynolog_lost` when the dynolog that queued the config died (its pending slot died with it),
`trace_timeout` when it still answers. The dynolog double runs as its own process, so "died" is a
real SIGKILL of a real listener, and the agent is the real one (HTTP, files, RPC)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from gpulens.capture.agent.client import AgentClient
from gpulens.capture.agent.runtime import start_agent
from tests.agent.fake_kineto import FakeKineto
from tests.agent.test_agent import KJOB, TOKEN, converge, dispatch, node  # noqa: F401  (fixtures)

REPO = Path(__file__).resolve().parents[2]


def start_double(sock_dir: str) -> tuple[subprocess.Popen, int]:
    """`python -m tests.doubles.dynolog_double` on a free loopback port; returns (process, RPC port)."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.doubles.dynolog_double", "--port", "0",
                             "--socket-dir", sock_dir], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    line = proc.stdout.readline()  # the double prints its ready line before it serves
    ready = json.loads(line)
    assert ready["ready"], line
    return proc, ready["rpc_port"]


async def scrape(url: str) -> dict[tuple[str, tuple], float]:
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


async def wait_state(client: AgentClient, capture_id: str, state: str, timeout: float = 20.0):
    end = time.time() + timeout
    while time.time() < end:
        statuses = await client.status(capture_id)
        if statuses and statuses[0].state.value == state:
            return statuses[0]
        if statuses and statuses[0].terminal:
            raise AssertionError(f"ended before {state}: {statuses[0]}")
        await asyncio.sleep(0.05)
    raise AssertionError(f"{capture_id} never reached {state}")


async def test_dynolog_killed_after_queueing_is_dynolog_lost_at_the_deadline(node):  # noqa: F811
    double, port = start_double(node.sock_dir)
    try:
        proc = node.worker(0, kineto="refuse")  # fetches the config, writes nothing
        running = await start_agent(node.options(trigger="dynolog", dynolog_addr=f"127.0.0.1:{port}"))
        try:
            deadline = time.time() + 14
            async with AgentClient(running.url, TOKEN) as client:
                await client.dispatch("c-dyn-lost-01", "rank-0",
                                      dispatch(node, "c-dyn-lost-01", 0, duration_ms=100, deadline=deadline))
                await wait_state(client, "c-dyn-lost-01", "queued_by_dynolog")
                os.killpg(double.pid, signal.SIGKILL)
                double.wait(10)
                st = (await converge(client, "c-dyn-lost-01", timeout=30))["rank-0"]
            metrics = await scrape(running.url)
        finally:
            await running.stop()
    finally:
        if double.poll() is None:
            os.killpg(double.pid, signal.SIGKILL)
            double.wait(10)
    assert st.reason.value == "dynolog_lost", st
    assert st.updated_at <= deadline + 3, "the verdict comes at the deadline, not a timeout later"
    assert f"dynolog at 127.0.0.1:{port} not listening" in st.detail
    # the last raw answer: dynolog had put the config in this pid's slot
    assert f"activityProfilersTriggered=[{proc.pid}]" in st.detail and "activityProfilersBusy=0" in st.detail
    last = st.trigger_attempts[-1]
    assert last.backend == "dynolog" and last.triggered == [proc.pid] and proc.pid in last.processes_matched
    # /metrics (no token): every RPC timed by method, the failed probe counted, the target's reason
    requests = sum(a.count for a in st.trigger_attempts)
    assert metrics[("gpulens_agent_dynolog_rpc_duration_seconds_count", (("method", "setKinetOnDemandRequest"),))] \
        == requests
    assert metrics[("gpulens_agent_dynolog_rpc_duration_seconds_count", (("method", "getVersion"),))] == 1
    assert metrics[("gpulens_agent_dynolog_rpc_errors_total",
                    (("method", "getVersion"), ("reason", "dynolog_unreachable")))] == 1
    assert not any(k[0] == "gpulens_agent_dynolog_rpc_errors_total" and ("method", "setKinetOnDemandRequest") in k[1]
                   for k in metrics), "the queueing call answered"
    assert metrics[("gpulens_agent_targets_total", (("outcome", "failed"), ("reason", "dynolog_lost")))] == 1
    assert metrics[("gpulens_agent_targets_total", (("outcome", "failed"), ("reason", "trace_timeout")))] == 0


async def test_dynolog_alive_but_no_trace_is_trace_timeout_with_every_raw_answer_kept(node):  # noqa: F811
    double, port = start_double(node.sock_dir)
    try:
        proc = node.worker(0, kineto=None)  # not polling yet: dynolog does not know the pid
        running = await start_agent(node.options(trigger="dynolog", dynolog_addr=f"127.0.0.1:{port}"))
        try:
            async with AgentClient(running.url, TOKEN) as client:
                await client.dispatch("c-dyn-alive-1", "rank-0",
                                      dispatch(node, "c-dyn-alive-1", 0, duration_ms=100, deadline=time.time() + 16))
                unmatched = await wait_state(client, "c-dyn-alive-1", "not_matched")
                # the history is on disk (and so in the API) while the state has not changed
                assert unmatched.trigger_attempts[0].processes_matched == []
                kineto = FakeKineto(node.sock_dir, KJOB, proc.pid, mode="refuse")
                kineto.start()
                node.kinetos.append(kineto)
                st = (await converge(client, "c-dyn-alive-1", timeout=30))["rank-0"]
        finally:
            await running.stop()
    finally:
        os.killpg(double.pid, signal.SIGKILL)
        double.wait(10)
    assert st.reason.value == "trace_timeout", st
    assert "dynolog still answers" in st.detail and "dynolog_lost" not in st.detail
    # not the permissions only: Kineto's own refusal, a profiler session, a stuck trainer are named too
    assert "insufficient time for warmup" in st.detail and "torch.profiler" in st.detail
    first, last = st.trigger_attempts[0], st.trigger_attempts[-1]
    assert (first.processes_matched, first.triggered, first.busy, first.error) == ([], [], 0, None)
    assert first.count >= 1 and first.at <= (first.last_at or first.at)
    assert last.triggered == [proc.pid] and proc.pid in last.processes_matched and last.busy == 0
    assert len(st.trigger_attempts) == 2, "repeats of one answer are counted, not listed"
    assert f"activityProfilersTriggered=[{proc.pid}]" in st.detail


async def test_the_builtin_endpoint_never_reports_dynolog_lost(node):  # noqa: F811
    """The builtin endpoint lives in the agent: a missing trace there is never dynolog_lost (a
    Kineto that fetched the config and dropped it is kineto_refused, test_refusal.py)."""
    node.worker(0, kineto="refuse")
    running = await start_agent(node.options())
    try:
        async with AgentClient(running.url, TOKEN) as client:
            await client.dispatch("c-builtin-to1", "rank-0",
                                  dispatch(node, "c-builtin-to1", 0, duration_ms=100, deadline=time.time() + 14))
            st = (await converge(client, "c-builtin-to1", timeout=30))["rank-0"]
    finally:
        await running.stop()
    assert st.reason.value == "kineto_refused", st
    assert st.trigger_attempts and st.trigger_attempts[-1].backend == "builtin"
