"""The operator's reconciliation, with the real `kubernetes` client against the test API server:
one coordinator per armed (job, attempt), attempt bumps replace it, job deletion removes it, jobs
never share one, and a restarted operator changes nothing that runs."""

from __future__ import annotations

import base64

import pytest

from gpulens.capture.wire import labels as L
from gpulens.capture.operator.kube import KubeApi, KubeError
from gpulens.capture.operator.reconcile import Reconciler

from .conftest import OPERATOR_NS, operator_config

CHILD_KINDS = ("Pod", "Service", "ServiceAccount", "Secret")


def _selector_matches(match_labels: dict, pod: dict) -> bool:
    labels = pod["metadata"].get("labels") or {}
    return all(labels.get(k) == v for k, v in match_labels.items())


def _owner_uids(obj: dict) -> list[str]:
    return [r["uid"] for r in obj["metadata"].get("ownerReferences") or []]


def test_an_armed_job_gets_exactly_one_coordinator(cluster, reconciler):
    job = cluster.job("ml", "llama")
    for i in range(3):
        cluster.pod("ml", f"llama-{i}", job=job, lws=8)
    for i in range(3):   # one event per pod, as kopf would deliver them
        plan = reconciler.reconcile_job("ml", "llama")
    ccs = cluster.coordinators("ml")
    assert list(ccs) == ["gpulens-llama-a0"]
    cc = ccs["gpulens-llama-a0"]
    assert plan.keep == "gpulens-llama-a0" and plan.create is None and plan.delete == ()
    assert _owner_uids(cc) == [job["metadata"]["uid"]]                 # garbage-collected with the Job
    assert cc["spec"]["jobId"] == "llama" and cc["spec"]["attempt"] == 0
    assert cc["spec"]["localWorldSize"] == 8
    trainer_pods = [p for p in cluster.list("Pod", "ml") if p["metadata"]["name"].startswith("llama-")]
    assert all(_selector_matches(cc["spec"]["selector"]["matchLabels"], p) for p in trainer_pods)
    # Its children exist once each and belong to it.
    pod = next(p for p in cluster.list("Pod", "ml") if p["metadata"]["name"] == "gpulens-llama-a0")
    assert _owner_uids(pod) == [cc["metadata"]["uid"]]
    assert not _selector_matches(cc["spec"]["selector"]["matchLabels"], pod)   # never its own target
    svc = next(s for s in cluster.list("Service", "ml") if s["metadata"]["name"] == "gpulens-llama")
    assert svc["spec"]["selector"] == {L.COORDINATOR_OF: "gpulens-llama-a0"}
    assert pod["metadata"]["labels"][L.COORDINATOR_OF] == "gpulens-llama-a0"
    assert _owner_uids(svc) == [cc["metadata"]["uid"]]
    tokens = next(s for s in cluster.list("Secret", "ml") if s["metadata"]["name"].endswith("-tokens"))
    assert set(tokens["data"]) == {"agent", "coordinator"}            # never the gateway's token
    assert base64.b64decode(tokens["data"]["agent"]) == b"agent-token"


def test_a_restarted_operator_touches_nothing(cluster, reconciler, config):
    job = cluster.job("ml", "llama")
    cluster.pod("ml", "llama-0", job=job)
    reconciler.reconcile_job("ml", "llama")
    reconciler.resync()                                                 # status written once
    before = {k: cluster.names(k, "ml") for k in CHILD_KINDS}
    writes = len(cluster.api.writes())
    fresh = Reconciler(KubeApi(cluster.api.api_client()), config)       # a new process, no memory
    fresh.resync()
    fresh.reconcile_job("ml", "llama")
    assert cluster.api.writes()[writes:] == []                          # not one write: captures run on
    assert {k: cluster.names(k, "ml") for k in CHILD_KINDS} == before


