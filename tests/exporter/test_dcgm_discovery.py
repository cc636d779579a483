"""dcgm-exporter found on this node with no URL: the real `kubernetes` client against kmock (a
Kubernetes API emulator over HTTP, which filters neither by label nor by field selector, so the
finder's own checks are what keep other pods out), and dcgm-exporter doubles on loopback."""

from __future__ import annotations

import asyncio
import uuid

import aiohttp
import pytest
from aiohttp import web

from gpulens.exporter.command import config_from_args, configure
from gpulens.exporter.config import ExporterConfig
from gpulens.exporter.dcgm_discovery import DcgmFinder, endpoint_of_pod
from gpulens.exporter.service import Exporter

from .conftest import scrape, value
from .test_dcgm import PAGE, DcgmExporterDouble, name_pods
from .test_kube import api_factory, eventually, pod

NODE = "node-a"
OPERATOR = {"app": "nvidia-dcgm-exporter", "controller-revision-hash": "5d4f"}
STANDALONE = {"app.kubernetes.io/name": "dcgm-exporter", "app.kubernetes.io/instance": "dcgm"}


def dcgm_pod(name: str, *, labels: dict, node: str = NODE, namespace: str = "gpu-operator", ready: bool = True,
             ip: str = "127.0.0.1", port: int = 9400, port_name: str = "metrics", host_network: bool = False,
             host_ip: str = "192.0.2.7", uid: str | None = None) -> dict:
    """A dcgm-exporter pod as the API returns it (GPU Operator / standalone chart DaemonSet pod)."""
    spec = {"nodeName": node, "containers": [{"name": "nvidia-dcgm-exporter", "image": "nvcr.io/nvidia/k8s/dcgm-exporter",
                                              "ports": [{"name": port_name, "containerPort": port, "protocol": "TCP"}]}]}
    if host_network:
        spec["hostNetwork"] = True
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "uid": uid or str(uuid.uuid4()), "labels": labels,
                     "resourceVersion": "1"},
        "spec": spec,
        "status": {"phase": "Running", "hostIP": host_ip, "podIP": host_ip if host_network else ip,
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def finder(kmock, **kw) -> DcgmFinder:
    return DcgmFinder(api_factory(kmock), NODE, watch_timeout_s=2, read_timeout_s=3, backoff_s=(0.1, 0.2), **kw)


@pytest.fixture
async def running(kmock):
    kmock.resources["v1/pods"] = {}
    made: list[DcgmFinder] = []

    def start(**kw) -> DcgmFinder:
        f = finder(kmock, **kw)
        made.append(f)
        f.start()
        return f
    yield start
    for f in made:
        await asyncio.to_thread(f.stop)


async def settled(f: DcgmFinder, state: str | None = None):
    await eventually(lambda: all(idx.synced.is_set() for _, idx in f._indexes) and
                     (state is None or f.find().state == state))
    return f.find()


# ---- one pod as the API describes it --------------------------------------------------------------

@pytest.mark.parametrize("labels", [OPERATOR, STANDALONE])
def test_endpoint_of_either_label_sets_pod(labels):
    ep = endpoint_of_pod(dcgm_pod("d-1", labels=labels, ip="10.2.3.4"))
    assert ep.url == "http://10.2.3.4:9400/metrics" and ep.ready and ep.node == NODE and not ep.host_network


def test_host_network_pod_is_reached_on_the_hosts_address():
    pod = dcgm_pod("d-1", labels=OPERATOR, host_network=True, host_ip="192.0.2.7")
    del pod["status"]["podIP"]          # on the host network the address is the node's, whatever podIP says
    ep = endpoint_of_pod(pod)
    assert ep.url == "http://192.0.2.7:9400/metrics" and ep.host_network


def test_endpoint_edge_cases():
    assert endpoint_of_pod(dcgm_pod("d", labels=OPERATOR, ip="fd00::5")).url == "http://[fd00::5]:9400/metrics"
    assert endpoint_of_pod(dcgm_pod("d", labels=OPERATOR, port_name="http")).url is None
    assert not endpoint_of_pod(dcgm_pod("d", labels=OPERATOR, ready=False)).ready
    terminating = dcgm_pod("d", labels=OPERATOR)
    terminating["metadata"]["deletionTimestamp"] = "2026-12-04T15:00:00Z"
    assert not endpoint_of_pod(terminating).ready
    no_ip = dcgm_pod("d", labels=OPERATOR)
    del no_ip["status"]["podIP"]
    assert endpoint_of_pod(no_ip).url is None
    assert endpoint_of_pod({"metadata": {}}) is None and endpoint_of_pod(None) is None
    bare = endpoint_of_pod({"metadata": {"uid": "u", "labels": "junk"}, "spec": {"containers": [{"ports": None}]}})
    assert bare.url is None and not bare.ready and bare.labels == ()


# ---- the finder against the API -------------------------------------------------------------------

@pytest.mark.parametrize("labels", [OPERATOR, STANDALONE])
async def test_finds_the_ready_pod_on_this_node_by_either_label_set(kmock, running, labels):
    kmock.objects["v1/pods", "monitoring", "dcgm-here"] = dcgm_pod("dcgm-here", labels=labels, namespace="monitoring",
                                                                   ip="10.0.0.5")
    # ignored: the same label set on another node, a not-ready one here, a pod here with a metrics
    # port but neither label set
    kmock.objects["v1/pods", "monitoring", "dcgm-there"] = dcgm_pod("dcgm-there", labels=labels, node="node-b",
                                                                    namespace="monitoring", ip="10.0.0.6")
    kmock.objects["v1/pods", "monitoring", "dcgm-sick"] = dcgm_pod("dcgm-sick", labels=labels, ready=False,
                                                                   namespace="monitoring", ip="10.0.0.7")
    kmock.objects["v1/pods", "default", "web"] = dcgm_pod("web", labels={"app": "web"}, namespace="default",
                                                          ip="10.0.0.8")
    f = running()
    found = await settled(f)
    assert (found.url, found.state) == ("http://10.0.0.5:9400/metrics", "ok")
    assert "monitoring/dcgm-here" in found.reason and "status.podIP" in found.reason
    pod_requests = [r for r in kmock["get"] if "/pods" in str(r.url)]
    assert {r.params.get("labelSelector") for r in pod_requests} == \
        {"app=nvidia-dcgm-exporter", "app.kubernetes.io/name=dcgm-exporter"}
    assert all(r.params.get("fieldSelector") == f"spec.nodeName={NODE}" for r in pod_requests)
    assert all(str(r.url.path) == "/api/v1/pods" for r in pod_requests)      # cluster-wide by default


async def test_host_network_pod_found_on_the_hosts_address(kmock, running):
    kmock.objects["v1/pods", "gpu-operator", "nvidia-dcgm-exporter-x"] = dcgm_pod(
        "nvidia-dcgm-exporter-x", labels=OPERATOR, host_network=True, host_ip="192.0.2.7")
    found = await settled(running(), "ok")
    assert found.url == "http://192.0.2.7:9400/metrics" and "host network" in found.reason


async def test_only_the_named_namespaces_are_asked(kmock, running):
    kmock.objects["v1/pods", "elsewhere", "dcgm-1"] = dcgm_pod("dcgm-1", labels=OPERATOR, namespace="elsewhere",
                                                               ip="10.0.0.9")
    f = running(namespaces=("gpu-operator",))
    found = await settled(f)
    assert found.url is None and found.state == "disabled"
    assert "namespaces gpu-operator" in found.reason and "app=nvidia-dcgm-exporter" in found.reason
    paths = {str(r.url.path) for r in kmock["get"] if "/pods" in str(r.url)}
    assert paths == {"/api/v1/namespaces/gpu-operator/pods"}
    kmock.objects["v1/pods", "gpu-operator", "dcgm-2"] = dcgm_pod("dcgm-2", labels=OPERATOR, ip="10.0.0.10")
    base = str(kmock.url).rstrip("/")
    async with aiohttp.ClientSession() as s:       # arrives through the namespaced watch
        r = await s.post(f"{base}/api/v1/namespaces/gpu-operator/pods",
                         json=dcgm_pod("dcgm-3", labels=OPERATOR, ip="10.0.0.11"))
        assert r.status < 300
    await eventually(lambda: f.find().url is not None)
    assert f.find().url in ("http://10.0.0.10:9400/metrics", "http://10.0.0.11:9400/metrics")


async def test_operator_pod_is_preferred_when_both_shapes_run_here(kmock, running):
    kmock.objects["v1/pods", "a-first", "standalone"] = dcgm_pod("standalone", labels=STANDALONE, namespace="a-first",
                                                                 ip="10.0.0.2")
    kmock.objects["v1/pods", "gpu-operator", "operator"] = dcgm_pod("operator", labels=OPERATOR, ip="10.0.0.3")
    assert (await settled(running(), "ok")).url == "http://10.0.0.3:9400/metrics"


async def test_why_nothing_was_found(kmock, running):
    kmock.objects["v1/pods", "gpu-operator", "sick"] = dcgm_pod("sick", labels=OPERATOR, ready=False)
    found = await settled(running())
    assert found.url is None and found.state == "waiting" and "gpu-operator/sick" in found.reason \
        and "not ready" in found.reason


async def test_api_refusal_is_failing_with_the_reason(kmock, running):
    kmock["list"] << 403
    f = running()
    await eventually(lambda: f.errors >= 2)
    found = f.find()
    assert found.url is None and found.state == "failing" and "403" in found.reason


# ---- the exporter follows the pod ----------------------------------------------------------------

@pytest.fixture
async def dcgm_servers():
    """Two dcgm-exporter doubles on loopback: the pod before and after its restart."""
    runners, doubles = [], []
    for _ in range(2):
        double = DcgmExporterDouble()
        app = web.Application()
        app.router.add_get("/metrics", double.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        double.port = runner.addresses[0][1]
        runners.append(runner)
        doubles.append(double)
    yield doubles
    for r in runners:
        await r.cleanup()


async def test_exporter_joins_the_found_dcgm_exporter_and_follows_its_restart(kmock, dcgm_servers, running):
    first, second = dcgm_servers
    second.body = PAGE.replace('} 87\n', '} 42\n')               # GPU 0 utilisation 42% after the restart
    kmock.resources["v1/pods"] = {}
    kmock.objects["v1/pods", "gpu-operator", "nvidia-dcgm-exporter-a"] = dcgm_pod(
        "nvidia-dcgm-exporter-a", labels=OPERATOR, port=first.port)
    kmock.objects["v1/pods", "gpu-operator", "decoy"] = dcgm_pod("decoy", labels=OPERATOR, node="node-b",
                                                                 port=second.port)
    f = finder(kmock)
    cfg = ExporterConfig(node=NODE, ebpf=False, nvml="off", dcgm_interval_s=0.1, dcgm_discovery=True)
    exp = Exporter(cfg, dcgm_finder=f)
    await asyncio.to_thread(exp.start)
    stop = asyncio.Event()
    task = asyncio.create_task(exp.run_background(stop))
    base = str(kmock.url).rstrip("/")

    def util():
        return value(scrape(exp), "gpulens_dcgm_gpu_utilization_ratio", gpu="0")

    def info():
        (labels,) = [dict(ls) for (n, ls) in scrape(exp)
                     if n == "gpulens_exporter_source_info" and ("source", "dcgm") in ls]
        return labels["state"], labels["reason"]
    try:
        await eventually(lambda: util() == pytest.approx(0.87))
        state, reason = info()
        assert state == "ok" and "gpu-operator/nvidia-dcgm-exporter-a" in reason and str(first.port) in reason
        assert second.requests == 0                                          # the other node's is never asked
        async with aiohttp.ClientSession() as s:
            r = await s.delete(f"{base}/api/v1/namespaces/gpu-operator/pods/nvidia-dcgm-exporter-a")
            assert r.status < 300
            await eventually(lambda: info()[0] == "disabled")
            assert util() is None                                             # no stale device gauges
            # the DaemonSet's replacement: a new pod (new uid, new address), first not ready
            r = await s.post(f"{base}/api/v1/namespaces/gpu-operator/pods", json=dcgm_pod(
                "nvidia-dcgm-exporter-b", labels=OPERATOR, port=second.port, ready=False))
            assert r.status < 300
            await eventually(lambda: info()[0] == "waiting" and "not ready" in info()[1])
            assert second.requests == 0
            r = await s.patch(f"{base}/api/v1/namespaces/gpu-operator/pods/nvidia-dcgm-exporter-b",
                              json={"status": {"conditions": [{"type": "Ready", "status": "True"}]}},
                              headers={"Content-Type": "application/merge-patch+json"})
            assert r.status < 300
        await eventually(lambda: util() == pytest.approx(0.42))
        state, reason = info()
        assert state == "ok" and "nvidia-dcgm-exporter-b" in reason and str(second.port) in reason
    finally:
        stop.set()
        await task
        await asyncio.to_thread(exp.close)


async def test_without_nvml_the_pod_dcgm_exporter_names_gets_the_device_fields(kmock, dcgm_servers, running):
    """No NVML in the exporter's container (nothing says which process runs on which GPU): the pod
    dcgm-exporter names for GPU 0 (from the kubelet's pod-resources) is joined with this node's pod
    index, which gives its job and workload; a pod the index does not know keeps its name only."""
    from gpulens.exporter.kube import PodIndex
    first, _ = dcgm_servers
    first.body = name_pods(PAGE, {"0": [("ml", "trainer-7x2", "trainer")], "1": [("ml", "gone-pod", "c")]})
    kmock.resources["v1/pods"] = {}
    kmock.objects["v1/pods", "gpu-operator", "nvidia-dcgm-exporter-a"] = dcgm_pod(
        "nvidia-dcgm-exporter-a", labels=OPERATOR, port=first.port)
    kmock.objects["v1/pods", "ml", "trainer-7x2"] = pod("trainer-7x2", str(uuid.uuid4()), NODE, namespace="ml",
                                                        labels={"job-name": "trainer"})
    pods = PodIndex(api_factory(kmock), NODE, watch_timeout_s=2, read_timeout_s=3, backoff_s=(0.1, 0.2))
    cfg = ExporterConfig(node=NODE, ebpf=False, nvml="off", dcgm_interval_s=0.1, dcgm_discovery=True)
    exp = Exporter(cfg, dcgm_finder=finder(kmock), pod_index=pods, nvml_opener=None)
    await asyncio.to_thread(exp.start)
    stop = asyncio.Event()
    task = asyncio.create_task(exp.run_background(stop))

    def util(**labels):
        return value(scrape(exp), "gpulens_dcgm_gpu_utilization_ratio", **labels)
    try:
        await eventually(lambda: pods.synced.is_set() and util(gpu="0") is not None)
        assert util(gpu="0", namespace="ml", pod="trainer-7x2", gpulens_job="trainer",
                    gpulens_workload="job/trainer") == pytest.approx(0.87)
        assert util(gpu="1", namespace="ml", pod="gone-pod", gpulens_job="",
                    gpulens_workload="Pod/gone-pod") == pytest.approx(0.12)
        assert value(scrape(exp), "gpulens_dcgm_pcie_bytes_total", gpu="0", direction="tx",
                     pod="trainer-7x2", gpulens_job="trainer") is not None
    finally:
        stop.set()
        await task
        await asyncio.to_thread(exp.close)


# ---- flags ---------------------------------------------------------------------------------------

def _args(*argv):
    import argparse
    p = argparse.ArgumentParser()
    configure(p)
    return config_from_args(p.parse_args(list(argv)))


def test_flags_decide_discovery(monkeypatch):
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    cfg = _args("--dcgm-namespace", "gpu-operator", "--dcgm-namespace", "monitoring")
    assert cfg.dcgm_discovery and cfg.dcgm_namespaces == ("gpu-operator", "monitoring")
    assert _args("--no-kubernetes").dcgm_discovery                   # attribution off, discovery still asks
    url = _args("--dcgm-url", "http://10.0.0.1:9400/metrics")
    assert not url.dcgm_discovery and url.dcgm_discovery_off == "--dcgm-url given"
    off = _args("--no-dcgm-discovery")
    assert not off.dcgm_discovery and "--no-dcgm-discovery" in off.dcgm_discovery_off
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    outside = _args()
    assert not outside.dcgm_discovery and "no Kubernetes API" in outside.dcgm_discovery_off


def test_dcgm_url_wins_over_discovery():
    cfg = ExporterConfig(node=NODE, ebpf=False, nvml="off", dcgm_url="http://127.0.0.1:9/metrics", dcgm_discovery=True)
    exp = Exporter(cfg)
    assert exp.dcgm_finder is None and exp.dcgm.url == "http://127.0.0.1:9/metrics"
    off = Exporter(ExporterConfig(node=NODE, ebpf=False, nvml="off", dcgm_discovery_off="discovery off (test)"))
    assert off.dcgm is None and off.health["dcgm"].view()[:2] == ("disabled", "discovery off (test)")


def test_a_new_dcgm_exporter_counts_from_zero_and_totals_never_drop():
    from gpulens.exporter.dcgm import DcgmSource
    from gpulens.exporter.health import SourceHealth
    from .test_dcgm import _counter_page
    src = DcgmSource("http://10.0.0.1:9400/metrics", SourceHealth("dcgm"), clock=lambda: 0.0)
    src.ingest(_counter_page(1000))
    src.ingest(_counter_page(1500))
    src.retarget("http://10.0.0.2:9400/metrics")     # the new pod has counted 1800 bytes since it started
    assert src.snapshot.gauges == {}
    src.ingest(_counter_page(1800))
    assert src.snapshot.pcie_bytes[("0", "tx")] == 500 + 1800
