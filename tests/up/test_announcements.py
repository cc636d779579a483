"""What `gpulens up` tells a newcomer without their opening a log: the gateway's decision for each
alert and manual request, alerts firing and resolved, crashes and restarts with the log path; and
the runbooks every alert links to, served by the captures page."""

from __future__ import annotations

import asyncio
import logging
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import yaml
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gpulens.capture.gateway import Gateway, GatewaySettings, Ledger, Router
from gpulens.capture.gateway.alertmanager import parse_payload
from gpulens.ground.logs import setup_logging
from gpulens.up.layout import Layout, Ports
from gpulens.up.page import RUNBOOKS_DIR, Page
from gpulens.up.status import LogTail, StatusReporter, gateway_line, parse_logfmt
from gpulens.up.supervisor import ChildSpec, Supervisor
from tests.coordinator.servers import serving
from tests.gateway.conftest import alert, payload


def runner_for(tmp_path: Path, port_base: int = 0):
    layout = Layout.create(tmp_path / "w")
    said: list[str] = []
    return SimpleNamespace(layout=layout, ports=Ports(port_base), said=said, say=said.append, urls={},
                           sup=SimpleNamespace(children={}), operator=None)


class _Coordinator:
    """Stands for a coordinator's POST /v1/captures: accepts (202, created) the first request per id,
    answers 200 created=false for a repeat, as the real one does (capture/coordinator/server.py)."""

    def __init__(self):
        self.ids: list[str] = []

    async def start(self, body, namespace=None):
        created = body["capture_id"] not in self.ids
        if created:
            self.ids.append(body["capture_id"])
        return (202 if created else 200), {"capture_id": body["capture_id"], "created": created}


async def test_each_gateway_decision_becomes_one_sentence_with_the_capture_and_why(tmp_path):
    """A real Gateway logs through the real logger into a file, as under `up`; the tail turns it into
    the lines up prints: started, cooldown since <capture>, not routable, a repeated manual id."""
    log_file = tmp_path / "gateway.log"
    root = logging.getLogger("gpulens")
    handlers = list(root.handlers)
    with open(log_file, "w") as stream:
        setup_logging("info", stream=stream)
        try:
            coord = _Coordinator()
            gw = Gateway(GatewaySettings(cooldown_s=600, duration_ms=200), Router(static={"ml/train": "http://c"}),
                         Ledger.open(tmp_path / "state"), lambda url: coord)
            status, first = await gw.manual({"job_id": "train"}, "ml")
            assert status == 202
            await gw.manual({"job_id": "train", "capture_id": first["capture_id"]}, "ml")
            await gw.handle_alerts(parse_payload(payload(alert("aaaa1111aaaa1111"))))
            await gw.handle_alerts(parse_payload(payload(alert("bbbb2222bbbb2222", job="ghost"))))
        finally:
            root.handlers[:] = handlers
    lines = [gateway_line(parse_logfmt(line)) for line in LogTail(log_file).lines()]
    lines = [line for line in lines if line]
    cid = first["capture_id"]
    assert lines[0] == f"gateway: manual capture {cid} of ml/train started (by manual; starts the cooldown)"
    assert lines[1] == f"gateway: manual request repeated capture id {cid}: same capture, nothing new started"
    assert lines[2].startswith(f"gateway: GpuHostSync on ml/train -> no capture: cooldown since capture {cid} (")
    assert "manual captures count too" in lines[2]
    assert lines[3] == "gateway: GpuHostSync -> not routable: no coordinator is known for ml/ghost"
    assert len(lines) == 4 and coord.ids == [cid]


def test_the_log_tail_returns_only_complete_new_lines(tmp_path):
    path = tmp_path / "x.log"
    tail = LogTail(path)
    assert tail.lines() == []                        # not there yet
    path.write_text("a=1\nb=")
    assert tail.lines() == ["a=1"]
    with open(path, "a") as f:
        f.write('2 c="x y"\n')
    assert tail.lines() == ['b=2 c="x y"'] and parse_logfmt('b=2 c="x y"') == {"b": "2", "c": "x y"}
    assert tail.lines() == []


