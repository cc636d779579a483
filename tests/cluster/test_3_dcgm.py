"""DCGM found with no URL (issue 29): the chart installed with its default values (no `dcgmUrl`,
discovery on) finds a dcgm-exporter stand-in with the GPU Operator's labels on the node, joins its
device counters to the trainer's pod, ignores a not-ready one, and follows the stand-in when it is
deleted and comes back under a new name and address, as a DaemonSet's pod does.

There is no GPU here: the stand-ins are the toolbox's busybox httpd serving recorded dcgm-exporter
text (tests/exporter/data/dcgm-exporter-4x.txt) whose Kubernetes labels name, for GPU 0, the pod
the GPU would be allocated to, as dcgm-exporter does in Kubernetes mode. Each page sets its own
GPU_UTIL so the exporter's value says which page it scraped. The not-ready one sorts first and
names another pod: if readiness were not checked, it would win and its names would show."""

from __future__ import annotations

import re
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from .harness import BB, NODE, NS, pod_logs, wait_until
from .workload import JOB, start_trainer

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(1800)]

NODE_IP = "10.244.0.1"
EXPORTER = f"http://{NODE_IP}:9450/metrics"
RECORDED = Path(__file__).resolve().parents[1] / "exporter" / "data" / "dcgm-exporter-4x.txt"
#: the GPU Operator's shape: pod label and container port name (exporter/dcgm_discovery.py)
OPERATOR_LABELS = {"app": "nvidia-dcgm-exporter"}
PORT = 9400
#: the not-ready one sorts before every stand-in name (the finder takes the first usable by name)
DECOY, STAND_IN, STAND_IN_2 = "nvidia-dcgm-exporter-not-ready", "nvidia-dcgm-exporter-stand-in", "nvidia-dcgm-exporter-stand-in-2"
DECOY_POD = "decoy-trainer-0"
#: GPU 0's DCGM_FI_DEV_GPU_UTIL (%) on each page
UTIL = {"stand-in": 71, "stand-in-2": 42, "decoy": 13}


def page(namespace: str, pod: str, util: int) -> str:
    """The recorded page with GPU 0 allocated to `namespace`/`pod` and its GPU_UTIL set to `util`."""
    out, named = [], 0
    for line in RECORDED.read_text().splitlines():
        if line.startswith("DCGM_") and '{gpu="0",' in line:
            line, n = re.subn(r'container="",namespace="",pod=""',
                              f'container="trainer",namespace="{namespace}",pod="{pod}"', line)
            named += n
            if line.startswith("DCGM_FI_DEV_GPU_UTIL{"):
                line = f"{line.rsplit(' ', 1)[0]} {util}"
        out.append(line)
    assert named >= 10, f"the recording changed: {named} GPU 0 samples with empty pod labels"
    return "\n".join(out) + "\n"


