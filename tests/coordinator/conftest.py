"""Fixtures for coordinator tests: registration records as the hook writes them, agent doubles
on loopback, and an in-process Coordinator wired to both with short deadlines."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gpulens.capture.coordinator import (AgentFleet, AgentUrls, Coordinator, CoordinatorSettings, DeadlinePolicy,
                                 FanoutSettings, LocalDiscovery)
from gpulens.capture.wire.auth import SecretFile

AGENT_TOKEN = "agent-secret-token"

#: Deadlines scaled for tests: a capture of 100-300 ms converges in well under the deadline.
FAST = DeadlinePolicy(start_delay_s=0.5, dispatch_s=0.5, write_s=0.2, write_per_window=0.0, archive_s=0.5,
                      report_s=0.5)
FAST_FANOUT = FanoutSettings(poll_interval_s=0.05, max_poll_interval_s=0.2, backoff_initial_s=0.05,
                             backoff_max_s=0.2, wall_start_lead_s=0.2)   # agent doubles: no Kineto to wait for


def record(*, job: str = "train", attempt: int = 0, namespace: str = "ml", pod: str = "train-0",
           node: str = "node-a", rank: int = 0, local_rank: int = 0, world_size: int = 2,
           local_world_size: int = 2, pid: int = 100, start_time: float | None = None) -> dict[str, Any]:
    return {"schema_version": 1, "job_id": job, "attempt": attempt, "namespace": namespace, "pod": pod,
            "pod_uid": f"uid-{pod}", "container": "trainer", "node": node, "global_rank": rank,
            "local_rank": local_rank, "world_size": world_size, "local_world_size": local_world_size,
            "group_rank": rank // local_world_size, "pid": pid + rank, "pid_namespace": f"pid:[{4026531836 + sum(map(ord, namespace + pod))}]",
            "kineto_job_id": 1234, "start_time": start_time or time.time(), "trace_dir": "/tmp/t",
            "socket_dir": "/tmp/s", "host_pid": None, "hostname": pod}


def write_record(registry: Path, rec: dict[str, Any]) -> Path:
    """Atomically, under the hook's file name (docs/ARCHITECTURE.md, "The trainer hook")."""
    registry.mkdir(parents=True, exist_ok=True)
    pidns = rec["pid_namespace"].strip("pid:[]")
    path = registry / f"{rec['job_id']}__a{rec['attempt']}__r{rec['global_rank']}__ns{pidns}__p{rec['pid']}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(rec))
    os.replace(tmp, path)
    return path


def write_job(registry: Path, *, pods: dict[str, tuple[str, int]], local_world_size: int, skip: set[int] = frozenset(),
              job: str = "train", namespace: str = "ml", attempt: int = 0) -> None:
    """pods: name -> (node, base rank). Ranks in `skip` get no record (a worker that never registered)."""
    world = local_world_size * len(pods)
    for name, (node, base) in pods.items():
        for local in range(local_world_size):
            if base + local not in skip:
                write_record(registry, record(job=job, namespace=namespace, attempt=attempt, pod=name, node=node,
                                              rank=base + local, local_rank=local, world_size=world,
                                              local_world_size=local_world_size))


@pytest.fixture
def agent_token_file(tmp_path: Path) -> Path:
    path = tmp_path / "agent.token"
    path.write_text(AGENT_TOKEN + "\n")
    return path


@pytest.fixture
async def http():
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        yield session


def make_coordinator(tmp_path: Path, session: aiohttp.ClientSession, agents: AgentUrls | dict[str, str], *,
                     job: str = "train", namespace: str = "ml", attempt: int = 0, registry: Path | None = None,
                     discovery=None, policy: DeadlinePolicy = FAST, **kw) -> Coordinator:
    token = tmp_path / "agent.token"
    if not token.exists():
        token.write_text(AGENT_TOKEN)
    if isinstance(agents, dict):  # node -> URL: a template over a tiny lookup, like {node_ip} in a cluster
        agents = _TableUrls(dict(agents))
    settings = CoordinatorSettings(job_id=job, attempt=attempt, namespace=namespace,
                                   archive_root=kw.pop("archive_root", f"file://{tmp_path / 'archive'}"), deadlines=policy,
                                   fanout=kw.pop("fanout", FAST_FANOUT), state_dir=kw.pop("state_dir", None))
    discovery = discovery or LocalDiscovery(registry or tmp_path / "registry", job_id=job, attempt=attempt,
                                            namespace=namespace, agents=agents)
    return Coordinator(settings, discovery, AgentFleet(session, SecretFile(token), timeout_s=1.0),
                       annotation_backoff_s=(0.05, 0.2), **kw)


class _TableUrls:
    """AgentUrls stand-in for tests: node name -> agent double URL (each double has its own port)."""

    def __init__(self, table: dict[str, str]):
        self.table = table

    def for_node(self, node: str, node_ip: str = "") -> str | None:
        return self.table.get(node)
