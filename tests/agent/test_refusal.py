"""Kineto's own refusal reaches the target status (builtin endpoint). Kineto never answers a config,
but its polls say whether it went busy: a config it fetched and then dropped ends the target
`failed(kineto_refused)` at once, with what Kineto's log will say; a trace that ran but left no
file, and a config never fetched, end `trace_timeout` naming what was seen and what to check.
(The double here follows Kineto's wire behaviour; test_refusal_torch.py makes real torch refuse.)"""

from __future__ import annotations

import time

from gpulens.capture.agent.client import AgentClient
from tests.agent.test_agent import TOKEN, agent, converge, dispatch, node  # noqa: F401  (fixtures)


async def test_a_fetched_then_dropped_config_fails_kineto_refused_before_the_deadline(node, agent):
    proc = node.worker(0, kineto="refuse")
    node.worker(1, kineto=None)      # registered, but no Kineto ever polls for it
    deadline = time.time() + 30
    async with AgentClient(agent.url, TOKEN) as client:
        for rank in (0, 1):
            await client.dispatch("c-refused-01", f"rank-{rank}",
                                  dispatch(node, "c-refused-01", rank, duration_ms=100, deadline=deadline))
        done = await converge(client, "c-refused-01")
    refused = done["rank-0"]
    assert node.kinetos[0].configs, "the stand-in fetched the config"
    assert refused.reason.value == "kineto_refused", refused
    assert refused.updated_at < deadline - 10, "said when Kineto's polls showed it, not at the deadline"
    assert f"Kineto in pid {proc.pid} fetched the config at" in refused.detail and "dropped it" in refused.detail
    assert "insufficient time for warmup" in refused.detail
    never = done["rank-1"]
    assert never.reason.value == "not_matched", never
    assert "dropped" not in never.detail


async def test_a_trace_that_ran_but_left_no_file_times_out_saying_kineto_traced(node, agent):
    proc = node.worker(0, kineto="no_file")
    async with AgentClient(agent.url, TOKEN) as client:
        await client.dispatch("c-nofile-01", "rank-0",
                              dispatch(node, "c-nofile-01", 0, duration_ms=300, deadline=time.time() + 16))
        done = await converge(client, "c-nofile-01")
    st = done["rank-0"]
    assert node.kinetos[0].configs and not node.kinetos[0].written
    assert st.reason.value == "trace_timeout", st
    assert "traced from" in st.detail and "was idle again" in st.detail and "wrote no file" in st.detail
    assert f"pid {proc.pid}" in st.detail and "dropped" not in st.detail
