"""The Alertmanager example: amtool accepts it, routes gpulens_capture="auto" to the gateway, and a
real Alertmanager delivers one notification per job to the webhook with the bearer token."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from pathlib import Path

import aiohttp
import pytest
import yaml
from aiohttp import web

from tests.conftest import free_port

from .conftest import ALERTRULES, run
from tests.conftest import missing

EXAMPLE = ALERTRULES / "alertmanager" / "alertmanager.example.yml"
ALERTMANAGER = "/usr/bin/prometheus-alertmanager"


def test_example_passes_amtool_check_config(amtool):
    result = run(amtool, "check-config", str(EXAMPLE))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_amtool_rejects_a_broken_copy(amtool, tmp_path):
    """The check is not vacuous: a receiver with both auth methods is refused."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["receivers"][1]["webhook_configs"][0]["http_config"]["basic_auth"] = {"username": "a", "password": "b"}
    bad = tmp_path / "am.yml"
    bad.write_text(yaml.safe_dump(doc))
    assert run(amtool, "check-config", str(bad)).returncode != 0


def _receivers(amtool, *labels: str) -> list[str]:
    result = run(amtool, "config", "routes", "test", f"--config.file={EXAMPLE}", *labels)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().split(",")


@pytest.mark.parametrize("labels, receivers", [
    (("gpulens_capture=auto", "diagnosis=host_sync", "namespace=ml", "gpulens_job=j"), ["gpulens-gateway", "default"]),
    (("gpulens_capture=hang", "diagnosis=stalled", "namespace=ml", "gpulens_job=j"), ["gpulens-gateway", "default"]),
    (("gpulens_capture=none", "diagnosis=capture_degraded", "namespace=ml"), ["default"]),
    (("gpulens_capture=none", "diagnosis=exporter_degraded"), ["default"]),
    (("alertname=SomethingElse",), ["default"]),
])
def test_routing(amtool, labels, receivers):
    assert _receivers(amtool, *labels) == receivers


class _GatewayDouble:
    """Stands for the gateway's `POST /v1/alertmanager`: records each webhook request (headers and
    JSON body, Alertmanager's version-4 payload) and answers 200 like a gateway that accepted it."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.arrived = asyncio.Event()

    async def handle(self, request: web.Request) -> web.Response:
        self.requests.append({"path": request.path, "headers": dict(request.headers),
                              "body": await request.json()})
        self.arrived.set()
        return web.json_response({"accepted": True})


async def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 30) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(int(timeout * 10)):
            if proc.poll() is not None:
                raise RuntimeError(f"alertmanager exited with {proc.returncode}")
            try:
                async with s.get(url) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise TimeoutError(url)


def _alert(pod: str, capture: str, diagnosis: str, job: str | None = "llama-ft") -> dict:
    labels = {"alertname": "GPUWorkload" + diagnosis.title().replace("_", ""), "diagnosis": diagnosis,
              "severity": "warning", "gpulens_capture": capture, "namespace": "ml", "pod": pod, "node": "n1"}
    if job:
        labels["gpulens_job"] = job
    return {"labels": labels, "annotations": {"summary": f"ml/{pod}"}}


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_real_alertmanager_delivers_one_notification_per_job_with_the_token(tmp_path):
    if not Path(ALERTMANAGER).exists():
        missing("prometheus-alertmanager not installed")
    gateway = _GatewayDouble()
    app = web.Application()
    app.router.add_post("/v1/alertmanager", gateway.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    gw_port = free_port()
    await web.TCPSite(runner, "127.0.0.1", gw_port).start()

    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    config = yaml.safe_load(EXAMPLE.read_text())
    webhook = config["receivers"][1]["webhook_configs"][0]
    webhook["url"] = f"http://127.0.0.1:{gw_port}/v1/alertmanager"
    webhook["http_config"]["authorization"]["credentials_file"] = str(token)
    (tmp_path / "am.yml").write_text(yaml.safe_dump(config))

    am_port = free_port()
    proc = subprocess.Popen(
        [ALERTMANAGER, f"--config.file={tmp_path / 'am.yml'}", f"--storage.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{am_port}", "--cluster.listen-address="],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "am.log", "w"), start_new_session=True)
    try:
        base = f"http://127.0.0.1:{am_port}"
        await _wait_ready(f"{base}/-/ready", proc)
        alerts = [_alert("llama-ft-0", "auto", "host_sync"), _alert("llama-ft-1", "auto", "host_sync"),
                  _alert("gpt-3", "none", "capture_degraded", job="gpt")]
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{base}/api/v2/alerts", json=alerts) as r:
                assert r.status == 200, await r.text()
        await asyncio.wait_for(gateway.arrived.wait(), timeout=60)  # group_wait is 10s
        await asyncio.sleep(1.0)  # anything else sent in the same flush arrives now
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
        await runner.cleanup()

    assert len(gateway.requests) == 1, [r["body"]["groupLabels"] for r in gateway.requests]
    request = gateway.requests[0]
    assert request["headers"]["Authorization"] == "Bearer s3cret-token"
    body = request["body"]
    assert body["version"] == "4" and body["receiver"] == "gpulens-gateway" and body["status"] == "firing"
    assert body["groupLabels"] == {"namespace": "ml", "gpulens_job": "llama-ft"}
    pods = sorted(a["labels"]["pod"] for a in body["alerts"])
    assert pods == ["llama-ft-0", "llama-ft-1"], "both pods of the job in one notification; never the one labelled none"
    assert all(a["fingerprint"] and a["startsAt"] for a in body["alerts"])
    assert json.dumps(body).count("gpt-3") == 0
