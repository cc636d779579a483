"""Alerts and manual requests on a serving workload (issue 30), through the real gateway to a real
serving coordinator (its agent a double): the alert names the pod and the workload kind; the
capture is a wall-clock window of that pod plus one healthy peer of its revision; a person names
pods or asks for N replicas; bad input is refused at the boundary with the field, and a training
alert is captured exactly as before."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest

from gpulens.capture.client.api import CaptureApi
from gpulens.capture.coordinator import LocalDiscovery, make_app as coordinator_app
from gpulens.capture.wire.auth import Credentials
from gpulens.capture.gateway import Gateway, GatewaySettings, Ledger, Router, make_app
from gpulens.capture.gateway.alertmanager import parse_payload
from gpulens.capture.gateway.routing import deployment_revision
from tests.coordinator.agent_double import AgentDouble, RunningAgent
from tests.coordinator.conftest import AGENT_TOKEN, make_coordinator
from tests.coordinator.servers import serving
from tests.coordinator.test_serving import write_replicas

from .conftest import BEARER, COORDINATOR_TOKEN, GATEWAY_TOKEN, alert, payload, secret

REV = "web-7f9c8d5b4"
PODS = {f"{REV}-x2x9z": "node-a", f"{REV}-k8s7q": "node-a", f"{REV}-zzzzz": "node-a"}


class _Urls:
    def __init__(self, url):
        self.url = url

    def for_node(self, node, node_ip=""):
        return self.url


@contextlib.asynccontextmanager
async def serving_stack(tmp_path, http, router=lambda coordinator_url: Router(static={f"serve/{REV}": coordinator_url})):
    """The gateway in front of revision REV's serving coordinator: (gateway URL, gateway, coordinator).
    `router` makes the gateway's Router from the coordinator's URL (static routes by default; a
    cluster's gateway has only a URL template)."""
    for pod, node in PODS.items():
        write_replicas(tmp_path / "registry", {pod: node})
    # write_replicas names the job web-aaaa1: re-home the records under this revision's job id
    for path in (tmp_path / "registry").glob("*.json"):
        path.write_text(path.read_text().replace('"web-aaaa1"', f'"{REV}"'))
        path.rename(path.with_name(path.name.replace("web-aaaa1", REV)))
    double = AgentDouble("node-a", AGENT_TOKEN, step_s=0.05)
    async with RunningAgent(double) as agent:
        disc = LocalDiscovery(tmp_path / "registry", job_id=REV, attempt=0, namespace="serve",
                              agents=_Urls(agent.url), serving=True)
        c = make_coordinator(tmp_path, http, {"node-a": agent.url}, job=REV, namespace="serve", discovery=disc)
        c.settings = replace(c.settings, serving=True)
        ccreds = Credentials(tokens=(secret(tmp_path / "coordinator.token", COORDINATOR_TOKEN),))
        async with serving(coordinator_app(c, ccreds, heartbeat_s=0.2)) as curl:
            creds = Credentials(tokens=(secret(tmp_path / "gateway.token", GATEWAY_TOKEN),))

            def api_for(url: str) -> CaptureApi:
                return CaptureApi(http, url, COORDINATOR_TOKEN, timeout_s=2.0)
            gw = Gateway(GatewaySettings(cooldown_s=600, duration_ms=30000, iterations=20,
                                         serving_duration_ms=200, serving_peers=1),
                         router(curl), Ledger.open(tmp_path / "gateway"), api_for)
            async with serving(make_app(gw, creds, api_for)) as gurl:
                yield gurl, gw, c
        await c.close()


@pytest.fixture
async def stack(tmp_path, http):
    async with serving_stack(tmp_path, http) as s:
        yield s


def serving_alert(pod: str, *, job: str | None = REV, fingerprint: str = "5e7f1e2a9c3b4d60") -> dict:
    return alert(fingerprint, job=job, namespace="serve", pod=pod, alertname="GpuNoisyNeighbor",
                 diagnosis="noisy_neighbor", gpulens_workload="Deployment/web")


async def post(http, url, path, body, **params):
    async with http.post(url + path, json=body, headers=BEARER, params=params or None) as r:
        return r.status, await r.json()


async def converged(c, capture_id):
    await c.wait(capture_id)
    return c.captures[capture_id]


@pytest.mark.parametrize("job", [REV, None])   # None: the revision told from the Deployment pod's name
async def test_an_alert_on_a_replica_captures_it_and_one_healthy_peer_in_a_wall_clock_window(stack, http, job):
    url, gw, c = stack
    status, body = await post(http, url, "/v1/alertmanager", payload(serving_alert(f"{REV}-zzzzz", job=job)))
    assert status == 200 and body["results"][0]["outcome"] == "started", body
    rec = await converged(c, body["results"][0]["capture_id"])
    r = rec.request
    assert r.pods == (f"{REV}-zzzzz",) and r.peers == 1 and r.iterations is None and r.duration_ms == 200
    assert r.reason.diagnosis == "noisy_neighbor" and r.reason.workload == f"serve/{REV}-zzzzz"
    assert sorted(p.target.pod for p in rec.targets.values()) == [f"{REV}-k8s7q", f"{REV}-zzzzz"]
    assert rec.fully_succeeded


async def test_a_manual_capture_names_pods_or_takes_n_replicas(stack, http):
    url, gw, c = stack
    status, body = await post(http, url, "/v1/captures", {"duration_ms": 200, "pods": [f"{REV}-x2x9z"]},
                              namespace="serve", workload="Deployment/web")
    assert status == 202 and body["job"] == f"serve/{REV}", body
    rec = await converged(c, body["capture_id"])
    assert [p.target.pod for p in rec.targets.values()] == [f"{REV}-x2x9z"]       # no peers asked
    status, body = await post(http, url, "/v1/captures", {"job_id": REV, "duration_ms": 200, "replicas": 3},
                              namespace="serve")
    assert status == 202
    rec = await converged(c, body["capture_id"])
    assert len(rec.targets) == 3 and len({p.target.rank for p in rec.targets.values()}) == 3


@pytest.mark.parametrize("body, params, code, field", [
    ({"job_id": REV, "duration_ms": 200, "pods": []}, {}, 400, "pods"),
    ({"job_id": REV, "duration_ms": 200, "pods": ["a b"]}, {}, 400, "pods[0]"),
    ({"job_id": REV, "duration_ms": 200, "pods": [f"{REV}-x2x9z"], "peers": -1}, {}, 400, "peers"),
    ({"job_id": REV, "duration_ms": 200, "replicas": 0}, {}, 400, "replicas"),
    ({"job_id": REV, "duration_ms": 200, "pods": [f"{REV}-x2x9z"], "replicas": 2}, {}, 400, "replicas"),
    ({"job_id": REV, "duration_ms": 200, "iterations": 5}, {}, 400, "iterations"),
    ({"duration_ms": 200, "pods": ["llm-0"]}, {"workload": "Deployment/web"}, 400, "job_id"),
    ({"duration_ms": 200, "pods": [f"{REV}-x2x9z"]}, {"workload": "Pod/web"}, 400, "workload"),
    ({"duration_ms": 200, "pods": ["other-abc12-x2x9z"]}, {"workload": "Deployment/other"}, 404, "job_id"),
])
async def test_bad_serving_requests_are_refused_with_the_field_and_start_nothing(stack, http, body, params, code, field):
    url, gw, c = stack
    status, answer = await post(http, url, "/v1/captures", body, namespace="serve", **params)
    assert (status, answer.get("field")) == (code, field), answer
    assert c.captures == {}


def test_a_training_alert_is_unchanged_iterations_and_every_rank():
    gw = Gateway(GatewaySettings(iterations=20, duration_ms=30000), Router(static={}), Ledger.open(None),
                 lambda url: None)
    (training,) = parse_payload(payload(alert(gpulens_workload="job/train")))
    body = gw._alert_request(training, "c-20261204t000000-00000000")
    assert body["iterations"] == 20 and body["duration_ms"] == 30000
    assert not {"pods", "peers", "replicas"} & set(body)
    (workload_wide,) = parse_payload(payload(alert(pod="", gpulens_workload="StatefulSet/llm")))
    body = gw._alert_request(workload_wide, "c-20261204t000000-00000001")
    assert body["replicas"] == 2 and "pods" not in body and "iterations" not in body


@pytest.mark.parametrize("workload, pod, job", [
    ("Deployment/web", "web-7f9c8d5b4-x2x9z", "web-7f9c8d5b4"),
    ("Deployment/web-api", "web-api-5d8f7-abcde", "web-api-5d8f7"),
    ("Deployment/web", "webx-7f9c8d5b4-x2x9z", None),      # another Deployment's pod
    ("Deployment/web", "web-x2x9z", None),                  # no template hash in the name
    ("StatefulSet/llm", "llm-0", None),                     # revisions are not in StatefulSet pod names
    ("job/train", "train-0", None),
    (None, "web-7f9c8d5b4-x2x9z", None),
])
def test_a_deployment_pods_revision_is_told_only_from_names_that_say_it(workload, pod, job):
    assert deployment_revision(workload, pod) == job


def test_the_gateways_serving_kinds_are_the_operators():
    from gpulens.capture.gateway.routing import SERVING_KINDS
    from gpulens.capture.wire import labels as L
    assert SERVING_KINDS == L.SERVING_KINDS
