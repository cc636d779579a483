"""The Alertmanager webhook: auth, payload checks, idempotency per (fingerprint, startsAt), the
per-job cooldown, status codes that match Alertmanager's retry rules, resolved alerts, and a
ledger that survives a gateway restart."""

from __future__ import annotations

import asyncio
import json

import pytest

from gpulens.capture.wire.auth import Credentials, SecretFile
from gpulens.capture.gateway import Gateway, GatewaySettings, Ledger, Router, make_app
from tests.coordinator.servers import serving

from .conftest import BASIC, BEARER, alert, basic_header, gateway_for, payload


async def send(http, url, body, headers=BEARER):
    async with http.post(url + "/v1/alertmanager", json=body, headers=headers) as r:
        return r.status, await r.json()


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, basic_header(BASIC[0], "wrong"),
                                     basic_header("nobody", BASIC[1]), {"Authorization": "Basic !!notbase64"},
                                     {"Authorization": "Digest x"}])
async def test_bad_credentials_are_401_and_start_nothing(stack, http, headers):
    status, _ = await send(http, stack.url, payload(alert()), headers)
    assert status == 401
    assert stack.coordinator.captures == {} and stack.gateway.ledger.alerts == {}


async def test_bearer_and_basic_auth_both_work(stack, http):
    status, body = await send(http, stack.url, payload(alert("f1")), basic_header(*BASIC))
    assert status == 200 and body["results"][0]["outcome"] == "started"


@pytest.mark.parametrize("body,field", [
    ({"version": "3", "alerts": []}, "version"),
    ({"version": "4"}, "alerts"),
    ({"version": "4", "alerts": [{"status": "firing", "labels": {}, "startsAt": "x"}]}, "alerts[0].fingerprint"),
    ({"version": "4", "alerts": [{"status": "maybe", "fingerprint": "f", "startsAt": "x"}]}, "alerts[0].status"),
    ({"version": "4", "alerts": [{"status": "firing", "fingerprint": "f", "startsAt": "x", "labels": {"a": 1}}]},
     "alerts[0].labels"),
    ([], ""),
])
async def test_a_body_that_is_not_a_v4_payload_is_400(stack, http, body, field):
    status, answer = await send(http, stack.url, body)
    assert status == 400 and answer["field"] == field
    assert stack.coordinator.captures == {}


async def test_unknown_fields_are_ignored(stack, http):
    body = payload(alert(), notification_reason="new", routeLabels={"x": "y"})
    body["alerts"][0]["somethingNew"] = {"nested": True}
    status, answer = await send(http, stack.url, body)
    assert status == 200 and answer["results"][0]["outcome"] == "started"


async def test_repeats_and_retries_of_one_episode_start_exactly_one_capture(stack, http):
    a = alert("fp-1")
    outcomes = []
    for _ in range(3):                                  # first send, retry, repeat_interval repeat
        status, body = await send(http, stack.url, payload(a))
        assert status == 200
        outcomes.append(body["results"][0])
    # and two Alertmanager replicas delivering the same notification at once
    both = await asyncio.gather(send(http, stack.url, payload(a)), send(http, stack.url, payload(a)))
    assert [o["outcome"] for o in outcomes] == ["started", "duplicate", "duplicate"]
    assert {r[1]["results"][0]["outcome"] for r in both} == {"duplicate"}
    assert len(stack.coordinator.captures) == 1
    (cid,) = stack.coordinator.captures
    assert all(o["capture_id"] == cid for o in outcomes)
    rec = stack.coordinator.captures[cid]
    assert rec.request.reason.fingerprint == "fp-1" and rec.request.reason.diagnosis == "host_sync"
    assert rec.request.reason.workload == "ml/train-0"                       # the report leads with it
    assert rec.request.requested_by == "alertmanager"
    assert "kernel" in rec.request.activities and "cpu_op" in rec.request.activities   # the GPU timeline too