def _series(prefix: str) -> list[tuple[str, dict, float]]:
    from prometheus_client.parser import text_string_to_metric_families
    text = urllib.request.urlopen(EXPORTER, timeout=10).read().decode()
    return [(s.name, s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name.startswith(prefix)]


def _dcgm_source() -> tuple[str, str]:
    """The exporter's (state, reason) for source `dcgm`."""
    (labels,) = [lbl for _, lbl, _ in _series("gpulens_exporter_source_info") if lbl["source"] == "dcgm"]
    return labels["state"], labels["reason"]


def _gpu0_util() -> dict | None:
    got = [(lbl, v) for _, lbl, v in _series("gpulens_dcgm_gpu_utilization_ratio") if lbl["gpu"] == "0"]
    return {**got[0][0], "value": got[0][1]} if got else None


def _namespace(api, prefix: str) -> str:
    from kubernetes import client
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    api.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    return name


def _delete_and_wait(api, names: list[str]) -> None:
    """Delete the namespaces and wait until they are gone: a later module's 'no 403' check must not
    meet the operator refused in a namespace still terminating."""
    from kubernetes.client.rest import ApiException
    for n in names:
        try:
            api.delete_namespace(n)
        except ApiException as e:
            if e.status != 404:
                raise

    def gone(n: str) -> bool:
        try:
            api.read_namespace(n)
        except ApiException as e:
            return e.status == 404
        return False
    wait_until(f"namespaces {names} deleted", lambda: all(gone(n) for n in names), 300, 1)


def dcgm_pod(name: str, image: str, key: str, *, ready_path: str = "/metrics") -> dict:
    """A dcgm-exporter as the GPU Operator runs it (label, port `metrics` 9400), serving ConfigMap
    key `key` at /metrics; Ready when `ready_path` answers 200."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": dict(OPERATOR_LABELS)},
            "spec": {"terminationGracePeriodSeconds": 1, "enableServiceLinks": False,
                     "automountServiceAccountToken": False, "nodeSelector": {"kubernetes.io/hostname": NODE},
                     "containers": [{
                         "name": "nvidia-dcgm-exporter", "image": image, "imagePullPolicy": "Never",
                         "command": [BB, "httpd", "-f", "-p", str(PORT), "-h", "/www"],
                         "ports": [{"name": "metrics", "containerPort": PORT, "protocol": "TCP"}],
                         "readinessProbe": {"httpGet": {"path": ready_path, "port": "metrics"},
                                            "periodSeconds": 1, "failureThreshold": 1},
                         "volumeMounts": [{"name": "page", "mountPath": "/www", "readOnly": True}]}],
                     "volumes": [{"name": "page", "configMap": {"name": "dcgm-pages",
                                                                "items": [{"key": key, "path": "metrics"}]}}]}}


def _running(api, ns: str, name: str, ready: bool):
    p = api.read_namespaced_pod(name, ns)
    st = p.status.container_statuses or []
    ok = (p.status.phase == "Running" and p.status.pod_ip and st and st[0].state.running
          and all(c.ready == ready for c in st))
    return p if ok else None


def _fetch(ip: str) -> str:
    return urllib.request.urlopen(f"http://{ip}:{PORT}/metrics", timeout=5).read().decode()


@dataclass
class Setup:
    trainer_ns: str
    trainer_pod: str
    dcgm_ns: str
    toolbox: str
    decoy_ip: str


@pytest.fixture(scope="module")
def setup(release, api, gpulens_image, toolbox):
    """The trainer (its own namespace, unarmed: arming plays no part in the join) and, in a
    namespace like the GPU Operator's, the pages and the not-ready dcgm-exporter. Both namespaces
    are deleted, and waited on, at the end."""
    from kubernetes import client
    made: list[str] = []
    try:
        made.append(_namespace(api, "ml-dcgm"))
        made.append(_namespace(api, "gpu-operator"))
        trainer_ns, dcgm_ns = made
        pod = start_trainer(api, trainer_ns, gpulens_image).metadata.name
        api.create_namespaced_config_map(dcgm_ns, client.V1ConfigMap(
            metadata=client.V1ObjectMeta(name="dcgm-pages"),
            data={"stand-in": page(trainer_ns, pod, UTIL["stand-in"]),
                  "stand-in-2": page(trainer_ns, pod, UTIL["stand-in-2"]),
                  "decoy": page(trainer_ns, DECOY_POD, UTIL["decoy"])}))
        api.create_namespaced_pod(dcgm_ns, dcgm_pod(DECOY, toolbox, "decoy", ready_path="/never-ready"))
        decoy = wait_until("the not-ready dcgm-exporter serving", lambda: (
            lambda p: p and f'pod="{DECOY_POD}"' in _fetch(p.status.pod_ip) and p)(
            _running(api, dcgm_ns, DECOY, ready=False)), 120, 1)
        yield Setup(trainer_ns, pod, dcgm_ns, toolbox, decoy.status.pod_ip)
    finally:
        _delete_and_wait(api, made)


def test_the_chart_defaults_give_no_url_and_look_for_dcgm(release, api):
    """The release (the README's install) runs the exporter with no --dcgm-url and discovery on."""
    from kubernetes import client
    (ds,) = [d for d in client.AppsV1Api(api.api_client).list_namespaced_daemon_set(NS).items
             if (d.metadata.labels or {}).get("app.kubernetes.io/component") == "node"]
    (exporter,) = [c for c in ds.spec.template.spec.containers if c.name == "exporter"]
    args = exporter.args or []
    assert not [a for a in args if a.startswith(("--dcgm-url", "--no-dcgm-discovery", "--dcgm-namespace"))], args


def test_a_not_ready_dcgm_exporter_is_seen_and_not_scraped(setup):
    """Only the not-ready one runs: the exporter sees it (it names it) and scrapes nothing, though
    the pod serves its page (setup fetched it)."""
    state, reason = wait_until("the exporter names the not-ready pod", lambda: (
        lambda s: DECOY in s[1] and s)(_dcgm_source()), 120, 1)
    assert state == "waiting" and f"{setup.dcgm_ns}/{DECOY} on {NODE} not ready" in reason, reason
    assert _gpu0_util() is None


@pytest.fixture(scope="module")
def stand_in(setup, api):
    """The ready stand-in, next to the not-ready one; its pod."""
    api.create_namespaced_pod(setup.dcgm_ns, dcgm_pod(STAND_IN, setup.toolbox, "stand-in"))
    return wait_until("the stand-in Ready", lambda: _running(api, setup.dcgm_ns, STAND_IN, ready=True), 120, 1)


def _joined(setup, util: int, name: str, ip: str):
    """GPU 0's series once they come from pod `name` at `ip` (its GPU_UTIL): all gpulens_dcgm_* series."""
    found = _gpu0_util()
    state, reason = _dcgm_source()
    if not (found and found["value"] == pytest.approx(util / 100) and state == "ok"
            and f"{setup.dcgm_ns}/{name} on {NODE}" in reason and f"http://{ip}:{PORT}/metrics" in reason):
        return None
    return _series("gpulens_dcgm_")


def _check_join(setup, series: list) -> None:
    gpu0 = [(n, lbl) for n, lbl, _ in series if lbl["gpu"] == "0"]
    names = {n for n, _ in gpu0}
    assert {"gpulens_dcgm_gpu_utilization_ratio", "gpulens_dcgm_power_watts", "gpulens_dcgm_memory_used_bytes",
            "gpulens_dcgm_pcie_bytes_total"} <= names, names
    for n, lbl in gpu0:
        assert (lbl["namespace"], lbl["pod"], lbl["node"]) == (setup.trainer_ns, setup.trainer_pod, NODE), (n, lbl)
        # job and workload from the exporter's own pod index: it knows the trainer's pod
        assert (lbl["gpulens_job"], lbl["gpulens_workload"]) == (JOB, f"job/{JOB}"), (n, lbl)
    # GPU 1 is allocated to no pod on the page: its series name none
    gpu1 = [lbl for _, lbl, _ in series if lbl["gpu"] == "1"]
    assert gpu1 and all(lbl["pod"] == "" and lbl["namespace"] == "" for lbl in gpu1), gpu1


def _nothing_of_the_decoy(series: list) -> None:
    assert not [(n, lbl) for n, lbl, _ in series if DECOY_POD in lbl.values()], "the not-ready pod's page was used"


def test_the_stand_ins_counters_join_the_trainers_pod_with_no_url(setup, stand_in):
    series = wait_until("GPU 0's DCGM series from the stand-in", lambda: _joined(
        setup, UTIL["stand-in"], STAND_IN, stand_in.status.pod_ip), 120, 1)
    _check_join(setup, series)
    _nothing_of_the_decoy(series)
    assert _dcgm_source()[1].startswith(f"found {setup.dcgm_ns}/{STAND_IN} on {NODE} (status.podIP)")


def test_the_join_goes_with_the_pod_and_comes_back_from_its_replacement(setup, stand_in, api):
    """Deleted, the stand-in's series vanish (only the not-ready one is left); its replacement (a new
    name and address, as a DaemonSet's) is found and joined again, from its own page."""
    api.delete_namespaced_pod(STAND_IN, setup.dcgm_ns)

    def gone():
        state, reason = _dcgm_source()
        return state != "ok" and _gpu0_util() is None and (state, reason)
    state, reason = wait_until("the stand-in's series gone", gone, 120, 1)
    assert state == "waiting" and DECOY in reason, (state, reason)

    from kubernetes.client.rest import ApiException

    def deleted():
        try:
            api.read_namespaced_pod(STAND_IN, setup.dcgm_ns)
        except ApiException as e:
            return e.status == 404
        return False
    wait_until("the stand-in deleted", deleted, 120, 1)
    api.create_namespaced_pod(setup.dcgm_ns, dcgm_pod(STAND_IN_2, setup.toolbox, "stand-in-2"))
    new = wait_until("the replacement Ready", lambda: _running(api, setup.dcgm_ns, STAND_IN_2, ready=True), 120, 1)
    assert new.status.pod_ip != stand_in.status.pod_ip, "the replacement got the old address: not a move"
    series = wait_until("GPU 0's DCGM series from the replacement", lambda: _joined(
        setup, UTIL["stand-in-2"], STAND_IN_2, new.status.pod_ip), 120, 1)
    _check_join(setup, series)
    _nothing_of_the_decoy(series)


def test_finding_dcgm_met_no_403(setup, api):
    """The chart's RBAC covers discovery's list and watch of pods in every namespace: no line of the
    exporter's log says 403, and the dcgm source counted no API error."""
    log = pod_logs(api, NS, "app.kubernetes.io/component=node", container="exporter")
    assert log.strip(), "no exporter log to check"
    bad = [line for line in log.splitlines() if " 403" in line or "Forbidden" in line or '"403' in line]
    assert bad == [], bad[:5]
