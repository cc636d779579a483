"""/metrics of a real agent and a real coordinator after a real capture (in-process servers, real
HTTP, the agent's IPC endpoint answering a Kineto stand-in, real trace files and archive): every
counter moved by exactly what the capture did, read with prometheus_client's own text parser.
/metrics is open (no token), the API beside it is not."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import aiohttp
import pytest
from yarl import URL
from prometheus_client.parser import text_string_to_metric_families

from gpulens.capture.agent.client import AgentClient
from gpulens.capture.agent.runtime import start_agent
from gpulens.capture.coordinator import DeadlinePolicy, FanoutSettings, make_app
from gpulens.capture.wire.auth import Credentials, SecretFile
from gpulens.capture.models import CaptureRequest
from tests.agent.test_agent import TOKEN as AGENT_TOKEN
from tests.agent.test_agent import Node

from .conftest import FAST_FANOUT, make_coordinator
from .servers import serving

COORDINATOR_TOKEN = "coordinator-token"
#: long enough for the stand-in's trace (poll 0.1 s + 0.2 s + window) to be verified and archived
POLICY = DeadlinePolicy(start_delay_s=1.0, dispatch_s=1.0, write_s=1.0, write_per_window=0.0, archive_s=30.0,
                        report_s=2.0)


@pytest.fixture
def node(tmp_path):
    sock = tempfile.mkdtemp(prefix="gl-", dir="/tmp")  # sun_path holds 108 bytes
    os.chmod(sock, 0o777)
    (tmp_path / "node").mkdir()
    n = Node(tmp_path / "node", sock)
    yield n
    n.close()
    shutil.rmtree(sock, ignore_errors=True)


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, parsed by prometheus_client; no token sent."""
    async with session.get(url + "/metrics") as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = await resp.text()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def delta(after: dict, before: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    assert key in after, f"{name}{labels} not exported"
    return after[key] - before.get(key, 0.0)


async def test_a_capture_moves_the_agent_and_coordinator_counters_by_exactly_what_happened(tmp_path, node, http):
    node.worker(0)                                   # traced, verified, archived
    gone = node.worker(1, kineto=None)               # registered, then exits: process_gone
    gone.kill()
    gone.wait()
    running = await start_agent(node.options())
    (tmp_path / "agent.token").write_text(AGENT_TOKEN)
    (tmp_path / "c.token").write_text(COORDINATOR_TOKEN)
    try:
        # a real agent: the wall capture's start must leave it the 12 s Kineto needs (issue 47)
        fanout = FanoutSettings(**{**FAST_FANOUT.__dict__, "wall_start_lead_s": FanoutSettings().wall_start_lead_s})
        c = make_coordinator(tmp_path, http, {"node-1": running.url}, registry=node.base / "reg", namespace="ns",
                             policy=POLICY, archive_root=node.archive_root, fanout=fanout)
        async with serving(make_app(c, Credentials(tokens=(SecretFile(tmp_path / "c.token"),)))) as url:
            a0, c0 = await scrape(http, running.url), await scrape(http, url)
            # open /metrics, closed API: no token is 401 on both servers' other routes
            async with http.get(url + "/v1/captures") as resp:
                assert resp.status == 401
            for base in (url, running.url):  # only the exact path is open; a dot-segment walk is not
                for path in ("/metrics/../v1/captures/c-x-00000001", "/metrics/%2e%2e/v1/captures/c-x-00000001",
                             "/metrics/x", "/metricsx"):
                    async with http.get(URL(base + path, encoded=True)) as resp:
                        assert resp.status in (401, 404) and resp.status != 200, path
                        if resp.status == 404:  # routed nowhere: still never the capture's status
                            assert "c-x-00000001" not in await resp.text() or "unknown" in await resp.text()
            async with http.get(running.url + "/v1/workers") as resp:
                assert resp.status == 401
            rec, _ = c.start(CaptureRequest(job_id="train", duration_ms=300))
            await c.wait(rec.capture_id)
            a1, c1 = await scrape(http, running.url), await scrape(http, url)
            async with AgentClient(running.url, AGENT_TOKEN) as client:
                statuses = {s.target_id: s for s in await client.status(rec.capture_id)}
    finally:
        await running.stop()
    assert rec.phase == "converged" and rec.targets["rank-0"].state.value == "archived", [(t["state"], t["reason"], t["detail"]) for t in rec.to_status()["targets"]]
    assert rec.targets["rank-1"].reason.value == "process_gone"
    artifact = statuses["rank-0"].artifact

    # coordinator: one partial capture, one archived and one process_gone target, one convergence
    assert delta(c1, c0, "gpulens_coordinator_captures_total", outcome="partial", reason="") == 1
    assert delta(c1, c0, "gpulens_coordinator_captures_total", outcome="succeeded", reason="") == 0
    assert delta(c1, c0, "gpulens_coordinator_captures_total", outcome="failed", reason="discovery_failed") == 0
    assert delta(c1, c0, "gpulens_coordinator_targets_total", outcome="archived", reason="") == 1
    assert delta(c1, c0, "gpulens_coordinator_targets_total", outcome="failed", reason="process_gone") == 1
    assert delta(c1, c0, "gpulens_coordinator_targets_total", outcome="failed", reason="trace_timeout") == 0
    assert delta(c1, c0, "gpulens_coordinator_convergence_seconds_count") == 1
    took = rec.converged_at - rec.requested_at
    assert delta(c1, c0, "gpulens_coordinator_convergence_seconds_sum") == pytest.approx(took)

    # agent: the same two targets, the bytes it verified, one observation, no retries, no dynolog
    assert delta(a1, a0, "gpulens_agent_targets_total", outcome="archived", reason="") == 1
    assert delta(a1, a0, "gpulens_agent_targets_total", outcome="failed", reason="process_gone") == 1
    assert sum(v for (n, labels), v in a1.items() if n == "gpulens_agent_targets_total") == 2
    assert delta(a1, a0, "gpulens_agent_verified_bytes_total") == artifact.sizes["uncompressed"] > artifact.size  # raw read, gzip stored
    assert delta(a1, a0, "gpulens_agent_verification_seconds_total") > 0
    assert delta(a1, a0, "gpulens_agent_observation_delay_seconds_count") == 1
    assert delta(a1, a0, "gpulens_agent_archive_retries_total") == 0
    assert not any(n.startswith("gpulens_agent_dynolog_rpc_duration_seconds_count") for n, _ in a1), \
        "the builtin endpoint is not dynolog: no RPC series"
