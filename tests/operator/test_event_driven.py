"""Coordinators come from watch events, not from the periodic resync: `gpulens operator` as a
process, with its resync interval set to an hour, against the test API server that refuses a
coordinator Pod until its new ServiceAccount has a token (what Kubernetes 1.20 does, the project's
cluster). A new armed job's coordinator Pod and Service, and a deleted CaptureCoordinator with its
Pod and Service, must all appear within the test's wait, which is far shorter than the resync."""

from __future__ import annotations

import pytest

from .apiserver import running_apiserver
from .conftest import Cluster
from .test_command import Proc, _files
from .test_kopf_operator import _wait

pytestmark = pytest.mark.slow

WAIT_S = 45.0          # the test's patience: far below the resync interval, far above the event path
RESYNC_S = 3600


@pytest.fixture
def apiserver():
    with running_apiserver(token_delay_s=1.0) as api:
        yield api


@pytest.fixture
def cluster(apiserver):
    return Cluster(apiserver)


def test_token_admission_refuses_pods_until_the_account_has_a_token(apiserver, cluster):
    """The double's 1.20 behaviour that the operator must ride out (the fault the test relies on)."""
    from kubernetes import client

    body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
            "spec": {"serviceAccountName": "acct", "containers": [{"name": "c", "image": "i"}]}}
    with pytest.raises(client.ApiException) as missing:
        cluster.core.create_namespaced_pod("ml", body)
    assert missing.value.status == 403
    cluster.core.create_namespaced_service_account("ml", {"metadata": {"name": "acct"}})
    with pytest.raises(client.ApiException) as no_token:
        cluster.core.create_namespaced_pod("ml", body)
    assert no_token.value.status == 500 and "No API token found" in no_token.value.body
    _wait(lambda: cluster.core.read_namespaced_service_account("acct", "ml").secrets, "the token", 30)
    cluster.core.create_namespaced_pod("ml", body)
    assert "p" in cluster.names("Pod", "ml")


def _operator_after_its_first_resync(tmp_path, apiserver, cluster, gpulens_bin) -> Proc:
    """`gpulens operator` whose one resync at start is over: from then on only events act."""
    cfg, kc = _files(tmp_path, apiserver, resync_interval_s=RESYNC_S)
    cluster.tokens()
    op = Proc([gpulens_bin, "operator", "--config", str(cfg), "--kubeconfig", str(kc), "--log-level", "debug",
               "--listen", "127.0.0.1:0", "--identity", "op-1"], tmp_path / "operator.log")
    try:
        _wait(lambda: "event=resync.done" in op.text(), "the operator's first resync", 120)
    except BaseException:
        op.stop()
        raise
    return op


def test_coordinators_follow_events_not_the_resync(tmp_path, apiserver, cluster, gpulens_bin):
    op = _operator_after_its_first_resync(tmp_path, apiserver, cluster, gpulens_bin)
    try:
        job = cluster.job("ml", "llama")
        cluster.pod("ml", "llama-0", job=job)
        cluster.pod("ml", "llama-1", job=job)
        _wait(lambda: "gpulens-llama-a0" in cluster.names("Pod", "ml"), "the coordinator Pod", WAIT_S)
        _wait(lambda: "gpulens-llama" in cluster.names("Service", "ml"), "the job's Service", WAIT_S)
        assert "No API token found" in op.text() or "500" in op.text(), "the first Pod create was not refused?"

        old_uid = cluster.coordinators("ml")["gpulens-llama-a0"]["metadata"]["uid"]
        cluster.custom.delete_namespaced_custom_object("gpulens.dev", "v1alpha1", "ml", "capturecoordinators",
                                                       "gpulens-llama-a0")

        def recreated():
            cc = cluster.coordinators("ml").get("gpulens-llama-a0")
            return cc if cc and cc["metadata"]["uid"] != old_uid else None
        new = _wait(recreated, "the deleted CaptureCoordinator to come back", WAIT_S)
        new_uid = new["metadata"]["uid"]

        def owned_by_new(kind: str, name: str):
            obj = next((o for o in cluster.list(kind, "ml") if o["metadata"]["name"] == name), None)
            return obj and [r["uid"] for r in obj["metadata"].get("ownerReferences", [])] == [new_uid]
        _wait(lambda: owned_by_new("Pod", "gpulens-llama-a0"), "the new coordinator's Pod", WAIT_S)
        _wait(lambda: owned_by_new("Service", "gpulens-llama"), "the Service, owned by the new coordinator", WAIT_S)
        assert "event=resync.done" not in op.text().split("event=resync.done", 1)[1], "a second resync ran"
    finally:
        code = op.stop()
    assert code == 0, op.text()[-3000:]
    assert "Traceback" not in op.text(), op.text()[-3000:]


def test_a_namespace_being_deleted_is_not_fought(tmp_path, apiserver, cluster, gpulens_bin):
    """When a job's namespace is deleted, its CaptureCoordinator goes with it and the API server
    refuses any new object there (403, cause NamespaceTerminating). The operator must not retry the
    re-creation for half a minute, logging a 403 each time (a CI run's operator did, and the
    in-cluster 'without a 403' check failed on it): one attempt, then a line saying why it stops."""
    op = _operator_after_its_first_resync(tmp_path, apiserver, cluster, gpulens_bin)
    try:
        job = cluster.job("ml", "llama")
        cluster.pod("ml", "llama-0", job=job)
        _wait(lambda: "gpulens-llama-a0" in cluster.names("Pod", "ml"), "the coordinator Pod", WAIT_S)
        apiserver.loop.call_soon_threadsafe(apiserver.server.terminating.add, "ml")
        cluster.custom.delete_namespaced_custom_object("gpulens.dev", "v1alpha1", "ml", "capturecoordinators",
                                                       "gpulens-llama-a0")
        line = _wait(lambda: next((x for x in op.text().splitlines() if "event=event.dropped" in x), None),
                     "the operator to drop the re-creation", WAIT_S)
        assert 'reason="namespace terminating"' in line and "ml/llama" in line, line
        creates = [r for r in apiserver.requests() if r[0] == "POST" and r[1].endswith("/capturecoordinators")]
        assert len(creates) == 2, creates          # the first coordinator, then one refused attempt
        assert not [x for x in op.text().splitlines() if "event=event.retry" in x and "NamespaceTerminating" in x
                    or "being terminated" in x and "event.dropped" not in x]
    finally:
        code = op.stop()
    assert code == 0, op.text()[-3000:]
    assert "Traceback" not in op.text(), op.text()[-3000:]
