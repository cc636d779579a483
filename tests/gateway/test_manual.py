"""Manual requests through the gateway (a person or a script), and the capture API it relays
from whichever coordinator holds a capture."""

from __future__ import annotations

import json

from .conftest import BEARER, COORDINATOR_TOKEN, gateway_for


async def start(http, url, body, headers=BEARER, **params):
    async with http.post(url + "/v1/captures", json=body, headers=headers, params=params or None) as r:
        return r.status, await r.json()


async def test_a_manual_request_is_routed_by_namespace_and_job_and_followed_through_the_gateway(stack, http):
    status, body = await start(http, stack.url, {"job_id": "train", "duration_ms": 200, "requested_by": "alice"},
                               namespace="ml")
    assert status == 202 and body["job"] == "ml/train"
    cid = body["capture_id"]
    events = []
    async with http.get(stack.url + f"/v1/captures/{cid}/events", headers=BEARER) as r:
        assert r.status == 200
        async for line in r.content:
            events.append(json.loads(line))
    assert events[0]["event"] == "snapshot" and events[-1]["event"] == "end"
    async with http.get(stack.url + f"/v1/captures/{cid}", headers=BEARER) as r:
        status_body = await r.json()
    assert status_body["phase"] == "converged" and status_body["requested_by"] == "alice"
    async with http.get(stack.url + "/v1/captures", headers=BEARER) as r:
        listing = await r.json()
    assert [c["capture_id"] for c in listing["captures"]] == [cid] and listing["errors"] == []
    async with http.get(stack.url + "/v1/captures", headers=BEARER, params={"namespace": "ml", "job_id": "train"}) as r:
        assert [c["capture_id"] for c in (await r.json())["captures"]] == [cid]
    async with http.post(stack.url + f"/v1/captures/{cid}/cancel", headers=BEARER) as r:
        assert r.status == 200   # a finished capture: a no-op, still answered


async def test_manual_requests_bypass_the_alert_cooldown_but_count_for_it(stack, http):
    await start(http, stack.url, {"job_id": "train", "duration_ms": 200}, namespace="ml")
    assert "ml/train" in stack.gateway.ledger.last_start


async def test_bad_manual_requests_are_refused_with_the_field(stack, http):
    cases = [
        (({"job_id": "train", "duration_ms": 200}, {}), 400, "namespace"),
        (({"job_id": "nope", "duration_ms": 200}, {"namespace": "ml"}), 404, "job_id"),
        (({"job_id": "train", "duration_ms": 5}, {"namespace": "ml"}), 400, "duration_ms"),
        (({"job_id": "train", "activities": ["gpu_kernel"]}, {"namespace": "ml"}), 400, "activities[0]"),
        (([], {"namespace": "ml"}), 400, ""),
    ]
    for (body, params), code, field in cases:
        status, answer = await start(http, stack.url, body, **params)
        assert (status, answer.get("field")) == (code, field), (body, answer)
    assert stack.coordinator.captures == {}
    async with http.post(stack.url + "/v1/captures", data=b"not json", headers=BEARER, params={"namespace": "ml"}) as r:
        assert r.status == 400


async def test_the_coordinators_own_refusals_are_relayed(stack, http):
    stack.agent.outcome = lambda d, t: "hang"
    status, first = await start(http, stack.url, {"job_id": "train", "duration_ms": 200}, namespace="ml")
    status, busy = await start(http, stack.url, {"job_id": "train", "duration_ms": 200}, namespace="ml")
    assert status == 409 and busy["capture_id"] == first["capture_id"]
    status, wrong = await start(http, stack.url, {"job_id": "train", "duration_ms": 200, "attempt": 7}, namespace="ml")
    assert status == 409 and wrong["field"] == "attempt"


async def test_unknown_ids_and_an_unreachable_coordinator(stack, http, tmp_path):
    for path in ("/v1/captures/c-none", "/v1/captures/c-none/events"):
        async with http.get(stack.url + path, headers=BEARER) as r:
            assert r.status == 404 and (await r.json())["phase"] == "unknown"
    async with http.post(stack.url + "/v1/captures/c-none/cancel", headers=BEARER) as r:
        assert r.status == 404
    gw, serve = await gateway_for(tmp_path / "gw", http, {"ml/train": "http://127.0.0.1:9"})
    async with serve as url:
        status, body = await start(http, url, {"job_id": "train", "duration_ms": 200}, namespace="ml")
        assert status == 503 and "unavailable" in body["error"]
        assert gw.ledger.captures == {}


async def test_a_capture_started_at_the_coordinator_is_found_through_the_routes(stack, http):
    async with http.post(stack.coordinator_url + "/v1/captures", json={"job_id": "train", "duration_ms": 200},
                         headers={"Authorization": f"Bearer {COORDINATOR_TOKEN}"}) as r:
        cid = (await r.json())["capture_id"]
    async with http.get(stack.url + f"/v1/captures/{cid}", headers=BEARER) as r:
        assert r.status == 200 and (await r.json())["capture_id"] == cid


def test_the_template_route_names_the_service_as_the_operator_does():
    from gpulens.capture.gateway import Router
    from gpulens.capture.wire.labels import service_name
    r = Router(template="http://{service}.{namespace}.svc:9452")
    assert r.resolve("ml", "train").url == "http://gpulens-train.ml.svc:9452"
    assert r.resolve("ml", "Train_Job.1").url == f"http://{service_name('Train_Job.1')}.ml.svc:9452"
    assert Router(template="http://gpulens-{job}.{namespace}.svc:9452").resolve("ml", "a").url == \
        "http://gpulens-a.ml.svc:9452"