def test_an_attempt_bump_replaces_the_coordinator_and_keeps_the_service(cluster, reconciler):
    job = cluster.job("ml", "llama")
    cluster.pod("ml", "llama-0", job=job, attempt=0)
    reconciler.reconcile_job("ml", "llama")
    old = cluster.coordinators("ml")["gpulens-llama-a0"]
    # The restarted attempt's pods appear while the old ones are still terminating.
    cluster.pod("ml", "llama-0-r1", job=job, attempt=1)
    plan = reconciler.reconcile_job("ml", "llama")
    assert plan.delete == ("gpulens-llama-a0",) and plan.keep == "gpulens-llama-a1"
    ccs = cluster.coordinators("ml")
    assert list(ccs) == ["gpulens-llama-a1"]
    new = ccs["gpulens-llama-a1"]
    assert new["spec"]["attempt"] == 1 and new["spec"]["selector"]["matchLabels"][L.ATTEMPT] == "1"
    pods = cluster.names("Pod", "ml")
    assert "gpulens-llama-a1" in pods and "gpulens-llama-a0" not in pods   # old one garbage-collected
    svc = next(s for s in cluster.list("Service", "ml") if s["metadata"]["name"] == "gpulens-llama")
    assert svc["spec"]["selector"] == {L.COORDINATOR_OF: "gpulens-llama-a1"}
    assert _owner_uids(svc) == [new["metadata"]["uid"]] != [old["metadata"]["uid"]]
    # And back to one: nothing of attempt 0 is left.
    assert not [n for k in CHILD_KINDS for n in cluster.names(k, "ml") if "-a0" in n]


def test_a_coordinator_with_a_capture_in_flight_drains_before_it_goes(cluster, config):
    """A node lost mid-capture: its pod's ranks break the world, the Job replaces the pods and a
    newer attempt appears while the old coordinator still waits for that capture's targets. The
    old one is asked at its Pod (the job's Service is its successor's already) and kept until its
    capture has converged; one that does not answer is deleted as before."""
    phases = {"10.9.0.7": "capturing"}
    asked: list[str] = []

    def fetch(endpoint: str):
        asked.append(endpoint)
        ip = endpoint.removeprefix("http://").split(":")[0]
        return {"captures": [{"capture_id": "c-20261207t150000-aaaaaaaa", "phase": phases[ip]}]} if ip in phases else None

    cluster.tokens()
    r = Reconciler(KubeApi(cluster.api.api_client()), config, captures=fetch)
    job = cluster.job("ml", "llama")
    cluster.pod("ml", "llama-0", job=job, attempt=0)
    r.reconcile_job("ml", "llama")
    cluster.core.patch_namespaced_pod_status(
        "gpulens-llama-a0", "ml", {"status": {"phase": "Running", "podIP": "10.9.0.7"}},
        _content_type="application/merge-patch+json", _preload_content=False)
    cluster.pod("ml", "llama-0-r1", job=job, attempt=1)
    plan = r.reconcile_job("ml", "llama")
    assert plan.delete == ("gpulens-llama-a0",) and plan.keep == "gpulens-llama-a1"
    assert sorted(cluster.coordinators("ml")) == ["gpulens-llama-a0", "gpulens-llama-a1"]     # draining
    assert asked == [f"http://10.9.0.7:{config.coordinator.port}"]
    svc = next(s for s in cluster.list("Service", "ml") if s["metadata"]["name"] == "gpulens-llama")
    assert svc["spec"]["selector"] == {L.COORDINATOR_OF: "gpulens-llama-a1"}    # new captures go to a1
    r.resync()
    assert "gpulens-llama-a0" in cluster.coordinators("ml")
    phases["10.9.0.7"] = "converged"
    r.resync()
    assert list(cluster.coordinators("ml")) == ["gpulens-llama-a1"]
    # a coordinator that cannot be asked (its node lost) drains nothing
    cluster.core.patch_namespaced_pod_status(
        "gpulens-llama-a1", "ml", {"status": {"phase": "Running", "podIP": "10.9.0.8"}},
        _content_type="application/merge-patch+json", _preload_content=False)
    cluster.pod("ml", "llama-0-r2", job=job, attempt=2)
    r.reconcile_job("ml", "llama")
    assert list(cluster.coordinators("ml")) == ["gpulens-llama-a2"]


