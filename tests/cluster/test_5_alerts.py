"""The alert loop with a Prometheus and an Alertmanager outside the cluster (Debian's packages, run
by the `monitoring` fixture with cluster/monitoring.py's configs): Prometheus discovers the node
DaemonSet through the API as a read-only ServiceAccount and scrapes it; the project's rules
(time-scaled like `gpulens up`) learn a two-worker trainer's baseline; a host_sync incident
switched on in the trainer fires GPUWorkloadHostSync for its pod; Alertmanager calls the gateway
Service; the capture runs on the agent pod, both ranks' traces land in S3 and the manifest names
them and the alert. Without the gateway token Alertmanager's call is refused with 401 and starts
nothing."""

from __future__ import annotations

import json
import re
import shutil
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

import pytest

from tests import rule_signals

from .conftest import WRONG_TOKEN_LABEL
from .harness import NS, STATE, forbidden_in_logs, pod_log, pod_logs, wait_until
from .workload import JOB, armed_namespace, call, start_trainer

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(3600)]

ALERT, WORKLOAD = "GPUWorkloadHostSync", f"job/{JOB}"


@dataclass
class Trainer:
    namespace: str
    pod: str
    control: object         # the host folder whose `incident` file the trainer reads


@pytest.fixture(scope="module")
def trainer(release, api, gpulens_image, monitoring):
    ns = armed_namespace(api)
    control = STATE / "control" / ns           # under the cluster's state: `down` removes it
    control.mkdir(parents=True)
    (control / "incident").write_text("none")
    try:
        pod = start_trainer(api, ns, gpulens_image, control_dir=str(control))
        yield Trainer(ns, pod.metadata.name, control)
    finally:
        try:
            api.delete_namespace(ns)
        finally:
            shutil.rmtree(control, ignore_errors=True)


def test_prometheus_discovers_the_daemonset_pod_through_the_api_and_scrapes_it(monitoring):
    def targets():
        active = monitoring.get(f"{monitoring.prometheus}/api/v1/targets", state="active")["data"]["activeTargets"]
        mine = {t["labels"]["job"]: t for t in active}
        return set(mine) == {"gpulens-exporter", "gpulens-agent"} and all(
            t["health"] == "up" for t in mine.values()) and mine
    found = wait_until("both DaemonSet targets up", targets, 120, 1)
    for job, port in (("gpulens-exporter", "metrics"), ("gpulens-agent", "agent")):
        t = found[job]
        seen = t["discoveredLabels"]
        assert seen["__meta_kubernetes_namespace"] == NS
        assert seen["__meta_kubernetes_pod_controller_kind"] == "DaemonSet"
        assert seen["__meta_kubernetes_pod_label_app_kubernetes_io_component"] == "node"
        assert seen["__meta_kubernetes_pod_container_port_name"] == port
        assert t["labels"]["node"] == "gpulens-node"
        assert t["labels"]["instance"] == f"gpulens-node:{seen['__meta_kubernetes_pod_container_port_number']}"
    # The release's other pods (operator, gateway) are discovered too, and dropped by the relabelling.
    dropped = monitoring.get(f"{monitoring.prometheus}/api/v1/targets", state="dropped")["data"]["droppedTargets"]
    components = {d["discoveredLabels"].get("__meta_kubernetes_pod_label_app_kubernetes_io_component") for d in dropped}
    assert {"operator", "gateway"} <= components, components
    up = wait_until("up == 1 for both jobs", lambda: (lambda r: len(r) == 2 and r)(
        monitoring.query('up{job=~"gpulens-exporter|gpulens-agent"} == 1')), 60, 1)
    assert {r["metric"]["job"] for r in up} == {"gpulens-exporter", "gpulens-agent"}


def test_the_trainers_series_in_prometheus_carry_its_namespace_pod_container_and_job(trainer, monitoring):
    series = wait_until("the trainer's launch series in Prometheus, one per worker", lambda: (lambda s: s if len(s) >= 2 else None)(
        monitoring.query(f'gpulens_kernel_launches_total{{namespace="{trainer.namespace}"}}')), 180, 2)
    assert sorted(s["metric"].get("rank") for s in series) == ["0", "1"], series   # issue 29: per worker
    labels = series[0]["metric"]
    assert labels["pod"] == trainer.pod and labels["container"] == "trainer"
    assert labels["gpulens_job"] == JOB and labels["gpulens_workload"] == WORKLOAD
    assert labels["node"] == "gpulens-node" and labels["job"] == "gpulens-exporter"
    assert not [k for k in labels if k.startswith("exported_")], labels    # the exporter's labels kept (honor_labels)


