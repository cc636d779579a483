"""Property-based fuzzing of the arming webhook (real aiohttp app over TLS, as the API server calls
it): whatever the AdmissionReview body, no 5xx and a JSON answer; a pod is never refused."""

from __future__ import annotations

from hypothesis import given

from tests.fuzzing import FUZZ, assert_no_server_error, bodies, nested

from .test_arming import job_pod
from .test_webhook import review, webhook  # noqa: F401 - the webhook fixture

JSON = {"Content-Type": "application/json"}


async def test_deep_nesting_is_400_naming_the_limit(webhook):
    for kind in ("array", "object"):
        async with webhook.post("/mutate", data=nested(1000, kind), headers=JSON) as r:
            body = await r.json()
            assert r.status == 400 and body["limit"] == "max_depth", body


@FUZZ
@given(body=bodies(review(job_pod())) | bodies(review(job_pod())["request"]))
async def test_no_review_body_makes_a_server_error(webhook, body):
    async with webhook.post("/mutate", data=body, headers=JSON) as r:
        raw = await r.read()
        assert_no_server_error(r.status, raw, "POST /mutate")
        if r.status == 200:  # an answered review admits the pod, whatever it could (not) arm
            assert b'"allowed": true' in raw or b'"allowed":true' in raw, raw[:300]
    async with webhook.get("/healthz") as r:
        assert r.status == 200
