"""The arming webhook over HTTPS, spoken to the way the API server does (AdmissionReview v1),
including malformed and hostile requests: clear 4xx answers, and never a refused pod."""

from __future__ import annotations

import base64
import json
import ssl

import aiohttp
import jsonpatch
import pytest
from aiohttp import web

from gpulens.capture.wire import labels as L
from gpulens.capture.operator.config import ArmingConfig
from gpulens.capture.operator.webhook import MAX_BODY, make_app, tls_context

from .test_arming import IMAGE, job_pod
from .tls import make_certs


def review(obj, *, kind="Pod", group="", operation="CREATE", uid="705ab4f5-6393-11e8-b7cc-42010a800002"):
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": uid, "kind": {"group": group, "version": "v1", "kind": kind},
                        "resource": {"group": group, "version": "v1", "resource": kind.lower() + "s"},
                        "requestKind": {"group": group, "version": "v1", "kind": kind},
                        "namespace": "ml", "operation": operation,
                        "userInfo": {"username": "system:serviceaccount:kube-system:job-controller"},
                        "object": obj, "oldObject": None, "dryRun": False,
                        "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"}}}


@pytest.fixture
async def webhook(tmp_path, port):
    ca, cert, key = make_certs(tmp_path)
    runner = web.AppRunner(make_app(ArmingConfig(), IMAGE))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=tls_context(str(cert), str(key))).start()
    client_ctx = ssl.create_default_context(cafile=str(ca))
    async with aiohttp.ClientSession(base_url=f"https://127.0.0.1:{port}",
                                     connector=aiohttp.TCPConnector(ssl=client_ctx)) as session:
        yield session
    await runner.cleanup()


async def test_a_job_pod_is_armed_with_a_json_patch(webhook):
    pod = job_pod()
    async with webhook.post("/mutate", json=review(pod)) as resp:
        assert resp.status == 200
        body = await resp.json()
    assert body["apiVersion"] == "admission.k8s.io/v1" and body["kind"] == "AdmissionReview"
    r = body["response"]
    assert r["uid"] == "705ab4f5-6393-11e8-b7cc-42010a800002" and r["allowed"] is True
    assert r["patchType"] == "JSONPatch"
    out = jsonpatch.apply_patch(pod, json.loads(base64.b64decode(r["patch"])))
    assert out["metadata"]["labels"][L.ARMED] == "true"
    assert "warnings" not in r


@pytest.mark.parametrize("case", ["not-a-pod", "update", "not-a-job", "other-api-group"])
async def test_requests_it_does_not_arm_are_allowed_unchanged(webhook, case):
    if case == "not-a-pod":
        rv = review({"metadata": {"name": "x"}}, kind="ConfigMap")
    elif case == "update":
        rv = review(job_pod(), operation="UPDATE")
    elif case == "not-a-job":
        rv = review({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web"},
                     "spec": {"containers": [{"name": "web", "image": "nginx"}]}})
    else:
        rv = review(job_pod(), group="metrics.k8s.io")
    async with webhook.post("/mutate", json=rv) as resp:
        assert resp.status == 200
        r = (await resp.json())["response"]
    assert r["allowed"] is True and "patch" not in r and "patchType" not in r


async def test_a_pod_that_breaks_arming_is_still_admitted_with_a_warning(webhook):
    pod = job_pod()
    pod["spec"]["containers"] = "not-a-list"
    async with webhook.post("/mutate", json=review(pod)) as resp:
        assert resp.status == 200
        r = (await resp.json())["response"]
    assert r["allowed"] is True and "patch" not in r
    assert r["warnings"] and r["warnings"][0].startswith("gpulens: pod not armed")


@pytest.mark.parametrize("body,status,needle", [
    (b"{not json", 400, "not JSON"),
    (json.dumps([1, 2]).encode(), 400, "JSON object"),
    (json.dumps({"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview", "request": {}}).encode(),
     400, "admission.k8s.io/v1"),
    (json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}).encode(), 400, "request"),
    (json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                 "request": {"uid": ""}}).encode(), 400, "request.uid"),
])
async def test_malformed_reviews_get_a_clear_400(webhook, body, status, needle):
    async with webhook.post("/mutate", data=body, headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == status
        assert needle in (await resp.json())["error"]


async def test_wrong_content_type_and_oversized_bodies_are_refused(webhook):
    async with webhook.post("/mutate", data=b"{}", headers={"Content-Type": "text/plain"}) as resp:
        assert resp.status == 415
    async with webhook.post("/mutate", data=b"{" + b" " * MAX_BODY + b"}",
                            headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == 413
    async with webhook.get("/healthz") as resp:        # still serving afterwards
        assert resp.status == 200


async def test_plain_http_is_not_served(webhook, port):
    async with aiohttp.ClientSession() as plain:
        with pytest.raises(aiohttp.ClientError):
            async with plain.post(f"http://127.0.0.1:{port}/mutate", json=review(job_pod())) as resp:
                await resp.read()


async def test_without_the_webhook_there_is_no_mutate_endpoint(port):
    runner = web.AppRunner(make_app(None, IMAGE))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(f"http://127.0.0.1:{port}/mutate", json=review(job_pod())) as resp:
                assert resp.status in (404, 405)
            async with s.get(f"http://127.0.0.1:{port}/healthz") as resp:
                assert resp.status == 200
    finally:
        await runner.cleanup()


async def test_a_renewed_certificate_is_served_without_a_restart(tmp_path, port):
    """cert-manager rewrites the Secret volume; new handshakes must present the new certificate."""
    import asyncio

    from gpulens.capture.operator.webhook import reload_certificates

    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    ca1, cert, key = make_certs(first)
    ca2, cert2, key2 = make_certs(second)
    ctx = tls_context(str(cert), str(key))
    runner = web.AppRunner(make_app(ArmingConfig(), IMAGE))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=ctx).start()
    stop = asyncio.Event()
    task = asyncio.create_task(reload_certificates(ctx, str(cert), str(key), stop, interval_s=0.05))

    async def healthy_with(ca) -> bool:
        conn = aiohttp.TCPConnector(ssl=ssl.create_default_context(cafile=str(ca)), force_close=True)
        async with aiohttp.ClientSession(connector=conn) as s:
            try:
                async with s.get(f"https://127.0.0.1:{port}/healthz") as resp:
                    return resp.status == 200
            except aiohttp.ClientError:
                return False
    try:
        assert await healthy_with(ca1) and not await healthy_with(ca2)
        key.write_bytes(key2.read_bytes())
        cert.write_bytes(cert2.read_bytes())
        for _ in range(400):
            if await healthy_with(ca2):
                break
            await asyncio.sleep(0.05)
        assert await healthy_with(ca2) and not await healthy_with(ca1)
    finally:
        stop.set()
        await task
        await runner.cleanup()
