"""`gpulens capture ...` as a person runs it (a real subprocess), against a real coordinator and
gateway (in this process) with agent doubles: exit codes 0 / 3 / 4, what it prints, status,
list, cancel and watch."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from gpulens.capture.coordinator import make_app
from gpulens.capture.wire.auth import Credentials, SecretFile
from tests.coordinator.agent_double import AgentDouble, RunningAgent
from tests.coordinator.conftest import AGENT_TOKEN, make_coordinator, write_job
from tests.coordinator.servers import REPO, serving

TOKEN = "coordinator-token"


async def cli(*args: str, token: str | None = TOKEN, url: str | None = None, timeout: float = 120) -> tuple[int, str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("GPULENS_TOKEN", "GPULENS_URL")}
    if token is not None:
        env["GPULENS_TOKEN"] = token
    if url:
        env["GPULENS_URL"] = url
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gpulens.cli", "capture", *args, cwd=REPO, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    return proc.returncode, out.decode(), err.decode()


@pytest.fixture
async def coordinator(tmp_path, http_session):
    """ml/train: pod train-0 on node-a (ranks 0, 1) and train-1 on node-b (ranks 2, 3)."""
    write_job(tmp_path / "registry", pods={"train-0": ("node-a", 0), "train-1": ("node-b", 2)}, local_world_size=2)
    a, b = AgentDouble("node-a", AGENT_TOKEN), AgentDouble("node-b", AGENT_TOKEN)
    async with RunningAgent(a) as ra, RunningAgent(b) as rb:
        c = make_coordinator(tmp_path, http_session, {"node-a": ra.url, "node-b": rb.url})
        (tmp_path / "c.token").write_text(TOKEN)
        async with serving(make_app(c, Credentials(tokens=(SecretFile(tmp_path / "c.token"),)), heartbeat_s=0.2)) as url:
            yield url, c, a, b
        await c.close()


@pytest.fixture
async def http_session():
    import aiohttp
    async with aiohttp.ClientSession() as s:
        yield s


async def test_start_wait_exits_0_when_every_rank_is_archived(coordinator):
    url, c, _, _ = coordinator
    code, out, err = await cli("start", "--job", "train", "--duration-ms", "200", "--wait", "--url", url)
    assert code == 0, err
    cid, manifest = out.split()
    assert cid in c.captures and manifest == c.captures[cid].manifest_uri
    assert "all 4 ranks archived" in err


async def test_start_iterations_reaches_every_agent_with_one_roundup(coordinator):
    url, c, a, b = coordinator
    code, out, err = await cli("start", "--job", "train", "--iterations", "5", "--iteration-roundup", "50",
                               "--wait", "--url", url)
    assert code == 0, err
    cid = out.split()[0]
    assert (c.captures[cid].request.iterations, c.captures[cid].request.duration_ms) == (5, 30_000)
    sent = [e.dispatch for d in (a, b) for e in d.captures[cid].values()]
    assert len(sent) == 4 and {(d.iterations, d.iteration_roundup) for d in sent} == {(5, 50)}
    code, out, err = await cli("start", "--job", "train", "--iterations", "0", "--url", url)
    assert code == 2 and "iterations" in err                      # bad usage: refused by the request schema


async def test_start_wait_exits_3_when_converged_with_failures_and_says_which_ranks(coordinator):
    url, c, a, b = coordinator
    b.outcome = lambda d, t: ("fail", "process_gone", "the worker exited") if t == "rank-3" else None
    code, out, err = await cli("start", "--job", "train", "--duration-ms", "200", "--wait", "--url", url)
    assert code == 3, err
    cid, manifest = out.split()
    assert "3/4 ranks archived" in err and "missing ranks [3]" in err
    code, out, err = await cli("status", cid, "--url", url)
    assert code == 0 and "rank-3" in out and "failed(process_gone)" in out and "the worker exited" in out


async def test_start_exits_4_when_the_capture_cannot_run(coordinator, tmp_path):
    url, c, _, _ = coordinator
    for f in (tmp_path / "registry").glob("*.json"):
        f.unlink()                                                  # nobody registered: nothing to capture
    code, out, err = await cli("start", "--job", "train", "--duration-ms", "200", "--wait", "--url", url)
    assert code == 4 and "could not run" in err and "no registration records" in err
    assert len(out.split()) == 1                                    # the capture id, and no manifest


async def test_refusals_and_unreachable_servers_exit_4_with_a_reason(coordinator):
    """Straight to a coordinator (no gateway); the full table of mistakes is test_mistakes.py."""
    url, c, _, _ = coordinator
    code, out, err = await cli("start", "--job", "train", "--wait", token="wrong", url=url)
    assert code == 4 and "refused the token" in err and "HTTP" not in err, err
    code, out, err = await cli("start", "--job", "other", url=url)
    assert code == 2 and "serves job 'train'" in err and "--job" in err, err
    code, out, err = await cli("status", "c-20260101t000000-deadbeef", url=url)
    assert code == 4 and "unknown capture" in err, err
    assert c.captures == {}


async def test_list_cancel_and_json(coordinator):
    url, c, a, b = coordinator
    a.outcome = b.outcome = lambda d, t: "hang"   # a long window: still running when cancel comes, even under load
    code, out, _ = await cli("start", "--job", "train", "--duration-ms", "60000", url=url)
    cid = out.strip()
    code, out, _ = await cli("list", "--url", url)
    assert code == 0 and cid in out and "ml/train" in out
    code, out, _ = await cli("cancel", cid, "--url", url)
    assert code == 0 and "cancel requested" in out
    await c.wait(cid)
    code, out, _ = await cli("status", cid, "--json", "--url", url)
    import json
    status = json.loads(out)
    assert status["cancelled"] is True and status["phase"] == "converged"


async def test_watch_prints_per_target_progress_and_exits_with_the_verdict(coordinator):
    url, c, a, b = coordinator
    b.step_s = 0.3
    code, out, _ = await cli("start", "--job", "train", "--duration-ms", "200", url=url)
    cid = out.strip()
    code, out, err = await cli("watch", cid, url=url)
    assert code == 0, err
    for rank in range(4):
        assert f"rank-{rank}" in out
    # the live event line, or the snapshot's table when the capture converged before watch attached (load)
    import re
    assert "archived" in out and re.search(r"phase\s+converged", out), out


from tests.gateway.conftest import GATEWAY_TOKEN, http, stack  # noqa: E402,F401  (fixtures)


async def test_through_the_gateway_with_a_namespace_and_watch(stack):
    code, out, err = await cli("start", "--namespace", "ml", "--job", "train", "--duration-ms", "200", "--wait",
                               url=stack.url, token=GATEWAY_TOKEN)
    assert code == 0, err
    cid, manifest = out.split()
    assert stack.gateway.ledger.captures[cid].namespace == "ml"
    code, out, err = await cli("watch", cid, url=stack.url, token=GATEWAY_TOKEN)
    assert code == 0 and "rank-1" in out
    code, out, err = await cli("start", "--job", "train", url=stack.url, token=GATEWAY_TOKEN)
    assert code == 2 and "--namespace" in err                      # bad usage: the flag, not a query string