async def test_a_new_episode_of_the_same_alert_waits_out_the_cooldown(stack, http):
    await send(http, stack.url, payload(alert("fp-1", starts_at="2026-11-29T06:00:00Z")))
    status, body = await send(http, stack.url, payload(alert("fp-1", starts_at="2026-11-29T07:00:00Z"),
                                                       alert("fp-2", pod="train-1")))
    assert status == 200
    assert [r["outcome"] for r in body["results"]] == ["cooldown", "cooldown"]
    assert len(stack.coordinator.captures) == 1
    # a cooled-down episode stays handled: its repeats do not start a capture later
    stack.gateway.settings = GatewaySettings(cooldown_s=0, duration_ms=200)
    await stack.coordinator.wait(next(iter(stack.coordinator.captures)))
    status, body = await send(http, stack.url, payload(alert("fp-2", pod="train-1")))
    assert body["results"][0]["outcome"] == "duplicate" and len(stack.coordinator.captures) == 1


async def test_a_stall_right_after_a_traced_slowdown_is_still_captured_and_hangs_cool_down_apart(stack, http):
    """Issue 45: the job's trace cooldown does not hold a hang capture back (the trace said nothing
    of the hang, and a stuck job pays nothing for its evidence); a second stall episode waits out a
    cooldown of its own."""
    await send(http, stack.url, payload(alert("fp-1", starts_at="2026-11-29T06:00:00Z")))
    first = next(iter(stack.coordinator.captures))
    await stack.coordinator.wait(first)
    stalled = dict(auto=False, alertname="GPUWorkloadStalled", diagnosis="stalled", gpulens_capture="hang")
    status, body = await send(http, stack.url, payload(alert("fp-s", starts_at="2026-11-29T06:10:00Z", **stalled)))
    assert status == 200 and body["results"][0]["outcome"] == "started", body
    hang = stack.coordinator.get(body["results"][0]["capture_id"])
    assert hang.request.kind == "hang"
    await stack.coordinator.wait(hang.capture_id)
    if hang.followed_by:
        await stack.coordinator.wait(hang.followed_by)
    status, body = await send(http, stack.url, payload(alert("fp-s", starts_at="2026-11-29T07:10:00Z", **stalled),
                                                       alert("fp-3", starts_at="2026-11-29T07:10:00Z")))
    assert [r["outcome"] for r in body["results"]] == ["cooldown", "cooldown"], body
    assert "#hang got capture " + hang.capture_id in body["results"][0]["detail"], body
    assert "ml/train got capture " + first in body["results"][1]["detail"], body


async def test_alerts_that_ask_for_no_capture_or_cannot_be_routed_are_200_and_start_nothing(stack, http):
    status, body = await send(http, stack.url, payload(alert("a", auto=False), alert("b", job="unknown-job"),
                                                       alert("c", job=None, pod="stranger"),
                                                       alert("d", namespace="other")))
    assert status == 200
    assert [r["outcome"] for r in body["results"]] == ["ignored", "unroutable", "unroutable", "unroutable"]
    assert stack.coordinator.captures == {} and stack.gateway.ledger.alerts == {}


async def test_coordinator_down_is_503_and_the_retry_reuses_the_capture_id(stack, http, tmp_path):
    gw, serve = await gateway_for(tmp_path / "gw2", http, {"ml/train": "http://127.0.0.1:9"})
    async with serve as url:
        status, body = await send(http, url, payload(alert("fp-9")))
        assert status == 503 and body["results"][0]["outcome"] == "coordinator_unavailable"
        cid = body["results"][0]["capture_id"]
        assert gw.ledger.alerts["fp-9|2026-11-29T06:51:52.944761722Z"].outcome == "forwarding"
        gw.router.static["ml/train"] = stack.coordinator_url       # the coordinator is back
        status, body = await send(http, url, payload(alert("fp-9")))
        assert status == 200 and body["results"][0] == {"fingerprint": "fp-9", "starts_at": "2026-11-29T06:51:52.944761722Z",
                                                        "outcome": "started", "capture_id": cid,
                                                        "retryable": False}
    assert list(stack.coordinator.captures) == [cid]


