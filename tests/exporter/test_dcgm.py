"""The DCGM source against a local HTTP server serving recorded dcgm-exporter pages."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import aiohttp
import pytest
from aiohttp import web

from gpulens.exporter.config import ExporterConfig
from gpulens.exporter.dcgm import DcgmParseError, DcgmSource
from gpulens.exporter.health import SourceHealth
from gpulens.exporter.nvml.api import GpuProcess
from gpulens.exporter.nvml.fake import FakeNvml
from gpulens.exporter.service import Exporter

from .conftest import DATA, scrape, value

PAGE = (DATA / "dcgm-exporter-4x.txt").read_text()


class DcgmExporterDouble:
    """Stands for dcgm-exporter's /metrics endpoint: GET /metrics answers the Prometheus text
    format (Content-Type `text/plain; version=0.0.4; charset=utf-8`) with whatever page, status
    or delay the test sets."""

    def __init__(self):
        self.body, self.status, self.delay = PAGE, 200, 0.0
        self.requests = 0

    async def handle(self, request: web.Request) -> web.Response:
        self.requests += 1
        if self.delay:
            await asyncio.sleep(self.delay)
        return web.Response(status=self.status, body=self.body.encode(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


@pytest.fixture
async def dcgm_server():
    double = DcgmExporterDouble()
    app = web.Application()
    app.router.add_get("/metrics", double.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    double.url = f"http://{host}:{port}/metrics"
    yield double
    await runner.cleanup()


def name_pods(page: str, owners: dict[str, list[tuple[str, str, str]]]) -> str:
    """`page` as dcgm-exporter in Kubernetes mode serves it: each sample of GPU `gpu` carries the
    (namespace, pod, container) the kubelet's pod-resources allocated it to; with several (a
    time-sliced GPU) the sample is repeated once per pod, as dcgm-exporter does."""
    out = []
    for line in page.splitlines(keepends=True):
        gpu = line.partition('{gpu="')[2].partition('"')[0] if not line.startswith("#") else ""
        if gpu in owners and 'container="",namespace="",pod=""' in line:
            out += [line.replace('container="",namespace="",pod=""', f'container="{c}",namespace="{ns}",pod="{p}"')
                    for ns, p, c in owners[gpu]]
        else:
            out.append(line)
    return "".join(out)


def source(url="http://127.0.0.1:1/metrics", **kw):
    clock = [0.0]
    src = DcgmSource(url, SourceHealth("dcgm"), clock=lambda: clock[0], **kw)
    return src, clock


def test_recorded_page_fields_units_and_blanks():
    src, _ = source()
    src.ingest(PAGE)
    g = src.snapshot.gauges
    assert g[("gpulens_dcgm_gpu_utilization_ratio", "0")] == pytest.approx(0.87)
    assert g[("gpulens_dcgm_gpu_utilization_ratio", "1")] == pytest.approx(0.12)
    assert g[("gpulens_dcgm_sm_active_ratio", "0")] == pytest.approx(0.803112)
    assert g[("gpulens_dcgm_memory_used_bytes", "0")] == 70871 * 1024 * 1024
    assert g[("gpulens_dcgm_power_watts", "1")] == pytest.approx(88.104)
    assert g[("gpulens_dcgm_temperature_celsius", "0")] == 61
    # blank sentinels are dropped, not exported as 2e9 degrees
    assert ("gpulens_dcgm_temperature_celsius", "1") not in g
    assert ("gpulens_dcgm_sm_active_ratio", "1") not in g
    assert src.blanks_dropped == 2
    assert all(v < 1e12 for v in g.values())


def test_the_pod_dcgm_exporter_names_for_a_gpu_is_kept_per_gpu():
    src, _ = source()
    src.ingest(PAGE)
    assert src.snapshot.pods == {}                  # empty Kubernetes labels: nobody named
    src.ingest(name_pods(PAGE, {"0": [("team-a", "trainer-0", "trainer")],
                                "1": [("team-b", "infer-a", "main"), ("team-b", "infer-b", "main")]}))
    # GPU 1 is time-sliced between two pods: no one owner; its gauges are still read once
    assert src.snapshot.pods == {"0": ("team-a", "trainer-0")}
    assert src.snapshot.gauges[("gpulens_dcgm_gpu_utilization_ratio", "1")] == pytest.approx(0.12)
    src.retarget("http://127.0.0.1:2/metrics")      # another dcgm-exporter: what the old one said is gone
    assert src.snapshot.pods == {}


def test_pcie_rate_gauge_is_integrated_into_a_byte_counter():
    src, clock = source(interval_s=10)
    src.ingest(PAGE)
    assert src.snapshot.pcie_bytes[("0", "tx")] == 0          # nothing known before the first page
    clock[0] = 10.0
    src.ingest(PAGE)
    assert src.snapshot.pcie_bytes[("0", "tx")] == 104857600 * 10
    assert src.snapshot.pcie_bytes[("0", "rx")] == 524288000 * 10
    clock[0] = 1000.0                                        # a long outage is not filled with a guess
    src.ingest(PAGE)
    assert src.snapshot.pcie_bytes[("0", "tx")] == 104857600 * (10 + 30)


def _counter_page(v):
    return ("# TYPE DCGM_FI_PROF_PCIE_TX_BYTES counter\n"
            f'DCGM_FI_PROF_PCIE_TX_BYTES{{gpu="0",UUID="GPU-x"}} {v}\n')


def test_counter_fields_are_differenced_with_resets():
    src, clock = source()
    for t, v in enumerate([1000, 1500, 200, 260]):       # dcgm-exporter restarted before the third page
        clock[0] = float(t)
        src.ingest(_counter_page(v))
    assert src.snapshot.pcie_bytes[("0", "tx")] == 500 + 200 + 60


@pytest.mark.parametrize("page", [
    "DCGM_FI_DEV_GPU_UTIL{gpu=\"0\" 87\n",                    # unterminated labels
    "DCGM_FI_DEV_GPU_UTIL{gpu=\"0\"} eighty-seven\n",
    PAGE[: PAGE.index('UUID="GPU-7e5d') + 8],                  # connection cut mid-line
    "<html><body>502 Bad Gateway</body></html>\n",
])
def test_malformed_page_raises_and_changes_nothing(page):
    src, clock = source()
    src.ingest(PAGE)
    clock[0] = 5
    src.ingest(PAGE)
    before = src.snapshot
    with pytest.raises(DcgmParseError, match="malformed"):
        src.ingest(page)
    assert src.snapshot == before


def test_missing_gpu_label_and_nan_are_skipped():
    src, _ = source()
    src.ingest("DCGM_FI_DEV_GPU_UTIL 55\nDCGM_FI_DEV_GPU_UTIL{gpu=\"\"} 66\nDCGM_FI_DEV_GPU_TEMP{gpu=\"2\"} NaN\n"
               "DCGM_FI_DEV_GPU_TEMP{gpu=\"3\",GPU_I_ID=\"1\"} 44\n")
    assert src.snapshot.gauges == {("gpulens_dcgm_temperature_celsius", "3-mig1"): 44}


async def test_poll_good_bad_and_recovered(dcgm_server):
    src, clock = source(dcgm_server.url)
    async with aiohttp.ClientSession() as session:
        await src.poll(session)
        assert src.health.view()[0] == "ok"
        clock[0] = 10
        await src.poll(session)
        total = src.snapshot.pcie_bytes[("0", "tx")]
        assert total > 0

        dcgm_server.body = "this is { not prometheus"
        await src.poll(session)
        state, reason, errors = src.health.view()
        assert (state, errors) == ("failing", 1) and "malformed" in reason
        assert src.snapshot.gauges == {} and src.snapshot.pods == {}    # stale gauges are not served
        assert src.snapshot.pcie_bytes[("0", "tx")] == total           # accumulated bytes are kept

        dcgm_server.body, dcgm_server.status = PAGE, 503
        await src.poll(session)
        assert src.health.view()[1] == "dcgm-exporter answered HTTP 503"

        dcgm_server.status = 200
        clock[0] = 20
        await src.poll(session)
        assert src.health.view()[0] == "ok"
        assert src.snapshot.pcie_bytes[("0", "tx")] > total


async def test_unreachable_and_slow_endpoints(dcgm_server):
    src, _ = source("http://127.0.0.1:9/metrics")
    async with aiohttp.ClientSession() as session:
        await src.poll(session)
        assert src.health.view()[0] == "failing"
        slow = DcgmSource(dcgm_server.url, SourceHealth("dcgm"), timeout_s=0.2)
        dcgm_server.delay = 1.0
        await slow.poll(session)
        assert slow.health.view()[0] == "failing"


async def test_a_page_that_arrives_in_pieces_is_read_whole():
    """A page sent in several writes (busybox httpd on the test cluster, Go's net/http for large
    pages) is read to its end: one read of the stream returns only what has arrived, and a page cut
    mid-line was reported "malformed" (found by tests/cluster/test_3_dcgm.py)."""
    async def handle(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
        await resp.prepare(request)
        body, cut = PAGE.encode(), len(PAGE) // 2
        await resp.write(body[:cut])
        await asyncio.sleep(0.05)        # the client's read runs meanwhile and finds half a page
        await resp.write(body[cut:])
        await resp.write_eof()
        return resp
    app = web.Application()
    app.router.add_get("/metrics", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        src, _ = source(f"http://{host}:{port}/metrics")
        async with aiohttp.ClientSession() as session:
            await src.poll(session)
    finally:
        await runner.cleanup()
    assert src.health.view()[0] == "ok", src.health.view()
    full, _ = source()
    full.ingest(PAGE)
    assert src.snapshot.gauges == full.snapshot.gauges and src.snapshot.pcie_bytes == full.snapshot.pcie_bytes


async def test_oversized_page_is_refused(dcgm_server, monkeypatch):
    import gpulens.exporter.dcgm as dcgm
    monkeypatch.setattr(dcgm, "MAX_BODY", 1000)
    src, _ = source(dcgm_server.url)
    async with aiohttp.ClientSession() as session:
        await src.poll(session)
    assert "larger than 1000 bytes" in src.health.view()[1]


async def test_exporter_relabels_device_fields_with_the_gpus_only_pod(dcgm_server, tmp_path):
    """GPU 0 runs one pod -> its DCGM fields carry that pod; GPU 1 is shared -> pod stays empty.
    NVML's view wins over the pod dcgm-exporter names (here a stale allocation on both GPUs)."""
    dcgm_server.body = name_pods(PAGE, {"0": [("team-z", "stale", "c")], "1": [("team-z", "stale", "c")]})
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(3)]
    try:
        fake = FakeNvml(gpus=2)
        fake.processes[0] = [GpuProcess(procs[0].pid, 1 << 30)]
        fake.processes[1] = [GpuProcess(procs[1].pid, 1 << 20), GpuProcess(procs[2].pid, 1 << 20)]
        reg = tmp_path / "reg"
        from .conftest import registration
        registration(reg, procs[0].pid, "solo")
        registration(reg, procs[1].pid, "shared-a")
        registration(reg, procs[2].pid, "shared-b")
        cfg = ExporterConfig(node="n1", ebpf=False, dcgm_url=dcgm_server.url, registry_dir=reg, nvml="off")
        exp = Exporter(cfg, nvml_opener=lambda: fake)
        exp.start()
        try:
            async with aiohttp.ClientSession() as session:
                await exp.dcgm.poll(session)
            await asyncio.to_thread(exp.tick)
            s = await asyncio.to_thread(scrape, exp)
            assert value(s, "gpulens_dcgm_gpu_utilization_ratio", gpu="0", pod="solo", namespace="team-a",
                         gpulens_job="job1") == pytest.approx(0.87)
            assert value(s, "gpulens_dcgm_gpu_utilization_ratio", gpu="1", pod="", namespace="",
                         gpulens_job="") == pytest.approx(0.12)
            assert value(s, "gpulens_dcgm_pcie_bytes_total", gpu="0", direction="tx", pod="solo", gpulens_job="job1") == 0
            assert value(s, "gpulens_gpu_pods", gpu="1") == 2
            assert value(s, "gpulens_exporter_source_up", source="dcgm") == 1
        finally:
            exp.close()
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
