"""The real operator (kopf, our handlers, the real `kubernetes` client) against the test API
server: kopf lists and watches over HTTP, events drive the reconciler, and the outcome is the same
as the pure plan says. Waits poll the API with a deadline (no timing assertions)."""

from __future__ import annotations

import asyncio
import threading
import time

import kopf
import pytest

from gpulens.capture.operator.handlers import build_registry
from gpulens.capture.operator.kube import KubeApi
from gpulens.capture.operator.reconcile import Reconciler

from .rbac import allowed, attributes


def _wait(predicate, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def operator(apiserver, cluster, config):
    """Runs kopf with our registry in its own thread and event loop; stops it afterwards."""
    cluster.tokens()
    client = apiserver.api_client()
    client.user_agent = "gpulens-operator-under-test"
    registry = build_registry(Reconciler(KubeApi(client), config),
                              connection=kopf.ConnectionInfo(server=apiserver.url, insecure=True))
    stop, ready = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def main() -> None:
        try:
            asyncio.run(kopf.operator(registry=registry, clusterwide=True, standalone=True,
                                      stop_flag=stop, ready_flag=ready))
        except BaseException as exc:  # surfaced by the fixture
            errors.append(exc)

    thread = threading.Thread(target=main, name="kopf", daemon=True)
    thread.start()
    assert ready.wait(60), "kopf did not start"
    yield
    stop.set()
    thread.join(60)
    assert not thread.is_alive(), "kopf did not stop"
    assert not errors, errors


def test_kopf_operator_follows_jobs_through_their_life(apiserver, cluster, operator):
    job = cluster.job("ml", "llama")
    cluster.pod("ml", "llama-0", job=job, attempt=0)
    cluster.pod("ml", "llama-1", job=job, attempt=0)
    _wait(lambda: "gpulens-llama-a0" in cluster.names("Pod", "ml"), "the attempt-0 coordinator pod")
    assert list(cluster.coordinators("ml")) == ["gpulens-llama-a0"]

    other = cluster.job("ml", "mistral")
    cluster.pod("ml", "mistral-0", job=other)
    _wait(lambda: "gpulens-mistral-a0" in cluster.coordinators("ml"), "the second job's coordinator")

    cluster.delete_pod("ml", "llama-0")
    cluster.delete_pod("ml", "llama-1")
    cluster.pod("ml", "llama-0-r1", job=job, attempt=1)
    _wait(lambda: set(cluster.coordinators("ml")) == {"gpulens-llama-a1", "gpulens-mistral-a0"}, "the attempt bump")
    _wait(lambda: "gpulens-llama-a1" in cluster.names("Pod", "ml"), "the attempt-1 coordinator pod")

    cluster.delete_job("ml", "llama")
    _wait(lambda: set(cluster.coordinators("ml")) == {"gpulens-mistral-a0"}, "the deleted job's coordinator to go")
    # The Service goes by garbage collection of its owner; a reconcile still in flight for a pod
    # event may write it once more with the deleted owner, which the collector then removes: wait
    # for that outcome instead of reading it at the instant the coordinator went.
    _wait(lambda: "gpulens-llama" not in cluster.names("Service", "ml"), "the deleted job's Service to go")
    assert "gpulens-mistral" in cluster.names("Service", "ml")

    # kopf watched pods with a server-side selector, not every pod in the cluster.
    pod_watches = [r for r in apiserver.server.log if r[1] == "/api/v1/pods" and "watch=true" in r[2]]
    assert pod_watches and all("labelSelector=gpulens.dev/armed" in r[2] for r in pod_watches)
    # kopf never wrote to a trainer pod (no annotations, no finalizers): only our reconciler wrote.
    test_agent = cluster.core.api_client.user_agent
    trainer_writes = [r for r, ua in zip(apiserver.server.log, apiserver.server.agents)
                      if ua != test_agent and r[0] != "GET" and ("/pods/llama" in r[1] or "/pods/mistral" in r[1])]
    assert trainer_writes == []
    for pod in cluster.list("Pod", "ml"):
        assert not pod["metadata"].get("finalizers")
        assert not [k for k in pod["metadata"].get("annotations", {}) if k.startswith("kopf.zalando.org")]


def test_kopf_requests_are_allowed_by_the_chart_rbac(apiserver, cluster, operator):
    from ..helm.chart import NAMESPACE, one, render

    objs = render()
    cluster_rules = one(objs, "ClusterRole", "-operator")["rules"]
    ns_rules = {NAMESPACE: one(objs, "Role", "-operator")["rules"]}
    job = cluster.job("ml", "llama")
    cluster.pod("ml", "llama-0", job=job)
    _wait(lambda: "gpulens-llama-a0" in cluster.names("Pod", "ml"), "the coordinator pod")
    ours = set(apiserver.requests_by("gpulens-operator-under-test"))
    test_agent = apiserver.requests_by(cluster.core.api_client.user_agent)
    kopf_requests = [r for r, ua in zip(apiserver.server.log, apiserver.server.agents)
                     if r not in ours and ua != cluster.core.api_client.user_agent]
    assert kopf_requests, "kopf made no requests?"
    assert test_agent
    denied = [r for r in kopf_requests if attributes(*r) and not allowed(attributes(*r), cluster_rules, ns_rules)]
    assert denied == []


def _start(apiserver, config):
    client = apiserver.api_client()
    client.user_agent = "gpulens-operator-under-test"
    registry = build_registry(Reconciler(KubeApi(client), config),
                              connection=kopf.ConnectionInfo(server=apiserver.url, insecure=True))
    stop, ready = threading.Event(), threading.Event()
    thread = threading.Thread(target=lambda: asyncio.run(kopf.operator(
        registry=registry, clusterwide=True, standalone=True, stop_flag=stop, ready_flag=ready)), daemon=True)
    thread.start()
    assert ready.wait(60)
    return stop, thread


def test_a_restarted_kopf_operator_writes_nothing(apiserver, cluster, config):
    cluster.tokens()
    stop, thread = _start(apiserver, config)
    try:
        job = cluster.job("ml", "llama")
        cluster.pod("ml", "llama-0", job=job)
        _wait(lambda: "gpulens-llama-a0" in cluster.names("Pod", "ml"), "the coordinator pod")
        _wait(lambda: (cluster.coordinators("ml")["gpulens-llama-a0"].get("status") or {}).get("phase"), "status")
    finally:
        stop.set()
        thread.join(60)
    mark = len(apiserver.server.log)
    stop, thread = _start(apiserver, config)
    try:
        ua = "gpulens-operator-under-test"

        def handled_initial_listing():
            mine = [r for r, a in list(zip(apiserver.server.log, apiserver.server.agents))[mark:] if a == ua]
            return (("GET", "/api/v1/namespaces/ml/pods", "labelSelector=gpulens.dev/armed%3Dtrue") in mine
                    and ("GET", "/api/v1/namespaces/ml/pods/gpulens-llama-a0", "") in mine
                    and ("GET", "/apis/gpulens.dev/v1alpha1/namespaces/ml/capturecoordinators/gpulens-llama-a0", "")
                    in mine)
        _wait(handled_initial_listing, "the restarted operator to look at the job and its coordinator")
    finally:
        stop.set()
        thread.join(60)
    assert [r for r in apiserver.server.log[mark:] if r[0] != "GET"] == []