async def test_a_busy_coordinator_is_reported_not_retried(stack, http):
    stack.agent.outcome = lambda d, t: "hang"
    await send(http, stack.url, payload(alert("fp-1")))
    stack.gateway.settings = GatewaySettings(cooldown_s=0, duration_ms=200)
    status, body = await send(http, stack.url, payload(alert("fp-2", pod="train-1")))
    (first,) = stack.coordinator.captures
    assert status == 200 and body["results"][0]["outcome"] == "busy" and body["results"][0]["capture_id"] == first
    assert len(stack.coordinator.captures) == 1


async def test_a_resolved_alert_updates_its_capture_once(stack, http):
    await send(http, stack.url, payload(alert("fp-1")))
    (cid,) = stack.coordinator.captures
    resolved = alert("fp-1", status="resolved", ends_at="2026-11-29T07:10:00Z")
    status, body = await send(http, stack.url, payload(resolved))
    assert status == 200 and body["results"][0]["outcome"] == "resolved"
    assert stack.coordinator.captures[cid].alert_resolved_at == "2026-11-29T07:10:00Z"
    status, body = await send(http, stack.url, payload(resolved))
    assert body["results"][0]["outcome"] == "duplicate"
    status, body = await send(http, stack.url, payload(alert("never-fired", status="resolved")))
    assert body["results"][0]["outcome"] == "ignored"


async def test_a_restarted_gateway_still_knows_the_episodes_it_handled(stack, http, tmp_path):
    await send(http, stack.url, payload(alert("fp-1")))
    assert json.loads((tmp_path / "gateway" / "ledger.json").read_text())["alerts"]
    gw, serve = await gateway_for(tmp_path, http, {"ml/train": stack.coordinator_url})   # same state dir
    async with serve as url:
        status, body = await send(http, url, payload(alert("fp-1")))
    assert body["results"][0]["outcome"] == "duplicate" and len(stack.coordinator.captures) == 1


@pytest.mark.parametrize("content", [
    "{broken", "null", "[]", '"ledger"', '{"alerts": []}', '{"alerts": {"k": 5}}', '{"captures": {"c": {"bogus": 1}}}',
    '{"last_start": {"ns/job": "soon"}}', '{"alerts": {"k": {"key": "k", "fingerprint": "f", "starts_at": "s", '
    '"namespace": "n", "job_id": "j", "outcome": "started", "recorded_at": "yesterday"}}}',
])
async def test_an_unreadable_or_wrong_shape_ledger_is_set_aside_not_fatal(tmp_path, content):
    d = tmp_path / "state"
    d.mkdir()
    (d / "ledger.json").write_text(content)
    ledger = Ledger.open(d)  # no AttributeError/TypeError crash loop
    assert ledger.alerts == {} and ledger.captures == {} and ledger.last_start == {}
    moved = [p for p in d.iterdir() if p.name.startswith("ledger.bad-")]
    assert len(moved) == 1 and moved[0].read_text() == content  # kept for a person, byte for byte
    assert not (d / "ledger.json").exists()
    ledger.save()  # and it starts empty, writing a good one
    assert Ledger.open(d).alerts == {} and len([p for p in d.iterdir() if p.name.startswith("ledger.bad-")]) == 1


async def test_the_route_by_pod_comes_from_the_routes_file(stack, http, tmp_path):
    routes = tmp_path / "routes.json"
    routes.write_text(json.dumps({"routes": {"ml/train": stack.coordinator_url}, "pods": {"ml/train-0": "ml/train"}}))
    gw, serve = await gateway_for(tmp_path / "gw3", http, {}, routes_file=routes)
    async with serve as url:
        status, body = await send(http, url, payload(alert("fp-5", job=None, pod="train-0")))
    assert status == 200 and body["results"][0]["outcome"] == "started"
    assert len(stack.coordinator.captures) == 1
