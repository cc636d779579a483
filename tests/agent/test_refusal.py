"""A target whose trace never comes says what to check next: Kineto's own refusals (e.g.
"insufficient time for warmup") reach only the trainer's log, so the trace_timeout detail says
whether Kineto fetched the config (the builtin endpoint sees that) and where to look."""

from __future__ import annotations

import time

from capture.agent.client import AgentClient
from tests.agent.test_agent import TOKEN, agent, converge, dispatch, node  # noqa: F401  (fixtures)


async def test_a_fetched_then_refused_config_times_out_naming_the_fetch_and_the_trainer_log(node, agent):
    proc = node.worker(0, kineto="refuse")
    node.worker(1, kineto=None)      # registered and polling never: Kineto never fetched it
    async with AgentClient(agent.url, TOKEN) as client:
        for rank in (0, 1):
            await client.dispatch("c-refused-01", f"rank-{rank}",
                                  dispatch(node, "c-refused-01", rank, duration_ms=100, deadline=time.time() + 14))
        done = await converge(client, "c-refused-01")
    refused = done["rank-0"]
    assert node.kinetos[0].configs, "the stand-in fetched the config"
    assert refused.reason.value == "trace_timeout", refused
    assert "Kineto fetched the config at" in refused.detail and "insufficient time for warmup" in refused.detail
    assert f"trainer's log for pid {proc.pid}" in refused.detail
    assert done["rank-1"].reason.value != "archived"
    assert "Kineto fetched the config" not in (done["rank-1"].detail or "")
