"""A real Alertmanager (Debian's prometheus-alertmanager) delivering to the gateway over loopback:
one firing alert starts exactly one capture, also after its repeats; its resolution reaches the
capture; a receiver with a wrong token is refused and starts nothing."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import shutil
import signal
import subprocess

import aiohttp
import pytest
import yaml
from aiohttp import web

from tests.conftest import free_port

from .conftest import GATEWAY_TOKEN
from tests.conftest import requires

ALERTMANAGER = shutil.which("prometheus-alertmanager") or "/usr/bin/prometheus-alertmanager"

pytestmark = [pytest.mark.slow,
              requires(None if os.path.exists(ALERTMANAGER) else "prometheus-alertmanager not installed")]


def am_config(gateway_url: str, good: str, bad: str) -> dict:
    def receiver(name: str, token_file: str) -> dict:
        return {"name": name, "webhook_configs": [{
            "url": gateway_url + "/v1/alertmanager", "send_resolved": True, "max_alerts": 0,
            "http_config": {"authorization": {"type": "Bearer", "credentials_file": token_file}}}]}
    return {
        "route": {"receiver": "null", "group_by": ["alertname", "namespace", "gpulens_job"], "group_wait": "500ms",
                  "group_interval": "1s", "repeat_interval": "2s",
                  "routes": [{"receiver": "gateway-bad-token", "matchers": ['gpulens_capture="auto"', 'channel="bad"']},
                             {"receiver": "gpulens-gateway", "matchers": ['gpulens_capture="auto"']}]},
        "receivers": [{"name": "null"}, receiver("gpulens-gateway", good), receiver("gateway-bad-token", bad)],
    }


def rfc3339(t: dt.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


async def push(http, am_url: str, labels: dict, starts: dt.datetime, ends: dt.datetime) -> None:
    body = [{"labels": labels, "annotations": {"summary": "host sync"}, "startsAt": rfc3339(starts),
             "endsAt": rfc3339(ends), "generatorURL": "http://prometheus.invalid/graph"}]
    async with http.post(am_url + "/api/v2/alerts", json=body) as r:
        assert r.status == 200, await r.text()


async def until(predicate, timeout: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


async def test_a_real_alertmanager_starts_exactly_one_capture_and_a_bad_token_is_refused(stack, http, tmp_path):
    seen: list[tuple[int, str, int]] = []    # (status, first fingerprint, alerts) per webhook request

    @web.middleware
    async def record(request, handler):
        response = await handler(request)
        if request.path == "/v1/alertmanager":
            seen.append((response.status, request.headers.get("User-Agent", ""), request.content_length or 0))
        return response
    # the stack's gateway app is already running; observe it from a second app on the same gateway object
    from gpulens.capture.wire.auth import Credentials, SecretFile
    from gpulens.capture.gateway import make_app
    from tests.coordinator.servers import serving
    good, bad = tmp_path / "am-good.token", tmp_path / "am-bad.token"
    good.write_text(GATEWAY_TOKEN)
    bad.write_text("not-the-gateway-token")
    app = make_app(stack.gateway, Credentials(tokens=(SecretFile(tmp_path / "gateway.token"),)),
                   stack.gateway.api_for)
    app.middlewares.insert(0, record)
    async with serving(app) as gateway_url:
        port = free_port()
        cfg = tmp_path / "alertmanager.yml"
        cfg.write_text(yaml.safe_dump(am_config(gateway_url, str(good), str(bad))))
        log = open(tmp_path / "alertmanager.log", "wb")
        proc = subprocess.Popen([ALERTMANAGER, f"--config.file={cfg}", f"--storage.path={tmp_path / 'am-data'}",
                                 f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
                                stdout=log, stderr=log, start_new_session=True)
        am = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as amc:
                for _ in range(300):
                    try:
                        async with amc.get(am + "/-/ready") as r:
                            if r.status == 200:
                                break
                    except aiohttp.ClientError:
                        pass
                    await asyncio.sleep(0.1)
                now = dt.datetime.now(dt.timezone.utc)
                labels = {"alertname": "GpuHostSync", "diagnosis": "host_sync", "gpulens_capture": "auto",
                          "namespace": "ml", "gpulens_job": "train", "pod": "train-0", "severity": "warning"}
                await push(amc, am, labels, now, now + dt.timedelta(minutes=10))
                await push(amc, am, {**labels, "alertname": "GpuInputStarvation", "channel": "bad"}, now,
                           now + dt.timedelta(minutes=10))
                # the first notification, then at least two repeats (repeat_interval 2 s)
                await until(lambda: sum(1 for s, _, _ in seen if s == 200) >= 3, 60, "three deliveries")
                await until(lambda: any(s == 401 for s, _, _ in seen), 30, "the bad-token delivery")
                assert len(stack.coordinator.captures) == 1
                (cid,) = stack.coordinator.captures
                rec = stack.coordinator.captures[cid]
                assert rec.request.reason.alertname == "GpuHostSync"
                assert all(ua.startswith("Alertmanager/") for _, ua, _ in seen)
                # the refused receiver never reached the ledger, and started nothing
                assert all(e.fingerprint for e in stack.gateway.ledger.alerts.values())
                assert {e.outcome for e in stack.gateway.ledger.alerts.values()} == {"started"}
                assert len(stack.gateway.ledger.alerts) == 1
                # resolve it: Alertmanager sends the resolved notification, the capture hears of it
                await push(amc, am, labels, now, dt.datetime.now(dt.timezone.utc))
                await until(lambda: rec.alert_resolved_at is not None, 60, "the resolved notification")
                assert len(stack.coordinator.captures) == 1
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()
    assert proc.returncode is not None
