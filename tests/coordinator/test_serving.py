"""A serving revision's coordinator (issue 30): its pods are replicas whose workers all say rank
0..N-1, so the capture numbers them apart and tells each agent the worker's own rank; an
alert-started capture takes the named pod plus N healthy peers, a person may name pods or ask for
N replicas; a training coordinator refuses any of that (it captures every rank)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpulens.capture.coordinator import LocalDiscovery
from gpulens.capture.coordinator.service import RequestMismatch
from gpulens.capture.models import CaptureRequest, Manifest, TargetState

from .agent_double import AgentDouble, RunningAgent
from .conftest import AGENT_TOKEN, make_coordinator, record, write_record


def write_replicas(registry, pods: dict[str, str], workers: int = 1) -> None:
    """pods: name -> node; every replica's workers register ranks 0..workers-1 of their own world."""
    for pod, node in pods.items():
        for local in range(workers):
            write_record(registry, record(job="web-aaaa1", namespace="serve", pod=pod, node=node, rank=local,
                                          local_rank=local, world_size=workers, local_world_size=workers))


def serving(tmp_path, http, agents: dict[str, str]):
    discovery = LocalDiscovery(tmp_path / "registry", job_id="web-aaaa1", attempt=0, namespace="serve",
                               agents=_Urls(agents), serving=True)
    c = make_coordinator(tmp_path, http, agents, job="web-aaaa1", namespace="serve", discovery=discovery)
    c.settings = replace(c.settings, serving=True)
    return c


class _Urls:
    def __init__(self, table):
        self.table = table

    def for_node(self, node, node_ip=""):
        return self.table.get(node)


def dispatched(*agents: AgentDouble) -> dict[str, tuple[int, int | None]]:
    """pod -> (capture rank, worker rank) of every target the agents were sent."""
    out = {}
    for a in agents:
        for entries in a.captures.values():
            for e in entries.values():
                out[f"{e.dispatch.pod}/{e.dispatch.local_rank}"] = (e.dispatch.rank, e.dispatch.worker_rank)
    return out


async def run(c, request: CaptureRequest):
    rec, _ = c.start(request)
    await c.wait(rec.capture_id)
    return rec


async def test_an_alerted_replica_and_one_peer_are_captured_not_every_replica(tmp_path, http):
    write_replicas(tmp_path / "registry", {"web-aaaa1-x": "node-a", "web-aaaa1-y": "node-b", "web-aaaa1-z": "node-b"})
    async with RunningAgent(AgentDouble("node-a", AGENT_TOKEN)) as a, \
            RunningAgent(AgentDouble("node-b", AGENT_TOKEN)) as b:
        c = serving(tmp_path, http, {"node-a": a.url, "node-b": b.url})
        rec = await run(c, CaptureRequest(job_id="web-aaaa1", duration_ms=200, pods=("web-aaaa1-z",), peers=1))
        await c.close()
    assert rec.fully_succeeded, rec.phase
    # the named pod first, then the first healthy peer by name; y is not captured
    assert dispatched(a.double, b.double) == {"web-aaaa1-z/0": (0, 0), "web-aaaa1-x/0": (1, 0)}
    m = Manifest.from_json(open(rec.manifest_uri.removeprefix("file://")).read())
    assert sorted((art.rank, art.pod) for art in m.artifacts) == [(0, "web-aaaa1-z"), (1, "web-aaaa1-x")]
    assert m.request["pods"] == ["web-aaaa1-z"] and m.request["peers"] == 1


async def test_every_replica_is_captured_with_distinct_ranks_and_tp_workers_are_targets(tmp_path, http):
    write_replicas(tmp_path / "registry", {"web-aaaa1-x": "node-a", "web-aaaa1-y": "node-a"}, workers=2)
    async with RunningAgent(AgentDouble("node-a", AGENT_TOKEN)) as a:
        c = serving(tmp_path, http, {"node-a": a.url})
        rec = await run(c, CaptureRequest(job_id="web-aaaa1", duration_ms=200))
        await c.close()
    assert rec.fully_succeeded
    # four workers (two tensor-parallel workers per replica); every replica says ranks 0 and 1
    assert dispatched(a.double) == {"web-aaaa1-x/0": (0, 0), "web-aaaa1-x/1": (1, 1),
                                    "web-aaaa1-y/0": (2, 0), "web-aaaa1-y/1": (3, 1)}


async def test_n_replicas_without_names_and_a_missing_named_pod_is_a_visible_failure(tmp_path, http):
    write_replicas(tmp_path / "registry", {"web-aaaa1-x": "node-a", "web-aaaa1-y": "node-a", "web-aaaa1-z": "node-a"})
    async with RunningAgent(AgentDouble("node-a", AGENT_TOKEN)) as a:
        c = serving(tmp_path, http, {"node-a": a.url})
        two = await run(c, CaptureRequest(job_id="web-aaaa1", duration_ms=200, replicas=2))
        gone = await run(c, CaptureRequest(job_id="web-aaaa1", duration_ms=200, pods=("web-aaaa1-old",), peers=1))
        await c.close()
    assert sorted(p.target.pod for p in two.targets.values()) == ["web-aaaa1-x", "web-aaaa1-y"]
    by_pod = {p.target.pod: p for p in gone.targets.values()}
    assert set(by_pod) == {"web-aaaa1-old", "web-aaaa1-x"}
    assert by_pod["web-aaaa1-old"].state == TargetState.FAILED and "not a live pod" in by_pod["web-aaaa1-old"].detail
    assert by_pod["web-aaaa1-x"].state == TargetState.ARCHIVED and not gone.fully_succeeded


@pytest.mark.parametrize("request_, field", [
    (CaptureRequest(job_id="web-aaaa1", duration_ms=200, iterations=5), "iterations"),
    (CaptureRequest(job_id="web-aaaa1", duration_ms=200, pods=("web-aaaa1-x",), replicas=2), "replicas"),
])
async def test_a_serving_coordinator_refuses_what_a_replica_capture_cannot_be(tmp_path, http, request_, field):
    c = serving(tmp_path, http, {})
    with pytest.raises(RequestMismatch) as err:
        c.start(request_)
    assert err.value.field == field and c.captures == {}


async def test_a_training_coordinator_refuses_pod_selection(tmp_path, http):
    c = make_coordinator(tmp_path, http, {})
    for req in (CaptureRequest(job_id="train", duration_ms=200, pods=("train-0",)),
                CaptureRequest(job_id="train", duration_ms=200, replicas=1),
                CaptureRequest(job_id="train", duration_ms=200, peers=0)):
        with pytest.raises(RequestMismatch) as err:
            c.start(req)
        assert err.value.field == "pods"
    assert c.captures == {}
