"""Churn in the cluster (issue 13): pods of the add-on and of the workload come and go mid-run.

- The node DaemonSet pod (exporter + agent) deleted while a capture runs: the DaemonSet brings a
  new pod, which reloads the targets from its state folder on the node (hostPath) and resumes
  them; the capture converges with every rank archived or failed with an explicit reason, in the
  status and the manifest alike, and the trainer never notices.
- A plain batch Job whose first pod fails: the replacement pod is armed as attempt 1 (the webhook
  counts the Job's failed pods), gets its own CaptureCoordinator and coordinator Pod, the job's
  Service moves to it, and a capture through the gateway lands under attempt 1."""

from __future__ import annotations

import pytest

from gpulens.capture.wire import labels as L

from .harness import NS, wait_until
from .workload import (JOB, armed_namespace, archived_size, capture_status, read_manifest, start_capture,
                       start_trainer, trainer_job, wait_converged, wait_training)

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(1800)]

NODE_PODS = "app.kubernetes.io/component=node"
COORDINATOR_PODS = "app.kubernetes.io/component=coordinator"


def _ready(pod) -> bool:
    return bool(pod.status.container_statuses) and all(c.ready for c in pod.status.container_statuses)


@pytest.fixture
def trainer(release, api, gpulens_image):
    """Job `trainer` training in its own armed namespace (gone after the test: one trainer at a time
    on two cores); yields (namespace, pod)."""
    ns = armed_namespace(api)
    try:
        yield ns, start_trainer(api, ns, gpulens_image)
    finally:
        api.delete_namespace(ns)


def test_an_agent_pod_deleted_mid_capture_comes_back_and_the_capture_loses_no_rank(trainer, api, s3):
    ns, pod = trainer
    (old,) = api.list_namespaced_pod(NS, label_selector=NODE_PODS).items
    cid = start_capture(api, ns, duration_ms=8000)

    def dispatched():
        targets = capture_status(api, cid).get("targets") or []
        return len(targets) == 2 and all(t["state"] != "pending" for t in targets) and targets
    at_delete = wait_until("both ranks dispatched", dispatched, 120, 0.5)
    assert all(t["state"] not in ("archived", "failed") for t in at_delete), at_delete   # still mid-capture
    api.delete_namespaced_pod(old.metadata.name, NS, grace_period_seconds=0)
    (new,) = wait_until("the DaemonSet's new node pod Ready", lambda: [
        p for p in api.list_namespaced_pod(NS, label_selector=NODE_PODS).items
        if p.metadata.uid != old.metadata.uid and _ready(p)], 300)
    # The new agent found both open targets in its state folder on the node (hostPath) and resumed
    # them (the only open ones: earlier captures' targets are final).
    assert "event=agent.resumed targets=2" in api.read_namespaced_pod_log(new.metadata.name, NS, container="agent")

    done = wait_converged(api, cid, 300)
    assert done["phase"] == "converged", done
    targets = {t["rank"]: t for t in done["targets"]}
    assert sorted(targets) == [0, 1]
    manifest = read_manifest(s3, done["manifest_uri"])
    artifacts = {a["rank"]: a for a in manifest["artifacts"]}
    failures = {f["rank"]: f for f in manifest["failures"]}
    assert not artifacts.keys() & failures.keys() and sorted([*artifacts, *failures]) == [0, 1], manifest
    for rank, t in targets.items():
        if t["state"] == "archived":
            art = artifacts[rank]
            assert art["pod"] == pod.metadata.name and archived_size(s3, art["uri"]) == art["size"] > 0
        else:
            # Failed, with the reason said: never lost silently, never a bare internal error.
            assert t["state"] == "failed" and t["reason"] not in (None, "internal_error"), t
            assert (failures[rank]["reason"], failures[rank]["detail"]) == (t["reason"], t["detail"]), manifest
    # ...and finished them: nothing was lost with the old pod.
    assert done["counts"] == {"archived": 2}, [(t["rank"], t["state"], t["reason"], t["detail"]) for t in done["targets"]]
    p = api.read_namespaced_pod(pod.metadata.name, ns)
    assert p.status.phase == "Running" and p.status.container_statuses[0].restart_count == 0


def test_a_replaced_trainer_pod_is_the_next_attempt_with_its_own_coordinator(release, api, gpulens_image, s3):
    from kubernetes import client
    ns = armed_namespace(api)
    custom = client.CustomObjectsApi(api.api_client)

    def pods():
        return api.list_namespaced_pod(ns, label_selector=f"job-name={JOB}").items

    def coordinators():
        return custom.list_namespaced_custom_object(L.GROUP, L.VERSION, ns, L.PLURAL)["items"]
    try:
        client.BatchV1Api(api.api_client).create_namespaced_job(
            ns, trainer_job(gpulens_image, fail_attempt_0=True, backoff_limit=1))
        (first,) = wait_until("the first pod failed", lambda: [p for p in pods() if p.status.phase == "Failed"], 300)
        assert first.metadata.labels.get(L.ATTEMPT) == "0", first.metadata.labels
        assert "attempt 0: failing on purpose" in api.read_namespaced_pod_log(first.metadata.name, ns)
        (second,) = wait_until("the replacement pod", lambda: [
            p for p in pods() if p.metadata.uid != first.metadata.uid], 300)
        assert second.metadata.labels.get(L.ATTEMPT) == "1", second.metadata.labels
        wait_training(api, ns, second.metadata.name)        # GPULENS_ATTEMPT=1 reached it: it trains

        want = L.coordinator_name(JOB, 1)
        wait_until("only attempt 1's CaptureCoordinator", lambda: [
            (c["metadata"]["name"], c["spec"]["attempt"]) for c in coordinators()
            if not c["metadata"].get("deletionTimestamp")] == [(want, 1)], 300)
        (coord,) = wait_until("the attempt-1 coordinator pod Ready", lambda: [
            p for p in api.list_namespaced_pod(ns, label_selector=COORDINATOR_PODS).items
            if (p.metadata.labels or {}).get(L.COORDINATOR_OF) == want and _ready(p)], 300)
        # the Service is the operator's to keep: wait for it (the garbage collector may take the
        # attempt-0 one while the operator hands it over; reconcile.py creates it again at once)
        def service_selector():
            items = api.list_namespaced_service(ns, field_selector=f"metadata.name={L.service_name(JOB)}").items
            return items[0].spec.selector if items else None
        wait_until("the job's Service selecting the attempt-1 coordinator",
                   lambda: service_selector() == {L.COORDINATOR_OF: want}, 120)

        def endpoints():
            subsets = api.read_namespaced_endpoints(L.service_name(JOB), ns).subsets or []
            return sorted(a.ip for s in subsets for a in s.addresses or [])
        wait_until("the job's Service serving the attempt-1 coordinator", lambda: endpoints() == [coord.status.pod_ip], 120)

        cid = start_capture(api, ns, duration_ms=1500)
        done = wait_converged(api, cid, 300)
        assert (done["phase"], done["attempt"], done["counts"]) == ("converged", 1, {"archived": 2}), done
        assert f"/{ns}/{JOB}/1/{cid}/" in done["manifest_uri"], done["manifest_uri"]
        manifest = read_manifest(s3, done["manifest_uri"])
        assert manifest["attempt"] == 1 and manifest["failures"] == []
        assert {a["pod"] for a in manifest["artifacts"]} == {second.metadata.name}
    finally:
        api.delete_namespace(ns)
