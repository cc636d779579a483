"""Discovery behind one interface: who are the workers of this (job, attempt) right now?

`LocalDiscovery` reads registration files (the embedded default, `gpulens up`);
`KubernetesDiscovery` (in kube_discovery.py) lists the job's pods. Both return a frozen
`Snapshot`; the coordinator never looks again during a capture.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from gpulens.capture.models import RegistrationRecord
from gpulens.ground.logs import get_logger

from .targets import PodFacts, Snapshot, expand, expand_replicas

__all__ = ["Discovery", "DiscoveryError", "LocalDiscovery", "AgentUrls", "read_records"]

log = get_logger("coordinator")


class DiscoveryError(Exception):
    """Discovery could not produce a snapshot (API unreachable, nothing found): the capture cannot run."""


class Discovery(Protocol):
    async def snapshot(self) -> Snapshot: ...


@dataclass(frozen=True)
class AgentUrls:
    """Where a node's agent listens: one fixed URL, or a template with {node} and {node_ip}."""

    url: str | None = None
    template: str | None = None

    def __post_init__(self) -> None:
        if (self.url is None) == (self.template is None):
            raise ValueError("give exactly one of an agent URL or an agent URL template")

    def for_node(self, node: str, node_ip: str = "") -> str | None:
        if self.url:
            return self.url
        if not node and "{node}" in self.template:
            return None
        if not node_ip and "{node_ip}" in self.template:
            return None
        return self.template.format(node=node, node_ip=node_ip)


def read_records(registry_dir: Path, *, job_id: str, attempt: int, namespace: str | None) -> tuple[list[RegistrationRecord], list[str]]:
    """The records of one (namespace, job, attempt); unreadable files are reported, not fatal."""
    records, problems = [], []
    try:
        paths = sorted(Path(registry_dir).glob("*.json"))
    except OSError as exc:
        raise DiscoveryError(f"cannot list {registry_dir}: {exc}") from exc
    for path in paths:
        try:
            rec = RegistrationRecord.load(path)
        except FileNotFoundError:
            continue  # the worker exited between listing and reading
        except (OSError, ValueError) as exc:  # SchemaError is a ValueError
            problems.append(f"{path.name}: {exc}")
            continue
        if rec.job_id == job_id and rec.attempt == attempt and (namespace is None or rec.namespace == namespace):
            records.append(rec)
    return records, problems


class LocalDiscovery:
    """Targets from registration files: the hook writes one per worker, so a missing file is a
    missing worker. Workers of one pod share (namespace, pod uid or pod name)."""

    def __init__(self, registry_dir: Path, *, job_id: str, attempt: int, namespace: str | None,
                 agents: AgentUrls, is_alive: Callable[[RegistrationRecord], bool] | None = None,
                 serving: bool = False):
        self.registry_dir, self.job_id, self.attempt, self.namespace = Path(registry_dir), job_id, attempt, namespace
        self.serving = serving   # a serving revision: replicas, each its own world (targets.expand_replicas)
        self.agents = agents
        self.is_alive = is_alive

    async def snapshot(self) -> Snapshot:
        records, problems = await asyncio.to_thread(
            read_records, self.registry_dir, job_id=self.job_id, attempt=self.attempt, namespace=self.namespace)
        for p in problems:
            log.warning("discovery.bad_record", job_id=self.job_id, detail=p)
        if self.is_alive is not None:
            records = [r for r in records if self.is_alive(r)]
        if not records:
            raise DiscoveryError(f"no registration records for job {self.job_id} attempt {self.attempt} "
                                 f"in {self.registry_dir}")
        newest: dict[tuple[str, int], RegistrationRecord] = {}
        for rec in records:  # a rank registered twice (a restarted worker): the newest process is the worker
            key = (rec.pod_uid or rec.pod, rec.global_rank)
            if key not in newest or rec.start_time > newest[key].start_time:
                newest[key] = rec
        pods: dict[str, list[RegistrationRecord]] = {}
        for rec in newest.values():
            pods.setdefault(rec.pod_uid or rec.pod, []).append(rec)
        facts = []
        for recs in pods.values():
            first = min(recs, key=lambda r: r.local_rank)
            facts.append(PodFacts(
                pod=first.pod, node=first.node, pod_uid=first.pod_uid,
                local_world_size=max(r.local_world_size for r in recs),
                base_rank=first.base_rank, agent_url=self.agents.for_node(first.node),
                registered_local_ranks=frozenset(r.local_rank for r in recs)))
        if self.serving:
            targets, warnings = expand_replicas(facts)
            return Snapshot(targets, None, "local", warnings=warnings + tuple(problems))
        world_size = max(r.world_size for r in records)
        targets, warnings = expand(facts, world_size)
        return Snapshot(targets, world_size, "local", warnings=warnings + tuple(problems))