def test_deleting_the_job_removes_its_coordinator(cluster, reconciler):
    job = cluster.job("ml", "llama")
    cluster.pod("ml", "llama-0", job=job)
    reconciler.reconcile_job("ml", "llama")
    cluster.delete_job("ml", "llama")          # its pods go with it (garbage collector)
    plan = reconciler.reconcile_job("ml", "llama")
    assert plan.create is None
    assert cluster.coordinators("ml") == {}
    assert not [n for k in CHILD_KINDS for n in cluster.names(k, "ml") if n.startswith("gpulens-")]


def test_deleting_the_job_while_the_operator_is_down_still_removes_everything(cluster, reconciler):
    """Owner references alone do it: the garbage collector needs no operator."""
    job = cluster.job("ml", "llama")
    cluster.pod("ml", "llama-0", job=job)
    reconciler.reconcile_job("ml", "llama")
    writes = len(cluster.api.writes())
    cluster.delete_job("ml", "llama")
    assert cluster.coordinators("ml") == {}
    assert not [n for k in CHILD_KINDS for n in cluster.names(k, "ml") if n.startswith("gpulens-")]
    assert cluster.api.writes()[writes:] == [("DELETE", "/apis/batch/v1/namespaces/ml/jobs/llama", "")]


def test_a_job_deleted_with_orphaned_pods_loses_its_coordinator_at_resync(cluster, reconciler):
    job = cluster.job("ml", "llama")
    cluster.pod("ml", "llama-0", job=job)
    reconciler.reconcile_job("ml", "llama")
    # `kubectl delete job --cascade=orphan`: the Job goes, its pods stay (and so no GC of the CR).
    cluster.batch.delete_namespaced_job("llama", "ml", propagation_policy="Orphan", _preload_content=False)
    assert list(cluster.coordinators("ml")) == ["gpulens-llama-a0"]   # orphaned, not collected
    assert "llama-0" in cluster.names("Pod", "ml")
    reconciler.resync()                              # the pods still carry the Job's name label
    assert cluster.coordinators("ml") == {}


def test_two_jobs_never_share_a_coordinator(cluster, reconciler):
    a, b = cluster.job("ml", "alpha"), cluster.job("ml", "beta")
    other_ns = cluster.job("research", "alpha")                 # same name, other namespace
    cluster.pod("ml", "alpha-0", job=a)
    cluster.pod("ml", "beta-0", job=b)
    cluster.pod("research", "alpha-0", job=other_ns)
    cluster.pod("ml", "free-0", labels={L.JOB: "gamma"})        # grouped by label only
    cluster.pod("ml", "free-1", labels={L.JOB: "gamma"})
    reconciler.resync()
    ccs = {**cluster.coordinators("ml"), **{f"research/{k}": v for k, v in cluster.coordinators("research").items()}}
    assert set(ccs) == {"gpulens-alpha-a0", "gpulens-beta-a0", "gpulens-gamma-a0", "research/gpulens-alpha-a0"}
    everyone = cluster.list("Pod")
    trainers = [p for p in everyone if p["metadata"]["labels"].get(L.ARMED) == "true"]
    for cc in ccs.values():
        ns = cc["metadata"]["namespace"]
        mine = [p["metadata"]["name"] for p in trainers
                if p["metadata"]["namespace"] == ns and _selector_matches(cc["spec"]["selector"]["matchLabels"], p)]
        expected = {"alpha": ["alpha-0"], "beta": ["beta-0"], "gamma": ["free-0", "free-1"]}[cc["spec"]["jobId"]]
        assert sorted(mine) == expected, cc["metadata"]["name"]
    services = [s["metadata"]["name"] for s in cluster.list("Service") if s["metadata"]["name"].startswith("gpulens-")]
    assert len(services) == len(set((s["metadata"]["namespace"], s["metadata"]["name"])
                                    for s in cluster.list("Service"))) == 4
    assert "ownerReferences" not in ccs["gpulens-gamma-a0"]["metadata"]   # no job object to own it


