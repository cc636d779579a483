"""Real PyTorch 2.13 (CPU) refuses configs, and the builtin endpoint sees it from Kineto's polls.

Two refusals real torch makes (measured; its own log lines are checked alongside):
- a config it cannot parse ("Failed to parse config", then "start timestamp is in the past"): it
  never goes busy, so the endpoint reports `refused`/`not_started`;
- a second config while an iteration-aligned one waits for its start iteration would be ignored
  ("Ignored request - another profile request is pending."): the agent never sends it (the second
  capture's target waits, naming the capture whose config Kineto holds, and ends
  `failed(busy_timeout)`), and the waiting one times out saying it waited for its iteration.
One stepping rank (stepping_trainer.py under torchrun, world size 1).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpulens.capture.agent.client import AgentClient
from gpulens.capture.agent.runtime import start_agent
from tests.agent.test_torch import TOKEN, Site, converge, trainer_env
from tests.conftest import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def site():
    s = Site()
    s.pause = s.base / "pause"          # never created: the rank steps all the time
    s.log = s.base / "trainer.log"
    out = open(s.log, "w")
    s.procs.append(subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", f"--master-port={free_port()}", str(HERE / "stepping_trainer.py"),
         str(s.stop_file), str(s.pause), "280"],
        env=trainer_env(s.base, s.sock, GPULENS_JOB_ID="refuse", KINETO_LOG_LEVEL="1"), stdout=out,
        stderr=subprocess.STDOUT, start_new_session=True))
    try:
        s.wait_records("refuse", 1)
        end = time.time() + 120
        while not (s.base / "pause.started.0").exists():     # Kineto counts its optimizer steps from here
            assert time.time() < end and s.procs[0].poll() is None, s.log.read_text()[-3000:]
            time.sleep(0.2)
        yield s
    finally:
        s.close()
        out.close()


async def test_a_config_real_kineto_cannot_parse_is_reported_dropped(site):
    running = await start_agent(site.options())
    said = []
    forward = running.endpoint.on_kineto
    running.endpoint.on_kineto = lambda o: (said.append(o), forward(o))
    try:
        rec = site.records("refuse")[0]
        end = time.time() + 30
        while not any(p.leaf == rec["pid"] for p in running.endpoint.processes()):
            assert time.time() < end, "Kineto never polled the agent's endpoint"
            await asyncio.sleep(0.2)
        log_file = os.path.join(site.base, "traces", "unparsable.json")
        config = f"ACTIVITIES_LOG_FILE={log_file}\nACTIVITY_TYPES=cpu_op,no_such_activity\nACTIVITIES_DURATION_MSECS=200"
        result = running.endpoint.trigger(config, [rec["pid"]], rec["kineto_job_id"], trace_id="9001")
        assert result.activity_triggered == (rec["pid"],)
        end = time.time() + 30
        while not [o for o in said if o.trace_id == "9001"]:
            assert time.time() < end, f"no verdict on the config: {said}"
            await asyncio.sleep(0.2)
    finally:
        await running.stop()
    mine = [o for o in said if o.trace_id == "9001"]
    assert [(o.kind, o.cause, o.pid) for o in mine] == [("refused", "not_started", rec["pid"])]
    log = site.log.read_text()
    assert "Failed to parse config: Invalid activity type: no_such_activity" in log   # Kineto's own words agree
    assert not any(p.name.startswith("unparsable_") and p.name.endswith(".json")
                   for p in (site.base / "traces").iterdir())


async def test_a_capture_while_an_iteration_capture_waits_is_never_sent_to_kineto(site):
    """While Kineto holds a fetched iteration config unstarted it ignores new ones ("Ignored request
    - another profile request is pending."). The agent knows the earlier config is out with that
    process, so it keeps the second one back (`waiting_for_slot`, naming the holder) and, with the
    earlier one still held at the deadline, ends it `busy_timeout`: Kineto never sees it."""
    running = await start_agent(site.options())
    rec = site.records("refuse")[0]

    def body(capture_id: str, **over) -> dict:
        b = {"job_id": rec["job_id"], "attempt": 0, "rank": 0, "duration_ms": 200, "activities": ["cpu_op"],
             "archive_prefix": f"file://{site.base}/archive/default/{rec['job_id']}/0/{capture_id}"}
        b.update(over)
        return b

    try:
        async with AgentClient(running.url, TOKEN) as client:
            # starts at the next multiple of 1,000,000 steps: Kineto holds it, unstarted, to the end
            await client.dispatch("c-held-iter-a", "rank-0", body("c-held-iter-a", iterations=5, iteration_roundup=1_000_000,
                                                                  deadline=time.time() + 40))
            end = time.time() + 30
            while "Kineto fetched the config" not in ((await client.status("c-held-iter-a"))[0].detail or ""):
                assert time.time() < end, await client.status("c-held-iter-a")
                await asyncio.sleep(0.2)
            await client.dispatch("c-second-b", "rank-0", body("c-second-b", deadline=time.time() + 60))
            second = (await converge(client, "c-second-b", timeout=60))["rank-0"]
            held = (await converge(client, "c-held-iter-a", timeout=60))["rank-0"]
    finally:
        await running.stop()
    assert second.reason.value == "busy_timeout", second
    assert "capture c-held-iter-a target rank-0's config" in second.detail and "would ignore" in second.detail
    assert "Ignored request - another profile request is pending." not in site.log.read_text()   # never sent
    assert held.reason.value == "trace_timeout", held
    assert "waits for its start iteration" in held.detail and "kineto_refused" not in held.detail