def _gateway_pods_log(api) -> str:
    return pod_logs(api, NS, "app.kubernetes.io/component=gateway")


def _captures_of(monitoring, namespace: str) -> list[dict]:
    status, body = call(f"{monitoring.gateway_url}/v1/captures", monitoring.gateway_token)
    assert status == 200, body
    return [c for c in body["captures"] if c.get("namespace") == namespace]


def test_without_the_gateway_token_alertmanagers_call_is_refused_and_no_capture_starts(trainer, monitoring, api):
    """Runs before the incident: the same labels with the right token would start a capture now
    (the last test shows they do)."""
    key, value = WRONG_TOKEN_LABEL
    now = datetime.now(timezone.utc)
    alert = {"labels": {"alertname": ALERT, "diagnosis": "host_sync", "gpulens_capture": "auto",
                        "namespace": trainer.namespace, "pod": trainer.pod, "gpulens_job": JOB,
                        "gpulens_workload": WORKLOAD, key: value},
             "annotations": {"summary": "posted by the test, routed to a receiver with a wrong token"},
             "startsAt": now.isoformat(), "endsAt": (now + timedelta(seconds=30)).isoformat()}
    req = urllib.request.Request(f"{monitoring.alertmanager}/api/v2/alerts", data=json.dumps([alert]).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200
    wait_until("Alertmanager's webhook refused with 401", lambda: re.search(
        r"gateway-wrong-token.*unexpected status code 401", monitoring.log("alertmanager")), 60, 0.5)
    metrics = urllib.request.urlopen(f"{monitoring.alertmanager}/metrics", timeout=10).read().decode()
    (line,) = [x for x in metrics.splitlines() if x.startswith('alertmanager_notifications_failed_total{integration="webhook"}')]
    assert float(line.split()[-1]) >= 1
    assert _captures_of(monitoring, trainer.namespace) == []
    assert f"job={trainer.namespace}/{JOB}" not in _gateway_pods_log(api)


@pytest.fixture(scope="module")
def fired(trainer, monitoring, api) -> dict:
    """Waits for the workload's baseline (like `gpulens up`: an incident before it would become the
    baseline), switches host_sync on in both workers, and returns the firing alert."""
    baseline = (f'namespace_workload:gpulens_launches_per_worker:baseline_rate5m'
                f'{{namespace="{trainer.namespace}",gpulens_workload="{WORKLOAD}"}}')
    wait_until("the workload's baseline", lambda: monitoring.query(baseline), 900, 3)
    (trainer.control / "incident").write_text("host_sync")
    wait_until("both workers switched to host_sync", lambda: pod_log(
        api, trainer.namespace, trainer.pod, "trainer").count("incident=host_sync") >= 2, 60, 1)

    try:
        return wait_until(f"{ALERT} firing", lambda: next(iter(monitoring.firing(ALERT, trainer.namespace)), None), 600, 2)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{rule_signals.describe(monitoring.prometheus, trainer.namespace)}") from None


def test_the_induced_incident_fires_the_diagnosed_alert_for_the_trainers_pod(fired, trainer, monitoring):
    labels = fired["labels"]
    assert labels["diagnosis"] == "host_sync" and labels["gpulens_capture"] == "auto"
    assert labels["pod"] == trainer.pod and labels["gpulens_job"] == JOB and labels["gpulens_workload"] == WORKLOAD
    # The workload alerts are mutually exclusive: no other diagnosis fires for this pod.
    others = [a["labels"]["alertname"] for a in monitoring.get(f"{monitoring.prometheus}/api/v1/alerts")["data"]["alerts"]
              if a["labels"].get("namespace") == trainer.namespace and a["state"] == "firing"
              and a["labels"].get("alertname") != ALERT]
    assert others == []


def _log_tail(api, trainer, chars: int = 6000) -> str:
    try:
        return pod_log(api, trainer.namespace, trainer.pod, "trainer")[-chars:]
    except Exception as e:  # noqa: BLE001 - the message must not hide the failure it explains
        return f"(unreadable: {e!r})"


def _agent_lines(api, capture_id: str, chars: int = 6000) -> str:
    """The node agent's log lines about one capture: each target's steps, with times."""
    try:
        text = pod_logs(api, NS, "app.kubernetes.io/component=node", container="agent")
    except Exception as e:  # noqa: BLE001 - the message must not hide the failure it explains
        return f"(unreadable: {e!r})"
    return "\n".join(line for line in text.splitlines() if capture_id in line)[-chars:]


@pytest.fixture(scope="module")
def alert_capture(fired, trainer, monitoring, api) -> str:
    """The capture the gateway started for the alert (its pod log names it)."""
    pattern = re.compile(rf"event=alert\.capture_started .*alertname={ALERT} job={re.escape(trainer.namespace)}/{JOB} "
                         r"capture_id=(\S+)")
    m = wait_until("the gateway starting a capture for the alert", lambda: pattern.search(_gateway_pods_log(api)), 120, 1)
    return m.group(1)


def test_alertmanager_delivers_the_alert_to_the_gateway_service(alert_capture, trainer, monitoring):
    active = monitoring.get(f"{monitoring.alertmanager}/api/v2/alerts", filter=f'alertname="{ALERT}"')
    mine = [a for a in active if a["labels"].get("namespace") == trainer.namespace
            and WRONG_TOKEN_LABEL[0] not in a["labels"]]
    assert mine and {r["name"] for a in mine for r in a["receivers"]} == {"gpulens-gateway"}
    (started,) = [c for c in _captures_of(monitoring, trainer.namespace) if c["capture_id"] == alert_capture]
    assert started["job_id"] == JOB


def test_the_alerts_capture_converges_with_both_ranks_archived_and_a_manifest_naming_them_and_the_alert(
        alert_capture, trainer, monitoring, s3, api):
    done = wait_until("the alert's capture converged", lambda: (lambda r: r[1].get("phase") in ("converged", "failed")
                      and r[1])(call(f"{monitoring.gateway_url}/v1/captures/{alert_capture}", monitoring.gateway_token)),
                      300, 1)
    # a rank that never traced says why only in the trainer's own log (Kineto's refusals go nowhere else)
    assert done["phase"] == "converged" and done["fully_succeeded"], (
        json.dumps(done)[:3000] + "\ntrainer log (tail):\n" + _log_tail(api, trainer)
        + "\nagent log (this capture):\n" + _agent_lines(api, alert_capture))
    assert done["counts"] == {"archived": 2}, done["counts"]
    bucket, _, key = done["manifest_uri"].removeprefix("s3://").partition("/")
    assert bucket == s3.bucket
    cli = s3.client()
    manifest = json.loads(cli.get_object(Bucket=bucket, Key=key)["Body"].read())
    assert manifest["capture_id"] == alert_capture and manifest["job_id"] == JOB
    assert sorted(a["rank"] for a in manifest["artifacts"]) == [0, 1] and manifest["failures"] == []
    reason = manifest["request"]["reason"]
    assert (reason["kind"], reason["alertname"], reason["diagnosis"]) == ("alert", ALERT, "host_sync")
    assert reason["workload"] == f"{trainer.namespace}/{trainer.pod}"
    for art in manifest["artifacts"]:
        assert art["pod"] == trainer.pod
        b, _, k = art["uri"].removeprefix("s3://").partition("/")
        assert cli.head_object(Bucket=b, Key=k)["ContentLength"] == art["size"]


def test_the_alert_loop_ran_without_a_403(alert_capture, trainer, monitoring, api):
    """The chart's pods, the job's coordinator, and Prometheus's discovery as its ServiceAccount."""
    # The capture's analysis Job (its pod starts after the capture converged) has run too.
    wait_until("every pod of the job's namespace started", lambda: all(
        p.status.phase != "Pending" for p in api.list_namespaced_pod(trainer.namespace).items), 180, 1)
    assert {**forbidden_in_logs(api, NS), **forbidden_in_logs(api, trainer.namespace)} == {}
    sd = monitoring.log("pod-sd")
    assert "sd.api_failed" not in sd, sd[-2000:]
