"""The coordinator's HTTP API: auth, validation that names the field, conflicts, the event
stream, cancel, and `unknown` (never 500) for ids it did not start, also across a restart."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from gpulens.capture.coordinator import make_app
from gpulens.capture.wire.auth import Credentials, SecretFile

from .agent_double import AgentDouble, RunningAgent
from .conftest import AGENT_TOKEN, make_coordinator, write_job
from .servers import GpulensProcess, serving

TOKEN = "coordinator-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def token_file(tmp_path):
    p = tmp_path / "coordinator.token"
    p.write_text(TOKEN)
    return p


@pytest.fixture
async def api(tmp_path, http, token_file):
    """A coordinator for job ml/train attempt 0 with one agent double, served on loopback."""
    write_job(tmp_path / "registry", pods={"train-0": ("node-a", 0)}, local_world_size=2)
    double = AgentDouble("node-a", AGENT_TOKEN, step_s=0.1)
    async with RunningAgent(double) as agent:
        c = make_coordinator(tmp_path, http, {"node-a": agent.url})
        async with serving(make_app(c, Credentials(tokens=(SecretFile(token_file),)), heartbeat_s=0.2)) as url:
            yield url, c, double
        await c.close()


async def post(http, url, body, headers=AUTH, **params):
    async with http.post(url + "/v1/captures", json=body, headers=headers, params=params or None) as r:
        return r.status, await r.json()


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer nope"}, {"Authorization": f"Basic {TOKEN}"},
                                     {"Authorization": "Bearer"}, {"Authorization": f"Bearer {TOKEN}x"}])
async def test_every_endpoint_but_healthz_needs_the_token(api, http, headers):
    url, c, _ = api
    for method, path in [("POST", "/v1/captures"), ("GET", "/v1/captures"), ("GET", "/v1/captures/c-x"),
                         ("GET", "/v1/captures/c-x/events"), ("POST", "/v1/captures/c-x/cancel")]:
        async with http.request(method, url + path, headers=headers, json={"job_id": "train", "duration_ms": 500}) as r:
            assert r.status == 401, (method, path)
    assert c.captures == {}
    async with http.get(url + "/healthz") as r:
        assert r.status == 200


@pytest.mark.parametrize("body,field", [
    ({"duration_ms": 500}, "job_id"),
    ({"job_id": "train", "duration_ms": 50}, "duration_ms"),
    ({"job_id": "train", "duration_ms": 500, "activities": ["cpu_op", "cuda_sync"]}, "activities[1]"),
    ({"job_id": "train", "duration_ms": 500, "surprise": 1}, "surprise"),
    ({"job_id": "train", "duration_ms": 500, "options": {"record_shapes": "yes"}}, "options.record_shapes"),
    ([1, 2], ""),
    ({"job_id": "train", "duration_ms": 500, "capture_id": "c-20261201-abcdef\n"}, "capture_id"),  # $ vs \Z
    ({"job_id": "train\n", "duration_ms": 500}, "job_id"),
    ({"job_id": "train", "duration_ms": 500, "kind": "stacks"}, "kind"),                 # issue 45: trace | hang
    ({"job_id": "train", "duration_ms": 500, "kind": "hang", "iterations": 10}, "kind"),  # a hang has no steps
])
async def test_bad_requests_are_400_naming_the_field_and_start_nothing(api, http, body, field):
    url, c, double = api
    status, answer = await post(http, url, body)
    assert status == 400 and answer["field"] == field
    assert c.captures == {} and double.dispatches == []


async def test_not_json_is_400(api, http):
    url, c, _ = api
    async with http.post(url + "/v1/captures", data=b"{nope", headers=AUTH) as r:
        assert r.status == 400 and "JSON" in (await r.json())["error"]


async def test_another_job_namespace_or_attempt_is_refused(api, http):
    url, c, _ = api
    assert (await post(http, url, {"job_id": "other", "duration_ms": 500}))[0] == 400
    status, answer = await post(http, url, {"job_id": "train", "duration_ms": 500}, namespace="prod")
    assert status == 400 and answer["field"] == "namespace"
    status, answer = await post(http, url, {"job_id": "train", "duration_ms": 500, "attempt": 3})
    assert status == 409 and answer["field"] == "attempt"
    assert c.captures == {}


async def test_start_stream_and_converge(api, http):
    url, c, _ = api
    status, answer = await post(http, url, {"job_id": "train", "duration_ms": 200}, namespace="ml")
    assert status == 202
    cid = answer["capture_id"]
    events = []
    async with http.get(url + f"/v1/captures/{cid}/events", headers=AUTH) as r:
        assert r.headers["Content-Type"].startswith("application/x-ndjson")
        async for line in r.content:
            events.append(json.loads(line))
    kinds = [e["event"] for e in events]
    assert kinds[0] == "snapshot" and kinds[-1] == "end"
    assert events[-1]["status"]["phase"] == "converged" and events[-1]["status"]["fully_succeeded"] is True
    states = [(e["target_id"], e["state"]) for e in events if e["event"] == "target"]
    assert ("rank-0", "archived") in states and ("rank-1", "archived") in states
    async with http.get(url + f"/v1/captures/{cid}", headers=AUTH) as r:
        full = await r.json()
    assert full["manifest_uri"].endswith(f"/ml/train/0/{cid}/manifest.json")
    assert [t["state"] for t in full["targets"]] == ["archived", "archived"]
    async with http.get(url + "/v1/captures", headers=AUTH) as r:
        listing = await r.json()
    assert [x["capture_id"] for x in listing["captures"]] == [cid] and "targets" not in listing["captures"][0]


async def test_one_capture_at_a_time_and_a_repeated_id_is_the_same_capture(api, http):
    url, c, double = api
    body = {"job_id": "train", "duration_ms": 200, "capture_id": "c-20260101t000000-0000abcd"}
    assert (await post(http, url, body))[0] == 202
    status, again = await post(http, url, body)
    assert status == 200 and again["capture_id"] == body["capture_id"] and again["created"] is False
    status, busy = await post(http, url, {"job_id": "train", "duration_ms": 200})
    assert status == 409 and busy["error"] == "capture_in_progress" and busy["capture_id"] == body["capture_id"]
    await c.wait(body["capture_id"])
    assert len(c.captures) == 1
    assert sorted(t for _, t in double.dispatches).count("rank-0") == 1


async def test_cancel_and_unknown_ids(api, http):
    url, c, double = api
    double.outcome = lambda d, t: "hang"
    _, answer = await post(http, url, {"job_id": "train", "duration_ms": 200})
    cid = answer["capture_id"]
    async with http.post(url + f"/v1/captures/{cid}/cancel", headers=AUTH) as r:
        assert r.status == 200 and (await r.json())["cancelled"] is True
    await c.wait(cid)
    for method, path in [("GET", "/v1/captures/c-unknown-1234"), ("GET", "/v1/captures/c-unknown-1234/events"),
                         ("POST", "/v1/captures/c-unknown-1234/cancel"), ("GET", "/v1/captures/%2e%2e%2fetc")]:
        async with http.request(method, url + path, headers=AUTH) as r:
            assert r.status == 404 and (await r.json())["phase"] == "unknown", path


def _process_args(tmp_path, port, agent_url, token_file, agent_token, *extra: str) -> list[str]:
    """`gpulens coordinator` for a real process over the local registry and one agent double."""
    return ["coordinator", "--listen", f"127.0.0.1:{port}", "--job", "train", "--attempt", "0",
            "--namespace", "ml", "--discovery", "local", "--registry-dir", str(tmp_path / "registry"),
            "--agent-url", agent_url, "--archive-root", f"file://{tmp_path / 'archive'}",
            "--token-file", str(token_file), "--agent-token-file", str(agent_token),
            "--start-delay-s", "0.5", "--archive-margin-s", "1", "--report-margin-s", "1",
            "--poll-interval-s", "0.1", *extra]


async def _capture_until_done(http, url: str, timeout: float = 60) -> tuple[str, dict]:
    """Start a 200 ms capture and poll its status until it is converged or failed (failing with
    its last status, not the suite's timeout, if it is neither within `timeout`)."""
    _, answer = await post(http, url, {"job_id": "train", "duration_ms": 200})
    cid = answer["capture_id"]
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        async with http.get(url + f"/v1/captures/{cid}", headers=AUTH) as r:
            body = await r.json()
        if body["phase"] in ("converged", "failed"):
            return cid, body
        assert asyncio.get_running_loop().time() < deadline, f"capture {cid} not done after {timeout}s: {body}"
        await asyncio.sleep(0.1)


async def test_a_restarted_coordinator_answers_its_finished_captures_from_the_archive(tmp_path, token_file):
    """A real process restart: what it ran before comes back from the archive (marked), not `unknown`;
    an id it never started stays unknown. Details of the archived answer: test_archived.py."""
    write_job(tmp_path / "registry", pods={"train-0": ("node-a", 0)}, local_world_size=2)
    agent_token = tmp_path / "agent.token"
    agent_token.write_text(AGENT_TOKEN)
    from tests.conftest import free_port
    port = free_port()
    async with RunningAgent(AgentDouble("node-a", AGENT_TOKEN)) as agent:
        args = _process_args(tmp_path, port, agent.url, token_file, agent_token, "--state-dir", str(tmp_path / "state"))
        url = f"http://127.0.0.1:{port}"
        first = await GpulensProcess(args, tmp_path / "c1.log").start()
        try:
            await first.wait_ready(url)
            async with aiohttp.ClientSession() as http:
                cid, done = await _capture_until_done(http, url)
                assert done["phase"] == "converged", done
        finally:
            assert await first.stop() == 0
        second = await GpulensProcess(args, tmp_path / "c2.log").start()
        try:
            await second.wait_ready(url)
            async with aiohttp.ClientSession() as http:
                async with http.get(url + f"/v1/captures/{cid}", headers=AUTH) as r:
                    body = await r.json()
                    assert r.status == 200 and body["from_archive"] is True and body["phase"] == "converged", body
                async with http.get(url + "/v1/captures/c-20260101t000000-deadbeef", headers=AUTH) as r:
                    assert r.status == 404 and (await r.json())["phase"] == "unknown"
                async with http.get(url + "/v1/captures", headers=AUTH) as r:
                    assert [(c["capture_id"], c["from_archive"]) for c in (await r.json())["captures"]] == [(cid, True)]
        finally:
            await second.stop()
    # what the first process kept lists it after the restart
    assert (tmp_path / "state" / "captures" / f"{cid}.json").exists()
    assert "event=coordinator.ready" in (tmp_path / "c2.log").read_text()


async def test_a_coordinator_whose_grafana_token_is_missing_still_starts_and_captures(tmp_path, token_file):
    """The operator mounts the chart's tokens Secret; before a user adds its `grafana` key the file
    is absent. That must cost annotations only (said once at start), never the job's captures."""
    write_job(tmp_path / "registry", pods={"train-0": ("node-a", 0)}, local_world_size=1)
    agent_token = tmp_path / "agent.token"
    agent_token.write_text(AGENT_TOKEN)
    from tests.conftest import free_port
    port = free_port()
    async with RunningAgent(AgentDouble("node-a", AGENT_TOKEN)) as agent:
        args = _process_args(tmp_path, port, agent.url, token_file, agent_token, "--grafana-url", "http://127.0.0.1:1",
                             "--grafana-token-file", str(tmp_path / "tokens" / "grafana"))
        url = f"http://127.0.0.1:{port}"
        proc = await GpulensProcess(args, tmp_path / "c.log").start()
        try:
            await proc.wait_ready(url)
            async with aiohttp.ClientSession() as http:
                _, body = await _capture_until_done(http, url)
        finally:
            assert await proc.stop() == 0
    assert body["phase"] == "converged" and body["fully_succeeded"], body
    log = (tmp_path / "c.log").read_text()
    assert log.count("event=annotations.token_missing") == 1, log[-2000:]
