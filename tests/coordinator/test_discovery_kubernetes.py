"""Kubernetes discovery through the real `kubernetes` client against a Kubernetes API served by
kmock (tests/operator/apiserver.py: kmock's emulator plus label selectors, over real HTTP), and
the node agents' `GET /v1/workers` (agent doubles)."""

from __future__ import annotations

import asyncio
import json

import pytest
from kubernetes import client

from gpulens.capture.coordinator import AgentFleet, AgentUrls, DiscoveryError, Phase
from gpulens.capture.wire.auth import SecretFile
from gpulens.capture.coordinator.kube_discovery import KubernetesDiscovery
from gpulens.capture.models import CaptureRequest, Manifest
from tests.operator.apiserver import running_apiserver

from .agent_double import AgentDouble, RunningAgent
from .conftest import AGENT_TOKEN, make_coordinator, record

NS, SELECTOR = "ml", "gpulens.dev/job=train,gpulens.dev/armed=true"


@pytest.fixture
def apiserver():
    with running_apiserver() as api:
        yield api


def create_pod(api, name: str, *, node: str | None, lws: int, index: int | None = None, ws: int | None = None,
               labels: dict | None = None, phase: str = "Running", host_ip: str = "127.0.0.1") -> dict:
    core = client.CoreV1Api(api.api_client())
    lbl = {"gpulens.dev/job": "train", "gpulens.dev/armed": "true", **(labels or {})}
    ann = {"gpulens.dev/local-world-size": str(lws)}
    if ws:
        ann["gpulens.dev/world-size"] = str(ws)
    if index is not None:
        lbl["batch.kubernetes.io/job-completion-index"] = str(index)
    spec = {"containers": [{"name": "trainer", "image": "trainer:1"}]}
    if node:
        spec["nodeName"] = node
    core.create_namespaced_pod(NS, {"apiVersion": "v1", "kind": "Pod",
                                    "metadata": {"name": name, "labels": lbl, "annotations": ann}, "spec": spec},
                               _preload_content=False)
    status = {"phase": phase, **({"hostIP": host_ip} if node else {})}
    raw = core.patch_namespaced_pod_status(name, NS, {"status": status}, _preload_content=False,
                                           _content_type="application/merge-patch+json")
    return json.loads(raw.data)


def workers_of(pod: dict, ranks: list[int], lws: int, ws: int) -> list[dict]:
    out = []
    for r in ranks:
        rec = record(pod=pod["metadata"]["name"], node=pod["spec"].get("nodeName", ""), rank=r, local_rank=r % lws,
                     world_size=ws, local_world_size=lws)
        rec["pod_uid"] = pod["metadata"]["uid"]
        out.append({**rec, "host_pid": 4000 + r, "alive": True})
    return out


class PortTable:
    """{node} -> agent double URL (each double listens on its own loopback port)."""

    def __init__(self, table):
        self.table = table

    def for_node(self, node, node_ip=""):
        return self.table.get(node)


async def test_nproc_per_node_4_is_four_targets_and_a_missing_worker_is_not_registered(apiserver, http, agent_token_file):
    double = AgentDouble("node-a", AGENT_TOKEN)
    async with RunningAgent(double) as agent:
        pod = create_pod(apiserver, "train-0", node="node-a", lws=4)
        double.workers = workers_of(pod, [0, 1, 3], lws=4, ws=4)          # local rank 2 never registered
        d = KubernetesDiscovery(apiserver.api_client(), namespace=NS, selector=SELECTOR, job_id="train", attempt=0,
                                agents=PortTable({"node-a": agent.url}),
                                agent_client=AgentFleet(http, SecretFile.required(agent_token_file)))
        snap = await d.snapshot()
    assert [(t.target_id, t.local_rank, t.pod, t.registered) for t in snap.targets] == [
        ("rank-0", 0, "train-0", True), ("rank-1", 1, "train-0", True),
        ("rank-2", 2, "train-0", False), ("rank-3", 3, "train-0", True)]
    assert "no live registration" in snap.targets[2].note
    # the discovery really went through the API server with the selector
    assert any(path.endswith(f"/namespaces/{NS}/pods") and "labelSelector" in query
               for _, path, query in apiserver.requests())


