"""Property-based fuzzing of the agent's HTTP API (real agent, real HTTP on loopback): whatever the
body or the path ids, the answer is never a 5xx, a refusal is a JSON body, nothing is created by a
refused request, and the agent keeps serving. Bounded (tests/fuzzing.FUZZ) so it takes seconds."""

from __future__ import annotations

import time

import aiohttp
from hypothesis import given

from tests.agent.test_agent import TOKEN, agent, node  # noqa: F401 - fixtures
from tests.fuzzing import FUZZ, assert_no_server_error, bodies, nested, segments

AUTH = {"Authorization": f"Bearer {TOKEN}"}
VALID = {"job_id": "train", "attempt": 0, "rank": 0, "duration_ms": 300, "activities": ["cpu_op"],
         "deadline": time.time() + 3600, "archive_prefix": "file:///nowhere/ns/train/0/c-fuzz00000001"}


async def test_deep_nesting_is_400_naming_the_limit(agent):
    async with aiohttp.ClientSession(headers=AUTH) as s:
        for kind in ("array", "object"):
            async with s.put(agent.url + "/v1/captures/c-deep00000001/targets/rank-0", data=nested(1000, kind)) as r:
                body = await r.json()
                assert r.status == 400 and body["limit"] == "max_depth" and "max_depth=64" in body["error"], body
        async with s.get(agent.url + "/v1/captures/c-deep00000001") as r:
            assert r.status == 404  # nothing was created


@FUZZ
@given(body=bodies(VALID), capture_id=segments, target_id=segments)
async def test_no_body_or_path_makes_a_server_error(agent, body, capture_id, target_id):
    async with aiohttp.ClientSession(headers=AUTH) as s:
        for method, path, data in (("PUT", f"/v1/captures/{capture_id}/targets/{target_id}", body),
                                   ("PUT", f"/v1/captures/c-fuzz00000001/targets/rank-0", body),
                                   ("GET", f"/v1/captures/{capture_id}", None),
                                   ("POST", f"/v1/captures/{capture_id}/cancel", body)):
            async with s.request(method, agent.url + path, data=data) as r:
                assert_no_server_error(r.status, await r.read(), f"{method} {path}")
        async with s.get(agent.url + "/healthz") as r:
            assert r.status == 200