async def test_alerts_are_announced_firing_then_resolved_with_their_runbook(tmp_path):
    """An Alertmanager double serving GET /api/v2/alerts in v2's shape (fingerprint, labels,
    annotations, startsAt), whose active list the test changes."""
    active: list[dict] = []

    async def alerts(request: web.Request) -> web.Response:
        assert request.query.get("active") == "true"
        return web.json_response(active)
    app = web.Application()
    app.router.add_get("/api/v2/alerts", alerts)
    async with serving(app) as url:
        port = int(url.rsplit(":", 1)[1])
        runner = runner_for(tmp_path, port_base=port - 11)
        runner.sup.children = {"alertmanager": None}
        reporter = StatusReporter(runner, interval_s=0.1)
        import aiohttp
        async with aiohttp.ClientSession() as session:
            active.append({"fingerprint": "f1", "startsAt": "2026-12-01T10:00:00Z",
                           "labels": {"alertname": "GPUWorkloadHostSync", "diagnosis": "host_sync",
                                      "namespace": "demo", "pod": "demo-trainer-0"},
                           "annotations": {"runbook_url": "http://127.0.0.1:9455/runbooks/host_sync.md"}})
            await reporter.tick(session)
            await reporter.tick(session)                   # still firing: said once
            active.clear()
            await reporter.tick(session)
    text = "\n".join(runner.said)
    assert text.count("alert firing: GPUWorkloadHostSync diagnosis=host_sync demo/demo-trainer-0") == 1
    assert "runbook: http://127.0.0.1:9455/runbooks/host_sync.md" in text
    assert re.search(r"\] alert resolved: GPUWorkloadHostSync diagnosis=host_sync demo/demo-trainer-0$", text)


async def test_a_crash_and_the_restart_are_announced_with_pid_and_log_path(tmp_path):
    said: list[str] = []
    sup = Supervisor(tmp_path / "logs", announce=said.append)
    code = "import sys; f = open(sys.argv[1], 'a'); f.write('x'); sys.exit(3)"
    await sup.start(ChildSpec("crasher", [sys.executable, "-c", code, str(tmp_path / "runs")], max_restarts=1))
    for _ in range(200):
        if sup.children["crasher"].state == "failed":
            break
        await asyncio.sleep(0.05)
    await sup.stop_all()
    log = tmp_path / "logs" / "crasher.log"
    assert re.fullmatch(rf"process crasher \(pid \d+\) exited with code 3; restarting in 2 s \(restart 1 of 1\); "
                        rf"log: {re.escape(str(log))}", said[0]), said
    assert re.fullmatch(rf"process crasher restarted: pid \d+; log: {re.escape(str(log))}", said[1]), said
    assert said[2].endswith(f"exited with code 3 (no restarts left); log: {log}") and len(said) == 3


async def test_every_runbook_an_alert_links_to_is_served_by_the_captures_page(tmp_path):
    """The rules `up` generates (same flags as runner.py) name runbooks on the page; each opens."""
    out = tmp_path / "rules"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpulens.alertrules.generate", "--time-scale", "0.0333", "--rules-out", str(out),
        "--manifest-out", str(tmp_path / "rule.yaml"), "--runbook-base-url", "http://page/runbooks",
        "--grafana-url", "", cwd=Path(__file__).resolve().parents[2], stdout=asyncio.subprocess.DEVNULL)
    assert await proc.wait() == 0
    links: set[str] = set()
    for f in out.glob("*.yml"):
        for group in yaml.safe_load(f.read_text())["groups"]:
            for rule in group["rules"]:
                notes = rule.get("annotations", {})
                assert "dashboard_url" not in notes, rule["alert"]          # no Grafana: no dashboard link
                if "alert" in rule:
                    assert notes.get("runbook_url", "").startswith("http://page/runbooks/"), rule["alert"]
                    links.add(notes["runbook_url"].removeprefix("http://page"))
    assert len(links) >= 5
    runner = runner_for(tmp_path)
    async with TestClient(TestServer(Page(runner, port=0).app())) as client:
        for path in sorted(links):
            r = await client.get(path)
            assert r.status == 200, path
            assert await r.text() == (RUNBOOKS_DIR / path.rsplit("/", 1)[1]).read_text()
        index = await (await client.get("/runbooks/")).text()
        assert all(f'href="{p}"' in index for p in links)
        # every runbook link the page itself shows (its index and the runbook list) opens too
        shown = set(re.findall(r'href="(/runbooks/[^"]+)"', index + await (await client.get("/")).text()))
        assert links <= shown and len(shown) == len(list(RUNBOOKS_DIR.glob("*.md")))
        for path in sorted(shown):
            assert (await client.get(path)).status == 200, path
        from yarl import URL
        for bad in ("/runbooks/nope.md", "/runbooks/..%2F..%2FREADME.md", "/runbooks/%2e%2e", "/runbooks/Host.md"):
            r = await client.get(URL(bad, encoded=True))
            assert r.status == 404, bad