def test_unarmed_and_jobless_pods_get_nothing(cluster, reconciler):
    job = cluster.job("ml", "quiet")
    cluster.pod("ml", "quiet-0", job=job, armed=False)
    cluster.pod("ml", "loner", labels={})                       # armed, but no job at all
    assert reconciler.resync() == []
    assert cluster.coordinators() == {}


def test_a_finished_job_releases_its_coordinator(cluster, reconciler):
    job = cluster.job("ml", "done")
    cluster.pod("ml", "done-0", job=job)
    cluster.pod("ml", "done-1", job=job)
    reconciler.reconcile_job("ml", "done")
    cluster.set_phase("ml", "done-0", "Succeeded")
    reconciler.reconcile_job("ml", "done")
    assert list(cluster.coordinators("ml")) == ["gpulens-done-a0"]    # one worker still running
    cluster.set_phase("ml", "done-1", "Succeeded")
    reconciler.reconcile_job("ml", "done")
    assert cluster.coordinators("ml") == {}


def test_a_lost_coordinator_pod_comes_back_at_resync(cluster, reconciler):
    job = cluster.job("ml", "llama")
    cluster.pod("ml", "llama-0", job=job)
    reconciler.reconcile_job("ml", "llama")
    cluster.delete_pod("ml", "gpulens-llama-a0")
    reconciler.resync()
    assert "gpulens-llama-a0" in cluster.names("Pod", "ml")


