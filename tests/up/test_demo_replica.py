"""The serving demo's replica (issue 30): a PyTorch CPU model behind a real HTTP endpoint, loaded by
its own client, on the CUDA driver stand-in. Real processes, real torch, real sockets on loopback."""

from __future__ import annotations

import http.client
import json
import re
import shutil
import socket
import subprocess
import sys

import pytest

from gpulens.exporter.stub import build_stub
from gpulens.up.demo_server import MAX_BODY, MAX_ROWS, BadRequest, parse_inputs, request_body
from tests.conftest import REPO, missing

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def stub(tmp_path_factory):
    if shutil.which("gcc") is None:
        missing("gcc not installed")
    return build_stub(tmp_path_factory.mktemp("stub-cache"))


def replica(stub, tmp_path, *args: str) -> subprocess.Popen:
    state = tmp_path / "stub-state"
    state.mkdir(exist_ok=True)
    env = stub.env(GPULENS_STUB_STATE_DIR=str(state), GPULENS_POD_NAME="demo-serve-a", OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "gpulens.up.demo_server", "--libcuda", str(stub.libcuda),
                             "--host-ms", "1", "--kernels", "2", "--kernel-us", "10", *args],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_replica_answers_its_load_over_http_and_reports_the_latency_it_sees(stub, tmp_path):
    p = replica(stub, tmp_path, "--requests", "40", "--report-s", "0.3")
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert re.search(r"demo-server pod=demo-serve-a .* listening on http://127\.0\.0\.1:\d+$", out, re.M)
    lines = re.findall(r"demo-load pod=demo-serve-a requests=(\d+) rps=([\d.]+) p50_ms=([\d.]+) p95_ms=([\d.]+)", out)
    assert lines and int(lines[-1][0]) == 40                       # every request answered 200, counted
    assert all(float(p95) >= float(p50) > 0 for _, _, p50, p95 in lines)
    assert "failed" not in err


def test_bad_requests_get_4xx_with_the_reason_and_the_replica_keeps_serving(stub, tmp_path):
    p = replica(stub, tmp_path, "--no-load")
    try:
        first = p.stdout.readline()                                # waits for the server to listen
        port = int(re.search(r"listening on http://127\.0\.0\.1:(\d+)", first).group(1))

        def post(body: bytes, path: str = "/v1/predict", method: str = "POST") -> tuple[int, dict]:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            c.request(method, path, body=body, headers={"Content-Type": "application/json"})
            r = c.getresponse()
            doc = json.loads(r.read())
            c.close()
            return r.status, doc

        assert post(b"{not json")[0] == 400
        assert post(b'{"inputs": []}')[0] == 400
        assert post(json.dumps({"inputs": [[0.0] * 63]}).encode())[0] == 400
        assert post(json.dumps({"inputs": [[True] * 64]}).encode())[0] == 400
        status, doc = post(json.dumps({"inputs": [[0.0] * 64] * (MAX_ROWS + 1)}).encode())
        assert status == 400 and str(MAX_ROWS) in doc["error"]
        assert post(b"x" * (MAX_BODY + 1))[0] == 413
        assert post(request_body(), path="/v1/predict/../admin")[0] == 404
        assert post(request_body(), method="PUT")[0] == 405
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:   # no Content-Length at all
            s.sendall(b"POST /v1/predict HTTP/1.1\r\nHost: x\r\n\r\n")
            status_line = s.makefile("rb").readline()
            assert status_line.split()[1] == b"411", status_line
        # integers are numbers too (a float model must not 500 on them), and good requests still work
        status, doc = post(json.dumps({"inputs": [[1] * 64]}).encode())
        assert status == 200 and doc["label"] in range(8) and doc["pod"] == "demo-serve-a"
        status, doc = post(request_body(rows=3, seed=7))
        assert status == 200 and doc["label"] in range(8)
        status, health = post(b"", path="/healthz", method="GET")
        assert status == 200 and health["served"] == 2                # only the two good ones were served
        assert p.poll() is None
    finally:
        p.terminate()
        p.wait(timeout=30)


@pytest.mark.parametrize("body", [b"", b"[]", b'{"inputs": 3}', b'{"inputs": [[1, "a"] ]}', b"\xff\xfe",
                                  b'{"inputs": [null]}'])
def test_parse_inputs_refuses_what_is_not_rows_of_64_numbers(body):
    with pytest.raises(BadRequest):
        parse_inputs(body)
