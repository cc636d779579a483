"""`gpulens exporter` as a process: flags, HTTP endpoints, bad requests, shutdown."""

from __future__ import annotations

import glob
import signal
import socket
import subprocess
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import bcc_usable, wait_for
from tests.conftest import requires


def _get(url, headers=None, method="GET"):
    req = urllib.request.Request(url, headers=headers or {}, method=method)
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.status, dict(resp.headers), resp.read()


@pytest.fixture
def run_exporter(gpulens_bin):
    started = []

    def start(*args):
        p = subprocess.Popen([gpulens_bin, "exporter", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
        started.append(p)
        return p
    yield start
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(20)
        p.stdout.close()
        p.stderr.close()


def _ready(url):
    try:
        return _get(url + "/healthz")[0] == 200
    except (urllib.error.URLError, ConnectionError, OSError):
        return False


@pytest.mark.parametrize("args, message", [
    (["--listen", "nowhere"], "--listen must be HOST:PORT"),
    (["--listen", "127.0.0.1:99999"], "--listen must be HOST:PORT"),
    (["--nvml", "sometimes"], "--nvml must be auto, off or stub:DIR"),
])
def test_bad_flags_exit_2_with_a_clear_message(run_exporter, args, message):
    p = run_exporter(*args)
    assert p.wait(60) == 2
    assert message in p.stderr.read()


def test_port_in_use_exits_1(run_exporter, port):
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        p = run_exporter("--listen", f"127.0.0.1:{port}", "--no-ebpf", "--nvml", "off")
        assert p.wait(60) == 1
        err = p.stderr.read()
    assert "event=exporter.listen_failed" in err and f"127.0.0.1:{port}" in err


def test_serves_self_metrics_without_ebpf_and_answers_bad_requests(run_exporter, port):
    url = f"http://127.0.0.1:{port}"
    p = run_exporter("--listen", f"127.0.0.1:{port}", "--no-ebpf", "--nvml", "off", "--node", "n-test")
    wait_for(lambda: _ready(url), timeout=60, what="exporter up")
    status, headers, body = _get(url + "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    fams = {f.name: f for f in text_string_to_metric_families(body.decode())}
    (ebpf_info,) = [s for s in fams["gpulens_exporter_source_info"].samples if s.labels["source"] == "ebpf"]
    assert ebpf_info.labels == {"node": "n-test", "source": "ebpf", "state": "disabled",
                                "reason": "eBPF disabled (--no-ebpf)"}
    _s, om_headers, om = _get(url + "/metrics", {"Accept": "application/openmetrics-text; version=1.0.0"})
    assert om_headers["Content-Type"].startswith("application/openmetrics-text") and om.rstrip().endswith(b"# EOF")
    _s, gz_headers, _b = _get(url + "/metrics", {"Accept-Encoding": "gzip"})
    assert gz_headers.get("Content-Encoding") == "gzip"
    status, _h, health = _get(url + "/healthz")
    assert status == 200 and b'"ebpf": {"state": "disabled"' in health
    for path, method, code in (("/nope", "GET", 404), ("/metrics", "POST", 405), ("/healthz", "DELETE", 405)):
        with pytest.raises(urllib.error.HTTPError) as err:
            _get(url + path, method=method)
        assert err.value.code == code
    # a garbage request line does not take the server down
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"\x16\x03\x01 not http at all\r\n\r\n")
        s.recv(1024)
    assert _ready(url)
    p.send_signal(signal.SIGTERM)
    assert p.wait(30) == 0
    assert "event=exporter.stopped" in p.stderr.read()


@pytest.mark.root
@requires(bcc_usable())
def test_cli_end_to_end_with_probes(run_exporter, port, stub, libcuda, workloads):
    url = f"http://127.0.0.1:{port}"
    p = run_exporter("--listen", f"127.0.0.1:{port}", "--nvml", "off", "--node", "n-e2e", "--scan-interval", "0.2",
                     "--library-glob", glob.escape(str(libcuda.parent)) + "/libcuda.so*")
    wait_for(lambda: _ready(url), timeout=60, what="exporter up")
    w = workloads(libcuda, "--steps", "100", "--kernels", "30", "--h2d-bytes", "1000")

    def attached():
        fams = {f.name: f for f in text_string_to_metric_families(_get(url + "/metrics")[2].decode())}
        return fams["gpulens_exporter_libraries_attached"].samples[0].value == 1
    wait_for(attached, timeout=30, what="library attached")
    w.go()
    rep = w.report()

    def counted():
        fams = {f.name: f for f in text_string_to_metric_families(_get(url + "/metrics")[2].decode())}
        fam = fams.get("gpulens_kernel_launches")
        return fams if fam and fam.samples and fam.samples[0].value == rep["launches"] else None
    fams = wait_for(counted, timeout=30, what="launches counted (next discovery tick)")
    (launches,) = fams["gpulens_kernel_launches"].samples
    assert launches.value == rep["launches"] == 3000
    # no pod and no registration record: no job either (gpulens_job="", never a guess); the process is its own workload
    assert launches.labels == {"node": "n-e2e", "gpu": "unknown", "namespace": "local", "pod": "cuda-workload",
                               "container": "", "gpulens_job": "", "gpulens_workload": "Pod/cuda-workload",
                               "rank": ""}   # no LOCAL_RANK: not a torchrun worker
    assert fams["gpulens_exporter_scrape_duration_seconds"].samples[0].value > 0
    w.finish()
    p.send_signal(signal.SIGINT)
    assert p.wait(30) == 0
    err = p.stderr.read()
    for event in ("exporter.listening", "library.attached", "exporter.stopped"):
        assert f"event={event}" in err
    assert all(line.startswith("ts=") for line in err.splitlines() if line.strip())   # logfmt only