def test_status_follows_the_coordinator_pod(cluster, reconciler):
    job = cluster.job("ml", "llama")
    cluster.pod("ml", "llama-0", job=job)
    reconciler.reconcile_job("ml", "llama")
    reconciler.resync()
    status = cluster.coordinators("ml")["gpulens-llama-a0"]["status"]
    assert status["phase"] == "Starting"
    assert status["endpoint"] == "http://gpulens-llama.ml.svc:9452"
    cluster.core.patch_namespaced_pod_status(
        "gpulens-llama-a0", "ml", {"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}},
        _content_type="application/merge-patch+json", _preload_content=False)
    reconciler.resync()
    status = cluster.coordinators("ml")["gpulens-llama-a0"]["status"]
    assert status["phase"] == "Ready" and status["conditions"][0]["status"] == "True"


def test_missing_tokens_secret_holds_the_pod_back_until_it_exists(apiserver, cluster, config):
    r = Reconciler(KubeApi(apiserver.api_client()), config)     # no tokens() call: the Secret is missing
    job = cluster.job("ml", "llama")
    cluster.pod("ml", "llama-0", job=job)
    r.reconcile_job("ml", "llama")
    assert list(cluster.coordinators("ml")) == ["gpulens-llama-a0"]
    assert "gpulens-llama-a0" not in cluster.names("Pod", "ml")   # no pod that could never start
    cluster.tokens()
    r.resync()
    assert "gpulens-llama-a0" in cluster.names("Pod", "ml")


def test_api_faults_raise_and_delete_nothing(apiserver, cluster, reconciler):
    import kmock

    job = cluster.job("ml", "llama")
    cluster.pod("ml", "llama-0", job=job)
    reconciler.reconcile_job("ml", "llama")
    writes = len(apiserver.writes())
    # The API server starts failing pod listings (an overloaded or partitioned control plane).
    apiserver.server[kmock.resource("v1/pods"), kmock.action.LIST] << 503
    with pytest.raises(KubeError, match="list pods"):
        reconciler.reconcile_job("ml", "llama")
    with pytest.raises(KubeError):
        reconciler.resync()
    assert apiserver.writes()[writes:] == []
    assert list(cluster.coordinators("ml")) == ["gpulens-llama-a0"]


def test_unreachable_api_server_is_a_kube_error(config):
    from kubernetes import client

    cfg = client.Configuration()
    cfg.host = "http://127.0.0.1:9"                       # discard port: nothing listens
    cfg.retries = 0
    with pytest.raises(KubeError):
        Reconciler(KubeApi(client.ApiClient(cfg)), config).resync()


def test_a_replaced_job_with_the_same_name_gets_a_fresh_coordinator(cluster, reconciler):
    old = cluster.job("ml", "llama")
    cluster.pod("ml", "llama-0", job=old)
    reconciler.reconcile_job("ml", "llama")
    first = cluster.coordinators("ml")["gpulens-llama-a0"]["metadata"]["uid"]
    cluster.delete_job("ml", "llama")
    new = cluster.job("ml", "llama")
    cluster.pod("ml", "llama-0", job=new)
    reconciler.reconcile_job("ml", "llama")
    cc = cluster.coordinators("ml")["gpulens-llama-a0"]
    assert cc["metadata"]["uid"] != first and _owner_uids(cc) == [new["metadata"]["uid"]]


@pytest.mark.parametrize("grafana", ["", "https://grafana.example.com"])
def test_coordinator_pod_command_follows_the_config(cluster, grafana):
    cfg = operator_config(coordinator={"archive_root": "s3://b/p", "s3_endpoint": "http://minio:9000",
                                       "grafana_url": grafana, "archive_secret": "s3-creds"})
    cluster.tokens()
    cluster.core.create_namespaced_secret(OPERATOR_NS, {"metadata": {"name": "s3-creds"},
                                                        "data": {"AWS_ACCESS_KEY_ID": "eA=="}},
                                          _preload_content=False)
    r = Reconciler(KubeApi(cluster.api.api_client()), cfg)
    job = cluster.job("ml", "llama")
    cluster.pod("ml", "llama-0", job=job)
    r.reconcile_job("ml", "llama")
    pod = next(p for p in cluster.list("Pod", "ml") if p["metadata"]["name"] == "gpulens-llama-a0")
    args = pod["spec"]["containers"][0]["args"]
    assert args[:2] == ["coordinator", "--listen"]
    assert ("--grafana-url" in args) is bool(grafana)
    assert args[args.index("--s3-endpoint") + 1] == "http://minio:9000"
    archive = next(s for s in cluster.list("Secret", "ml") if s["metadata"]["name"].endswith("-archive"))
    assert archive["data"] == {"AWS_ACCESS_KEY_ID": "eA=="}
    assert pod["spec"]["containers"][0]["envFrom"] == [{"secretRef": {"name": archive["metadata"]["name"]}}]


@pytest.fixture
async def coordinator_double(port):
    """Stands for a coordinator's `GET /v1/captures` (docs/ARCHITECTURE.md, "Coordinator API"):
    Bearer token required, JSON `{"captures": [summary...]}`."""
    from aiohttp import web

    async def captures(request):
        if request.headers.get("Authorization") != "Bearer coordinator-token":
            return web.json_response({"error": "unauthorized"}, status=401)
        return web.json_response({"captures": [
            {"capture_id": "c-20261129t074001-aaaaaaaa", "phase": "converged", "fully_succeeded": True,
             "manifest_uri": "s3://traces/gpulens/ml/llama/0/c-20261129t074001-aaaaaaaa/manifest.json"},
            {"capture_id": "c-20261129t080000-bbbbbbbb", "phase": "capturing"},
            {"bogus": True}]})

    app = web.Application()
    app.router.add_get("/v1/captures", captures)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


@pytest.mark.parametrize("token,reachable", [("coordinator-token", True), ("wrong", True), ("coordinator-token", False)])
async def test_last_captures_come_from_the_coordinator_api(cluster, config, coordinator_double, token, reachable):
    import asyncio

    from gpulens.capture.operator.captures_probe import http_captures

    cluster.tokens()
    target = coordinator_double if reachable else "http://127.0.0.1:9"
    fetch = http_captures(token, timeout_s=5, rewrite=lambda endpoint: target)
    r = Reconciler(KubeApi(cluster.api.api_client()), config, captures=fetch)

    def scenario():
        job = cluster.job("ml", "llama")
        cluster.pod("ml", "llama-0", job=job)
        r.reconcile_job("ml", "llama")
        cluster.core.patch_namespaced_pod_status(
            "gpulens-llama-a0", "ml", {"status": {"phase": "Running",
                                                  "conditions": [{"type": "Ready", "status": "True"}]}},
            _content_type="application/merge-patch+json", _preload_content=False)
        r.resync()
        return cluster.coordinators("ml")["gpulens-llama-a0"]["status"]

    status = await asyncio.to_thread(scenario)      # the double serves on this test's event loop
    assert status["phase"] == "Ready"
    if token == "coordinator-token" and reachable:
        assert status["lastCaptures"] == [
            {"captureId": "c-20261129t080000-bbbbbbbb", "phase": "capturing"},
            {"captureId": "c-20261129t074001-aaaaaaaa", "phase": "converged", "fullySucceeded": True,
             "manifestUri": "s3://traces/gpulens/ml/llama/0/c-20261129t074001-aaaaaaaa/manifest.json"}]
        from ..helm.chart import validate
        validate(cluster.coordinators("ml")["gpulens-llama-a0"])     # the status fits the CRD schema
    else:
        assert "lastCaptures" not in status          # refused or unreachable: nothing invented


class _CollectedAfterRead(KubeApi):
    """KubeApi whose first read of a Service is followed at once by the garbage collector
    deleting it (really, through the test API server): the race a clean-clone cluster run hit
    when a failed pod's coordinator went before the Job's replacement pod came."""

    def __init__(self, api_client):
        super().__init__(api_client)
        self.collected: list[str] = []

    def get_service(self, namespace, name):
        have = super().get_service(namespace, name)
        if have is not None and not self.collected:
            self.core.delete_namespaced_service(name, namespace)
            self.collected.append(name)
        return have


def test_a_service_collected_between_read_and_handover_is_created_again(cluster, reconciler, config):
    job = cluster.job("ml", "llama")
    cluster.pod("ml", "llama-0", job=job, attempt=0)
    reconciler.reconcile_job("ml", "llama")
    cluster.pod("ml", "llama-0-r1", job=job, attempt=1)
    racing = _CollectedAfterRead(cluster.api.api_client())
    plan = Reconciler(racing, config).reconcile_job("ml", "llama")
    assert racing.collected == ["gpulens-llama"] and plan.keep == "gpulens-llama-a1"
    # no resync in between: the handover itself must leave the job with its Service
    (svc,) = [s for s in cluster.list("Service", "ml") if s["metadata"]["name"] == "gpulens-llama"]
    assert svc["spec"]["selector"] == {L.COORDINATOR_OF: "gpulens-llama-a1"}
    assert _owner_uids(svc) == [cluster.coordinators("ml")["gpulens-llama-a1"]["metadata"]["uid"]]


def _serving_pod(cluster, name: str, revision: str, phase: str = "Running") -> dict:
    """An armed Deployment pod as the webhook leaves it: its revision's job id and the serving kind."""
    return cluster.pod("serve", name, lws=1, phase=phase,
                       labels={L.JOB: f"web-{revision}", L.SERVING: "Deployment", "pod-template-hash": revision})


def test_a_serving_revision_gets_one_coordinator_and_a_rolling_update_replaces_it(cluster, reconciler, config):
    from gpulens.capture.operator.manifests import coordinator_args
    for i in range(2):
        _serving_pod(cluster, f"web-aaaa1-{i}", "aaaa1")
    reconciler.resync()
    ccs = cluster.coordinators("serve")
    assert list(ccs) == ["gpulens-web-aaaa1-a0"]
    cc = ccs["gpulens-web-aaaa1-a0"]
    assert cc["spec"]["job"]["groupedBy"] == "Deployment" and "ownerReferences" not in cc["metadata"]
    assert cc["spec"]["selector"]["matchLabels"][L.JOB] == "web-aaaa1"
    assert "--serving" in coordinator_args(cc, config)
    # Mid-rollout: the new revision's first pod gets its own coordinator, the old one stays with its pods.
    _serving_pod(cluster, "web-bbbb2-0", "bbbb2")
    reconciler.reconcile_job("serve", "web-bbbb2")
    assert set(cluster.coordinators("serve")) == {"gpulens-web-aaaa1-a0", "gpulens-web-bbbb2-a0"}
    cluster.delete_pod("serve", "web-aaaa1-0")
    reconciler.reconcile_job("serve", "web-aaaa1")
    assert set(cluster.coordinators("serve")) == {"gpulens-web-aaaa1-a0", "gpulens-web-bbbb2-a0"}
    # The old revision's last pod goes: so does its coordinator (at the pod's event, and at resync).
    cluster.delete_pod("serve", "web-aaaa1-1")
    reconciler.reconcile_job("serve", "web-aaaa1")
    assert set(cluster.coordinators("serve")) == {"gpulens-web-bbbb2-a0"}
    reconciler.resync()
    assert set(cluster.coordinators("serve")) == {"gpulens-web-bbbb2-a0"}


def test_a_training_coordinator_is_never_started_as_serving(cluster, reconciler, config):
    from gpulens.capture.operator.manifests import coordinator_args
    job = cluster.job("ml", "llama")
    cluster.pod("ml", "llama-0", job=job)
    reconciler.resync()
    assert "--serving" not in coordinator_args(cluster.coordinators("ml")["gpulens-llama-a0"], config)


def test_status_of_a_coordinator_whose_pod_is_gone_is_accepted(cluster, reconciler):
    """With its Pod gone the status says Pending and names no pod. It once sent podName "", which
    1.20 refuses in a merge patch (the double does too): the status stayed stale and the handler
    retried for 30 s before the Pod was recreated (CI, test_4's leader test)."""
    job = cluster.job("ml", "llama")
    cluster.pod("ml", "llama-0", job=job)
    reconciler.reconcile_job("ml", "llama")
    reconciler.resync()
    assert cluster.coordinators("ml")["gpulens-llama-a0"]["status"]["podName"] == "gpulens-llama-a0"
    pod = next(p for p in cluster.list("Pod", "ml") if p["metadata"]["name"] == "gpulens-llama-a0")
    cluster.delete_pod("ml", "gpulens-llama-a0")
    reconciler.status_for_pod(pod)            # the Pod's DELETED event
    status = cluster.coordinators("ml")["gpulens-llama-a0"]["status"]
    assert status["phase"] == "Pending" and status["conditions"][0]["reason"] == "PodMissing"
    assert not status.get("podName")


def test_a_namespace_being_deleted_does_not_stop_the_resync_of_other_jobs(apiserver, cluster, reconciler):
    """Hundreds of jobs, one of them in a namespace being deleted: its coordinator cannot be made
    again (403 NamespaceTerminating) and that is no failure; the other jobs are still reconciled."""
    for ns in ("going", "staying"):
        cluster.pod(ns, "llama-0", job=cluster.job(ns, "llama"))
    reconciler.resync()
    apiserver.loop.call_soon_threadsafe(apiserver.server.terminating.add, "going")
    for ns in ("going", "staying"):
        cluster.custom.delete_namespaced_custom_object("gpulens.dev", "v1alpha1", ns, "capturecoordinators",
                                                       "gpulens-llama-a0")
    reconciler.resync()                       # raises nothing: a namespace going is not a failure
    assert "gpulens-llama-a0" in cluster.coordinators("staying")
    assert "gpulens-llama-a0" not in cluster.coordinators("going")