async def test_base_ranks_come_from_workers_else_the_completion_index(apiserver, http, agent_token_file):
    double = AgentDouble("node-a", AGENT_TOKEN)
    async with RunningAgent(double) as agent:
        p0 = create_pod(apiserver, "train-0", node="node-a", lws=2, index=0, ws=6)
        create_pod(apiserver, "train-1", node="node-b", lws=2, index=1, ws=6)      # node-b's agent is absent
        create_pod(apiserver, "train-2", node=None, lws=2, index=2, ws=6, phase="Pending")  # not scheduled
        double.workers = workers_of(p0, [0, 1], lws=2, ws=6)
        d = KubernetesDiscovery(apiserver.api_client(), namespace=NS, selector=SELECTOR, job_id="train", attempt=0,
                                agents=PortTable({"node-a": agent.url, "node-b": "http://127.0.0.1:9"}),
                                agent_client=AgentFleet(http, SecretFile.required(agent_token_file), timeout_s=1),
                                workers_timeout_s=2)
        snap = await d.snapshot()
    by_rank = {t.rank: t for t in snap.targets}
    assert sorted(by_rank) == [0, 1, 2, 3, 4, 5]
    assert [by_rank[r].pod for r in range(6)] == ["train-0"] * 2 + ["train-1"] * 2 + ["train-2"] * 2
    # node-b's agent did not answer: its workers are dispatched anyway (the agent decides there)
    assert by_rank[2].registered and by_rank[2].agent_url == "http://127.0.0.1:9"
    assert not by_rank[4].registered and "not scheduled" in by_rank[4].note


async def test_finished_and_foreign_pods_are_not_targets(apiserver, http, agent_token_file):
    double = AgentDouble("node-a", AGENT_TOKEN)
    async with RunningAgent(double) as agent:
        p = create_pod(apiserver, "train-0", node="node-a", lws=1, index=0)
        create_pod(apiserver, "train-old", node="node-a", lws=1, index=1, phase="Failed")
        create_pod(apiserver, "other-0", node="node-a", lws=1, index=0, labels={"gpulens.dev/job": "other"})
        double.workers = workers_of(p, [0], lws=1, ws=1)
        d = KubernetesDiscovery(apiserver.api_client(), namespace=NS, selector=SELECTOR, job_id="train", attempt=0,
                                agents=PortTable({"node-a": agent.url}),
                                agent_client=AgentFleet(http, SecretFile.required(agent_token_file)))
        snap = await d.snapshot()
    assert [t.pod for t in snap.targets] == ["train-0"]


async def test_an_unreachable_api_server_means_the_capture_cannot_run(http, agent_token_file):
    cfg = client.Configuration()
    cfg.host = "http://127.0.0.1:9"
    cfg.retries = 0
    d = KubernetesDiscovery(client.ApiClient(cfg), namespace=NS, selector=SELECTOR, job_id="train", attempt=0,
                            agents=AgentUrls(template="http://{node_ip}:9451"))
    with pytest.raises(DiscoveryError, match="listing pods"):
        await d.snapshot()


async def test_a_pod_created_after_prepare_belongs_to_the_next_capture(apiserver, http, tmp_path, agent_token_file):
    double = AgentDouble("node-a", AGENT_TOKEN, step_s=0.3)
    async with RunningAgent(double) as agent:
        p0 = create_pod(apiserver, "train-0", node="node-a", lws=2, index=0)
        double.workers = workers_of(p0, [0, 1], lws=2, ws=2)
        d = KubernetesDiscovery(apiserver.api_client(), namespace=NS, selector=SELECTOR, job_id="train", attempt=0,
                                agents=PortTable({"node-a": agent.url}),
                                agent_client=AgentFleet(http, SecretFile.required(agent_token_file)))
        c = make_coordinator(tmp_path, http, {}, discovery=d)
        first, _ = c.start(CaptureRequest(job_id="train", duration_ms=200))
        while first.phase == Phase.PREPARING:
            await asyncio.sleep(0.02)
        assert first.phase == Phase.CAPTURING
        p1 = create_pod(apiserver, "train-1", node="node-a", lws=2, index=1)   # scale-up during the capture
        double.workers += workers_of(p1, [2, 3], lws=2, ws=4)
        await c.wait(first.capture_id)
        second, _ = c.start(CaptureRequest(job_id="train", duration_ms=200))
        await c.wait(second.capture_id)
        await c.close()
    m1 = Manifest.from_json(open(first.manifest_uri.removeprefix("file://")).read())
    m2 = Manifest.from_json(open(second.manifest_uri.removeprefix("file://")).read())
    assert [t.pod for t in m1.expected_targets] == ["train-0", "train-0"] and m1.fully_succeeded
    assert [t.pod for t in m2.expected_targets] == ["train-0", "train-0", "train-1", "train-1"]
    assert {cid for cid, _ in double.dispatches if _ in ("rank-2", "rank-3")} == {second.capture_id}
