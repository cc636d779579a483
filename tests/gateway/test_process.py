"""`gpulens gateway` as a process, wired as `gpulens up` wires it (routes file, state dir), in
front of a real coordinator; and the start-up refusals of both servers."""

from __future__ import annotations

import asyncio
import json
import sys

import aiohttp

from tests.conftest import free_port
from tests.coordinator.servers import REPO, GpulensProcess

from .conftest import BEARER, COORDINATOR_TOKEN, GATEWAY_TOKEN


async def test_the_gateway_process_routes_by_the_routes_file_and_stops_cleanly(stack, tmp_path):
    routes = tmp_path / "routes.json"
    routes.write_text(json.dumps({"routes": {}, "pods": {}}))
    (tmp_path / "gw.token").write_text(GATEWAY_TOKEN)
    (tmp_path / "co.token").write_text(COORDINATOR_TOKEN)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    gw = await GpulensProcess(["gateway", "--listen", f"127.0.0.1:{port}", "--token-file", str(tmp_path / "gw.token"),
                               "--routes-file", str(routes), "--coordinator-token-file", str(tmp_path / "co.token"),
                               "--state-dir", str(tmp_path / "gw-state"), "--cooldown-s", "120"],
                              tmp_path / "gateway.log").start()
    try:
        await gw.wait_ready(url)
        async with aiohttp.ClientSession() as http:
            body = {"job_id": "train", "duration_ms": 200}
            async with http.post(url + "/v1/captures", json=body, headers=BEARER, params={"namespace": "ml"}) as r:
                assert r.status == 404                       # the job has no coordinator yet
            routes.write_text(json.dumps({"routes": {"ml/train": stack.coordinator_url},
                                          "pods": {"ml/train-0": "ml/train"}}))   # the local operator caught up
            async with http.post(url + "/v1/captures", json=body, headers=BEARER, params={"namespace": "ml"}) as r:
                assert r.status == 202
                cid = (await r.json())["capture_id"]
        assert list(stack.coordinator.captures) == [cid]
    finally:
        assert await gw.stop() == 0
    assert cid in json.loads((tmp_path / "gw-state" / "ledger.json").read_text())["captures"]
    assert "event=manual.capture_started" in (tmp_path / "gateway.log").read_text()


async def run_cli(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "gpulens.cli", *args, cwd=REPO,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode, out.decode()


async def test_servers_refuse_to_start_without_what_they_need(tmp_path):
    empty = tmp_path / "empty.token"
    empty.write_text("")
    ok = tmp_path / "ok.token"
    ok.write_text("x")
    code, out = await run_cli("gateway", "--token-file", str(ok), "--coordinator-token-file", str(ok))
    assert code == 2 and "--route" in out
    code, out = await run_cli("gateway", "--token-file", str(empty), "--coordinator-token-file", str(ok),
                              "--route", "ml/train=http://127.0.0.1:1")
    assert code == 2 and "missing or empty" in out
    code, out = await run_cli("gateway", "--token-file", str(ok), "--coordinator-token-file", str(ok),
                              "--route", "not-a-route")
    assert code == 2 and "NAMESPACE/JOB=" in out
    code, out = await run_cli("gateway", "--token-file", str(ok), "--coordinator-token-file", str(ok),
                              "--route", "ml/train=http://127.0.0.1:1", "--activities", "cpu_op,cuda_sync")
    assert code == 2 and "cuda_sync" in out
    base = ["coordinator", "--job", "train", "--attempt", "0", "--namespace", "ml", "--agent-url", "http://127.0.0.1:1",
            "--archive-root", f"file://{tmp_path}", "--agent-token-file", str(ok)]
    code, out = await run_cli(*base, "--discovery", "local", "--registry-dir", str(tmp_path), "--token-file", str(empty))
    assert code == 2 and "missing or empty" in out
    code, out = await run_cli(*base, "--discovery", "kubernetes", "--token-file", str(ok))
    assert code == 2 and "--selector" in out
