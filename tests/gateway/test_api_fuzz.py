"""Property-based fuzzing of the gateway's and the coordinator's HTTP APIs (both real, in process,
real HTTP on loopback, behind them an agent double): whatever the body, query or path id, no 5xx,
every refusal a JSON body, and both keep serving. Bounded (tests/fuzzing.FUZZ)."""

from __future__ import annotations

import aiohttp
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzzing import FUZZ, assert_no_server_error, bodies, json_values, nested, segments

from .conftest import BEARER, COORDINATOR_TOKEN, alert, payload

CAUTH = {"Authorization": f"Bearer {COORDINATOR_TOKEN}"}
REQUEST = {"job_id": "train", "duration_ms": 200, "activities": ["cpu_op"], "reason": {"kind": "manual"}}
WEBHOOK = payload(alert())
queries = st.dictionaries(st.sampled_from(["namespace", "pod", "job_id"]), st.text(max_size=20), max_size=3)


async def test_deep_nesting_is_400_naming_the_limit_on_every_body(stack):
    async with aiohttp.ClientSession() as s:
        for url, headers in ((stack.url + "/v1/alertmanager", BEARER), (stack.url + "/v1/captures", BEARER),
                             (stack.coordinator_url + "/v1/captures", CAUTH),
                             (stack.coordinator_url + "/v1/captures/c-x00000001/alert-resolved", CAUTH)):
            for kind in ("array", "object"):
                async with s.post(url, data=nested(1000, kind), headers=headers) as r:
                    body = await r.json()
                    assert r.status == 400 and body["limit"] == "max_depth", (url, body)
    assert not stack.coordinator.captures and not stack.gateway.ledger.captures  # nothing started


@FUZZ
@given(body=bodies(WEBHOOK) | bodies(REQUEST), query=queries, capture_id=segments)
async def test_gateway_never_answers_5xx_to_bad_input(stack, body, query, capture_id):
    async with aiohttp.ClientSession(headers=BEARER) as s:
        for method, path, data in (("POST", "/v1/alertmanager", body), ("POST", "/v1/captures", body),
                                   ("GET", f"/v1/captures/{capture_id}", None),
                                   ("POST", f"/v1/captures/{capture_id}/cancel", body)):
            async with s.request(method, stack.url + path, data=data, params=query) as r:
                assert_no_server_error(r.status, await r.read(), f"{method} {path}")
        async with s.get(stack.url + "/healthz") as r:
            assert r.status == 200


@FUZZ
@given(body=bodies(REQUEST), query=queries, capture_id=segments, ends_at=json_values)
async def test_coordinator_never_answers_5xx_to_bad_input(stack, body, query, capture_id, ends_at):
    url = stack.coordinator_url
    async with aiohttp.ClientSession(headers=CAUTH) as s:
        for method, path, kw in (("POST", "/v1/captures", {"data": body}),
                                 ("POST", f"/v1/captures/{capture_id}/alert-resolved", {"json": {"ends_at": ends_at}}),
                                 ("POST", f"/v1/captures/{capture_id}/alert-resolved", {"data": body}),
                                 ("GET", f"/v1/captures/{capture_id}", {}),
                                 ("POST", f"/v1/captures/{capture_id}/cancel", {})):
            async with s.request(method, url + path, params=query, **kw) as r:
                assert_no_server_error(r.status, await r.read(), f"{method} {path}")
        async with s.get(url + "/healthz") as r:
            assert r.status == 200
