"""A gateway (in process, loopback) in front of a real coordinator (in process) whose node agent
is an agent double; helpers to build Alertmanager v4 payloads as Alertmanager sends them."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gpulens.capture.client.api import CaptureApi
from gpulens.capture.coordinator import Coordinator, make_app as coordinator_app
from gpulens.capture.wire.auth import Credentials, SecretFile
from gpulens.capture.gateway import Gateway, GatewaySettings, Ledger, Router, make_app
from tests.coordinator.agent_double import AgentDouble, RunningAgent
from tests.coordinator.conftest import AGENT_TOKEN, make_coordinator, write_job
from tests.coordinator.servers import serving

GATEWAY_TOKEN = "gateway-token"
COORDINATOR_TOKEN = "coordinator-token"
BASIC = ("alertmanager", "s3cret:with:colons")
BEARER = {"Authorization": f"Bearer {GATEWAY_TOKEN}"}


def basic_header(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def alert(fingerprint: str = "08b3f333842b5f8c", *, status: str = "firing", job: str | None = "train",
          namespace: str = "ml", pod: str = "train-0", auto: bool = True, starts_at: str = "2026-11-29T06:51:52.944761722Z",
          ends_at: str = "0001-01-01T00:00:00Z", **labels: str) -> dict[str, Any]:
    lbl = {"alertname": "GpuHostSync", "diagnosis": "host_sync", "namespace": namespace, "pod": pod,
           "node": "node-a", "severity": "warning", **labels}
    if auto:
        lbl["gpulens_capture"] = "auto"
    if job:
        lbl["gpulens_job"] = job
    return {"status": status, "labels": lbl, "annotations": {"summary": "host sync"}, "startsAt": starts_at,
            "endsAt": ends_at, "generatorURL": "http://prom:9090/graph", "fingerprint": fingerprint}


def payload(*alerts: dict[str, Any], **extra: Any) -> dict[str, Any]:
    status = "firing" if any(a["status"] == "firing" for a in alerts) else "resolved"
    common = alerts[0]["labels"] if alerts else {}
    return {"receiver": "gpulens-gateway", "status": status, "alerts": list(alerts),
            "groupLabels": {"alertname": common.get("alertname", "")}, "commonLabels": common,
            "commonAnnotations": {}, "externalURL": "http://alertmanager:9093", "version": "4",
            "groupKey": '{}/{gpulens_capture="auto"}:{alertname="GpuHostSync"}', "truncatedAlerts": 0, **extra}


@dataclass
class Stack:
    url: str
    gateway: Gateway
    coordinator: Coordinator
    coordinator_url: str
    agent: AgentDouble
    state_dir: Path


def secret(path: Path, text: str) -> SecretFile:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return SecretFile(path)


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
async def stack(tmp_path, http):
    write_job(tmp_path / "registry", pods={"train-0": ("node-a", 0)}, local_world_size=2)
    double = AgentDouble("node-a", AGENT_TOKEN, step_s=0.05)
    async with RunningAgent(double) as agent:
        coordinator = make_coordinator(tmp_path, http, {"node-a": agent.url})
        ccreds = Credentials(tokens=(secret(tmp_path / "coordinator.token", COORDINATOR_TOKEN),))
        async with serving(coordinator_app(coordinator, ccreds, heartbeat_s=0.2)) as curl:
            gw, url = await gateway_for(tmp_path, http, {"ml/train": curl})
            async with url as gurl:
                yield Stack(gurl, gw, coordinator, curl, double, tmp_path / "gateway")
        await coordinator.close()


async def gateway_for(tmp_path: Path, http, routes: dict[str, str], *, cooldown_s: float = 600.0,
                      routes_file: Path | None = None, template: str | None = None):
    creds = Credentials(tokens=(secret(tmp_path / "gateway.token", GATEWAY_TOKEN),),
                        basic=secret(tmp_path / "basic", f"{BASIC[0]}:{BASIC[1]}\nother:pw\n"))
    ctoken = secret(tmp_path / "coordinator.token", COORDINATOR_TOKEN)

    def api_for(url: str) -> CaptureApi:
        return CaptureApi(http, url, ctoken.read(), timeout_s=2.0)
    gw = Gateway(GatewaySettings(cooldown_s=cooldown_s, duration_ms=200),
                 Router(static=routes, routes_file=routes_file, template=template),
                 Ledger.open(tmp_path / "gateway"), api_for)
    return gw, serving(make_app(gw, creds, api_for))
