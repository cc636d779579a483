"""Alert-started captures are iteration-aligned by default: the `gpulens gateway` process (its CLI
defaults) turns an Alertmanager alert into a request for N optimizer steps, and the real coordinator
dispatches every rank with that N and one round-up; `--iterations 0` keeps wall-clock windows.
(Manual captures ask for what they ask for: `Gateway.manual` does not read these settings.)"""

from __future__ import annotations

import asyncio
import json
import time

from gpulens.capture.gateway import GatewaySettings
from tests.conftest import free_port
from tests.coordinator.servers import GpulensProcess

from .conftest import BEARER, COORDINATOR_TOKEN, GATEWAY_TOKEN, alert, payload
from .test_process import run_cli


async def dispatched(stack, capture_id: str, ranks: int = 2):
    """The dispatches the node agent got for `capture_id`, once every rank has one (the job has 2)."""
    end = time.monotonic() + 30
    while len(stack.agent.captures.get(capture_id, {})) < ranks:
        assert time.monotonic() < end, f"not every rank was dispatched: {stack.agent.captures.get(capture_id)}"
        await asyncio.sleep(0.05)
    return [e.dispatch for e in stack.agent.captures[capture_id].values()]


async def gateway_process(stack, tmp_path, *extra: str):
    (tmp_path / "gw.token").write_text(GATEWAY_TOKEN)
    (tmp_path / "co.token").write_text(COORDINATOR_TOKEN)
    port = free_port()
    gw = await GpulensProcess(["gateway", "--listen", f"127.0.0.1:{port}", "--token-file", str(tmp_path / "gw.token"),
                               "--route", f"ml/train={stack.coordinator_url}",
                               "--coordinator-token-file", str(tmp_path / "co.token"), "--cooldown-s", "0", *extra],
                              tmp_path / "gateway.log").start()
    url = f"http://127.0.0.1:{port}"
    await gw.wait_ready(url)
    return gw, url


async def test_the_gateways_defaults_make_alert_captures_iteration_aligned(stack, http, tmp_path):
    gw, url = await gateway_process(stack, tmp_path)
    try:
        async with http.post(url + "/v1/alertmanager", json=payload(alert("fp-it")), headers=BEARER) as r:
            body = await r.json()
            assert r.status == 200 and body["results"][0]["outcome"] == "started", body
        cid = body["results"][0]["capture_id"]
        for d in await dispatched(stack, cid):
            assert (d.iterations, d.iteration_roundup, d.duration_ms) == (10, 100, 30_000)
        request = stack.coordinator.captures[cid].request
        assert (request.iterations, request.duration_ms, request.requested_by) == (10, 30_000, "alertmanager")
    finally:
        assert await gw.stop() == 0


async def test_iterations_0_keeps_wall_clock_windows_and_a_roundup_is_passed_on(stack, http, tmp_path):
    gw, url = await gateway_process(stack, tmp_path, "--iterations", "0")
    try:
        async with http.post(url + "/v1/alertmanager", json=payload(alert("fp-wall")), headers=BEARER) as r:
            cid = (await r.json())["results"][0]["capture_id"]
        assert {(d.iterations, d.iteration_roundup, d.duration_ms) for d in await dispatched(stack, cid)} == {(None, None, 2000)}
        await stack.coordinator.wait(cid)
    finally:
        assert await gw.stop() == 0

    stack.gateway.settings = GatewaySettings(cooldown_s=0, duration_ms=5000, iterations=7, iteration_roundup=40)
    async with http.post(stack.url + "/v1/alertmanager", json=payload(alert("fp-r")), headers=BEARER) as r:
        cid = (await r.json())["results"][0]["capture_id"]
    assert {(d.iterations, d.iteration_roundup, d.duration_ms) for d in await dispatched(stack, cid)} == {(7, 40, 5000)}
    assert json.loads(json.dumps(stack.coordinator.captures[cid].request.to_dict()))["iterations"] == 7


async def test_bad_iteration_flags_are_refused_with_exit_2(tmp_path):
    ok = tmp_path / "ok.token"
    ok.write_text("x")
    for flags in (["--iterations", "5", "--iteration-roundup", "0"],):   # one start costs seconds of CPU here
        code, out = await run_cli("gateway", "--token-file", str(ok), "--coordinator-token-file", str(ok),
                                  "--route", "ml/train=http://127.0.0.1:9", *flags)
        assert code == 2 and "--iterations takes 0..10000" in out, (flags, code, out)


async def test_an_alerts_budget_annotation_prices_its_capture_and_a_bad_one_is_ignored_said(stack, http, tmp_path):
    """Issue 43: an alert rule can carry a budget (`gpulens_budget_mb` annotation): the real coordinator
    prices the capture with it and every rank's dispatch carries it; a value that is no MiB count is
    logged and the capture runs on the coordinator's default."""
    gw, url = await gateway_process(stack, tmp_path)
    try:
        a = alert("fp-budget")
        a["annotations"]["gpulens_budget_mb"] = "64"
        async with http.post(url + "/v1/alertmanager", json=payload(a), headers=BEARER) as r:
            cid = (await r.json())["results"][0]["capture_id"]
        assert {d.budget.budget_bytes for d in await dispatched(stack, cid)} == {64 << 20}
        assert stack.coordinator.captures[cid].request.budget_mb == 64
        await stack.coordinator.wait(cid)
        bad = alert("fp-budget-bad", pod="train-1")
        bad["annotations"]["gpulens_budget_mb"] = "64MB"
        async with http.post(url + "/v1/alertmanager", json=payload(bad), headers=BEARER) as r:
            body = await r.json()
            assert r.status == 200 and body["results"][0]["outcome"] == "started", body
        cid = body["results"][0]["capture_id"]
        default = stack.coordinator.settings.budget_mb
        assert {d.budget.budget_bytes for d in await dispatched(stack, cid)} == {default << 20} != {64 << 20}
    finally:
        assert await gw.stop() == 0
    log = (tmp_path / "gateway.log").read_text()
    assert "alert.bad_budget" in log and "64MB" in log


async def test_the_stalled_alert_starts_a_hang_capture_whatever_the_gateways_iterations(stack, http, tmp_path):
    """Issue 45: `gpulens_capture="hang"` (the GPUWorkloadStalled rule's label) asks for a hang
    capture: every rank dispatched with kind "hang", no iterations and no start instant, although
    the gateway's defaults make alert captures iteration-aligned; a label of another value starts nothing."""
    gw, url = await gateway_process(stack, tmp_path)
    try:
        stalled = alert("fp-hang", auto=False, alertname="GPUWorkloadStalled", diagnosis="stalled", gpulens_capture="hang")
        async with http.post(url + "/v1/alertmanager", json=payload(stalled), headers=BEARER) as r:
            body = await r.json()
            assert r.status == 200 and body["results"][0]["outcome"] == "started", body
        cid = body["results"][0]["capture_id"]
        assert {(d.kind, d.iterations, d.start_time_ms, d.budget) for d in await dispatched(stack, cid)} == \
            {("hang", None, None, None)}
        request = stack.coordinator.captures[cid].request
        assert request.kind == "hang" and request.reason.alertname == "GPUWorkloadStalled"
        await stack.coordinator.wait(cid)
        other = alert("fp-none", auto=False, alertname="GPUWorkloadStalled", diagnosis="stalled",
                      gpulens_capture="stacks")
        async with http.post(url + "/v1/alertmanager", json=payload(other), headers=BEARER) as r:
            body = await r.json()
            assert r.status == 200 and body["results"][0]["outcome"] == "ignored", body
    finally:
        assert await gw.stop() == 0
