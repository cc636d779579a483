"""Kubernetes discovery: the job's pods (label selector, real `kubernetes` client), expanded into
one target per worker.

Per pod: the local world size is the `gpulens.dev/local-world-size` annotation (stamped at
creation by the arming webhook when the launch states it, default 1, raised by the workers'
registration records); the base rank comes, in this order, from the
registration records the pod's node agent reports (`GET /v1/workers`: what the workers really
are), the `gpulens.dev/base-rank` annotation, an indexed Job's completion index, or a PyTorchJob
replica index (times the local world size). The agent address is the pod's node (`{node}`) or
node IP (`{node_ip}`). Only reads: the hot path never writes to the Kubernetes API.
"""

from __future__ import annotations

import asyncio
from typing import Any, Mapping

from gpulens.ground.logs import get_logger

from .agents import AgentFleet, AgentFailure
from .discovery import AgentUrls, DiscoveryError
from .targets import PodFacts, Snapshot, expand, expand_replicas

__all__ = ["KubernetesDiscovery", "base_rank_from_pod", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "BASE_RANK"]

log = get_logger("coordinator")

LOCAL_WORLD_SIZE = "gpulens.dev/local-world-size"
WORLD_SIZE = "gpulens.dev/world-size"
BASE_RANK = "gpulens.dev/base-rank"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
PYTORCHJOB_REPLICA_TYPE = "training.kubeflow.org/replica-type"
PYTORCHJOB_REPLICA_INDEX = "training.kubeflow.org/replica-index"


def _int(value: Any) -> int | None:
    text = str(value if value is not None else "").strip()
    return int(text) if text.isdigit() else None


def base_rank_from_pod(pod: Mapping[str, Any], local_world_size: int) -> int | None:
    """The base rank a pod was given at creation, or None when it recorded none."""
    meta = pod.get("metadata") or {}
    ann, lbl = meta.get("annotations") or {}, meta.get("labels") or {}
    explicit = _int(ann.get(BASE_RANK))
    if explicit is not None:
        return explicit
    index = _int(lbl.get(COMPLETION_INDEX, ann.get(COMPLETION_INDEX)))
    if index is not None:
        return index * local_world_size
    kind, rindex = str(lbl.get(PYTORCHJOB_REPLICA_TYPE, "")).lower(), _int(lbl.get(PYTORCHJOB_REPLICA_INDEX))
    if kind and rindex is not None:
        # the Kubeflow training operator gives the master group rank 0 and worker i group rank i + 1
        return 0 if kind == "master" else (rindex + 1) * local_world_size
    return None


def _live(pod: Mapping[str, Any]) -> bool:
    return not (pod.get("metadata") or {}).get("deletionTimestamp") and \
        (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")


class KubernetesDiscovery:
    def __init__(self, api_client, *, namespace: str, selector: str, job_id: str, attempt: int,
                 agents: AgentUrls, agent_client: AgentFleet | None = None, workers_timeout_s: float = 5.0,
                 serving: bool = False):
        self.api_client, self.namespace, self.selector = api_client, namespace, selector
        self.serving = serving   # a serving revision: replicas, each its own world (targets.expand_replicas)
        self.job_id, self.attempt, self.agents = job_id, attempt, agents
        self.agent_client, self.workers_timeout_s = agent_client, workers_timeout_s

    def _list_pods(self) -> list[dict[str, Any]]:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException
        try:
            raw = client.CoreV1Api(self.api_client).list_namespaced_pod(
                self.namespace, label_selector=self.selector, _preload_content=False, _request_timeout=15)
            return list(raw.json().get("items") or [])
        except ApiException as exc:
            raise DiscoveryError(f"listing pods in {self.namespace} ({self.selector}): HTTP {exc.status} {exc.reason}") from exc
        except Exception as exc:  # urllib3 raises many types for network faults
            raise DiscoveryError(f"listing pods in {self.namespace} ({self.selector}): {exc}") from exc

    async def _workers(self, urls: set[str]) -> dict[str, list[dict[str, Any]] | None]:
        """Each agent's live registration records; None for an agent that did not answer."""
        async def one(url: str):
            try:
                return url, await asyncio.wait_for(self.agent_client.workers(url), self.workers_timeout_s)
            except (AgentFailure, asyncio.TimeoutError) as exc:
                log.warning("discovery.agent_unreachable", agent=url, error=str(exc))
                return url, None
        if self.agent_client is None:
            return {u: None for u in urls}
        return dict(await asyncio.gather(*(one(u) for u in sorted(urls))))

    async def snapshot(self) -> Snapshot:
        pods = [p for p in await asyncio.to_thread(self._list_pods) if _live(p)]
        if not pods:
            raise DiscoveryError(f"no live pods match {self.selector!r} in namespace {self.namespace}")
        urls = {}
        for p in pods:
            meta, spec, status = p.get("metadata") or {}, p.get("spec") or {}, p.get("status") or {}
            urls[meta.get("uid") or meta.get("name")] = self.agents.for_node(spec.get("nodeName") or "",
                                                                             status.get("hostIP") or "")
        workers = await self._workers({u for u in urls.values() if u})
        facts, world_sizes, warnings = [], [], []
        for p in pods:
            meta, spec = p.get("metadata") or {}, p.get("spec") or {}
            name, uid = meta.get("name", ""), meta.get("uid", "")
            ann = meta.get("annotations") or {}
            lws = _int(ann.get(LOCAL_WORLD_SIZE)) or 1
            ws = _int(ann.get(WORLD_SIZE))
            if ws:
                world_sizes.append(ws)
            url = urls[uid or name]
            base = base_rank_from_pod(p, lws)
            registered = None
            recs = workers.get(url) if url else None
            if recs is not None:
                mine = [r for r in recs if self._is_worker_of(r, name, uid)]
                registered = frozenset(int(r["local_rank"]) for r in mine if isinstance(r.get("local_rank"), int))
                bases = {int(r["global_rank"]) - int(r["local_rank"]) for r in mine
                         if isinstance(r.get("global_rank"), int) and isinstance(r.get("local_rank"), int)}
                lws = max([lws] + [int(r["local_world_size"]) for r in mine if isinstance(r.get("local_world_size"), int)])
                if len(bases) == 1:
                    (recorded,) = bases
                    if base is not None and base != recorded:
                        warnings.append(f"{name}: pod says base rank {base}, its workers say {recorded}; using the workers'")
                    base = recorded
                for r in mine:
                    if isinstance(r.get("world_size"), int):
                        world_sizes.append(r["world_size"])
            facts.append(PodFacts(pod=name, node=spec.get("nodeName") or "", pod_uid=uid, local_world_size=lws,
                                  base_rank=base, agent_url=url, registered_local_ranks=registered,
                                  unregistered_note=f"{name}'s agent lists no live registration for this worker"))
        if self.serving:
            targets, more = expand_replicas(facts)
            return Snapshot(targets, None, "kubernetes", warnings=tuple(warnings) + more)
        world_size = max(world_sizes) if world_sizes else None
        targets, more = expand(facts, world_size)
        return Snapshot(targets, world_size, "kubernetes", warnings=tuple(warnings) + more)

    def _is_worker_of(self, rec: Mapping[str, Any], pod: str, uid: str) -> bool:
        if rec.get("job_id") != self.job_id or rec.get("attempt") != self.attempt or rec.get("alive") is False:
            return False
        if uid and rec.get("pod_uid"):
            return rec.get("pod_uid") == uid
        return rec.get("pod") == pod and rec.get("namespace") == self.namespace
