"""The trace budget with real PyTorch 2.13 (CPU), the real agent and the real coordinator (issue 27).

A one-process trainer whose trace is large per iteration (heavy_trainer.py: ~800 ops a step, ~1 MiB of trace) is
captured twice through an in-process coordinator and a real agent with the builtin endpoint:

1. a generous budget (the default, 200 MiB) leaves the request as asked (4 iterations, no change);
   that capture measures the job's bytes per iteration;
2. a budget of a few MiB, smaller than 10 of those iterations, makes the coordinator choose fewer
   iterations from that measurement; the agent archives a trace of exactly that many optimizer
   steps whose uncompressed size is within the budget, gzip, as the manifest says.

A wall-clock capture runs between the two, and another after: each kind is priced from the job's
captures of that kind however they alternate (issue 43), never "conservative" once one was measured.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from gpulens.capture.agent.runtime import start_agent
from gpulens.capture.coordinator import AgentUrls, Coordinator, CoordinatorSettings, LocalDiscovery, Phase
from gpulens.capture.coordinator.agents import AgentFleet
from gpulens.capture.wire.auth import SecretFile
from gpulens.capture.models import CaptureRequest, Manifest
from gpulens.capture.models.budget import MIB
from tests.agent.test_torch import TOKEN, Site, archived_trace, trainer_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

HERE = Path(__file__).parent
JOB = "heavy"


@pytest.fixture(scope="module")
def site():
    s = Site()
    log = open(s.base / "trainer.log", "w")
    s.procs.append(subprocess.Popen([sys.executable, str(HERE / "heavy_trainer.py"), str(s.stop_file), "380", "800"],
                                    env=trainer_env(s.base, s.sock, GPULENS_JOB_ID=JOB), stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True))
    try:
        s.wait_records(JOB, 1)
        yield s
    finally:
        s.close()
        log.close()


def manifest(rec) -> Manifest:
    return Manifest.from_json(Path(rec.manifest_uri.removeprefix("file://")).read_text())


async def test_a_few_mib_budget_chooses_fewer_iterations_and_the_trace_stays_inside_it(site):
    running = await start_agent(site.options(min_free_mb=0))
    token = site.base / "agent.token"
    token.write_text(TOKEN)
    try:
        async with aiohttp.ClientSession() as http:
            settings = CoordinatorSettings(job_id=JOB, attempt=0, namespace="local",
                                           archive_root=f"file://{site.base}/archive")
            discovery = LocalDiscovery(site.base / "reg", job_id=JOB, attempt=0, namespace="local",
                                       agents=AgentUrls(url=running.url))
            c = Coordinator(settings, discovery, AgentFleet(http, SecretFile(token), timeout_s=5.0))
            try:
                # 1. generous (the default budget): the request goes out as asked
                asked = CaptureRequest(job_id=JOB, duration_ms=60_000, iterations=4, iteration_roundup=5,
                                       activities=("cpu_op", "user_annotation"))
                first, _ = c.start(asked)
                assert first.request.iterations == 4 and first.budget.changes == ()
                assert first.request.options == asked.options and first.request.duration_ms == 60_000
                await c.wait(first.capture_id)
                assert first.phase == Phase.CONVERGED and first.fully_succeeded, first.to_status(full=True)
                art = manifest(first).artifacts[0]
                assert art.iterations["optimizer_steps"] == 4 and art.sizes["budget"] == 200 * MIB
                per_iteration = art.sizes["uncompressed"] / 4
                assert per_iteration > 256 << 10, per_iteration      # the trainer is heavy per iteration

                # a wall-clock capture between the two (issue 43): it measures the job per second and
                # must not hide the iteration measure from the next iteration capture
                wall, _ = c.start(CaptureRequest(job_id=JOB, duration_ms=500, activities=("cpu_op",)))
                assert "conservative: no wall-clock capture of this job measured yet" in wall.budget.budget.basis
                await c.wait(wall.capture_id)
                assert wall.phase == Phase.CONVERGED and wall.fully_succeeded, wall.to_status(full=True)

                # 2. a few MiB, less than 10 such iterations: fewer are chosen, and the trace fits
                budget_mb = max(2, math.ceil(per_iteration * 4 / MIB))
                assert budget_mb <= 8 and budget_mb * MIB < 10 * per_iteration, (art, first.to_status(full=True))
                second, _ = c.start(CaptureRequest(job_id=JOB, duration_ms=60_000, iterations=10, iteration_roundup=5,
                                                   activities=("cpu_op", "user_annotation"), budget_mb=budget_mb))
                chosen = second.request.iterations
                assert 1 <= chosen < 10, second.budget.changes
                assert f"iterations 10 -> {chosen}" in second.budget.changes[0]
                assert f"measured by capture {first.capture_id}" in second.budget.budget.basis
                assert "largest of 2 measured captures" in second.budget.budget.basis
                await c.wait(second.capture_id)
                assert second.phase == Phase.CONVERGED and second.fully_succeeded, second.to_status(full=True)
                # and the next wall-clock request is priced from the wall capture, two captures back
                again, _ = c.start(CaptureRequest(job_id=JOB, duration_ms=500, activities=("cpu_op",)))
                assert f"per second measured by capture {wall.capture_id}" in again.budget.budget.basis
                await c.wait(again.capture_id)
            finally:
                await c.close()
    finally:
        await running.stop()
    m = manifest(second)
    art = m.artifacts[0]
    trace = archived_trace(second.targets["rank-0"])       # checksum of the stored gzip checked there
    steps = [e for e in trace["traceEvents"] if str(e.get("name", "")).startswith("Optimizer.step#")]
    assert len(steps) == chosen == art.iterations["optimizer_steps"]
    assert art.uri.endswith("/traces/rank-0.json.gz") and art.sizes["encoding"] == "gzip"
    assert art.sizes["budget"] == budget_mb * MIB and art.sizes["stopped_early"] is None
    assert art.sizes["uncompressed"] <= art.sizes["budget"], (art.sizes, chosen)
    assert art.sizes["stored"] == art.size < art.sizes["uncompressed"] // 4
    assert m.request["iterations"] == chosen and m.request["budget"]["changes"]
