"""The frozen snapshot: one target per worker process, expanded from pods at prepare time.

Both discoveries (registration files, Kubernetes) reduce what they see to `PodFacts` and call
`expand`, so the rule "a pod with local world size N is N targets; a rank nobody registered is an
explicit not_registered target, never a silent absence" lives in one pure function.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable

from gpulens.capture.models import target_id_for_rank

__all__ = ["Target", "PodFacts", "Snapshot", "expand", "expand_replicas"]


@dataclass(frozen=True)
class Target:
    target_id: str
    rank: int
    local_rank: int
    pod: str
    node: str
    pod_uid: str = ""
    agent_url: str | None = None
    registered: bool = True
    note: str = ""          # why a target is not registered, or how its rank was inferred
    worker_rank: int | None = None   # serving: the rank the worker registered (its replica's own); None: `rank`


@dataclass(frozen=True)
class PodFacts:
    """What discovery knows about one pod of the job at prepare time."""

    pod: str
    node: str
    local_world_size: int
    base_rank: int | None                          # global rank of local rank 0; None: not recorded
    pod_uid: str = ""
    agent_url: str | None = None                   # None: no agent can be addressed (pod not scheduled)
    registered_local_ranks: frozenset[int] | None = None   # None: unknown, let the agent decide
    unregistered_note: str = "the worker never wrote a registration record"


@dataclass(frozen=True)
class Snapshot:
    """The targets of one capture, frozen: pods that appear later belong to the next capture."""

    targets: tuple[Target, ...]
    world_size: int | None = None
    source: str = ""
    taken_at: float = field(default_factory=time.time)
    warnings: tuple[str, ...] = ()

    @property
    def dispatchable(self) -> tuple[Target, ...]:
        return tuple(t for t in self.targets if t.registered and t.agent_url)


def _targets_of(pod: PodFacts, base: int, inferred: bool) -> list[Target]:
    out = []
    for local in range(pod.local_world_size):
        rank = base + local
        registered = pod.agent_url is not None and (
            pod.registered_local_ranks is None or local in pod.registered_local_ranks)
        if pod.agent_url is None:
            note = "the pod has no node (not scheduled), so no agent can reach it"
        elif not registered:
            note = pod.unregistered_note
        else:
            note = ""
        if inferred:
            registered = False
            note = (f"{pod.pod} recorded no base rank and none of its workers registered; "
                    f"rank {rank} inferred from the ranks no other pod holds")
        out.append(Target(target_id_for_rank(rank), rank, local, pod.pod, pod.node, pod.pod_uid,
                          pod.agent_url, registered, note))
    return out


def expand(pods: Iterable[PodFacts], world_size: int | None = None) -> tuple[tuple[Target, ...], tuple[str, ...]]:
    """Targets for `pods`, sorted by rank, plus warnings about what did not add up.

    Pods with a known base rank claim their ranks first (in pod-name order; a rank claimed twice
    keeps its first pod and warns). Pods without one get the ranks nobody holds, lowest first,
    as not_registered targets. With a known world size, ranks that no pod holds at all become
    not_registered targets of pod "" (the pod is missing), so a lost pod is visible too.
    """
    pods = sorted(pods, key=lambda p: p.pod)
    warnings: list[str] = []
    by_rank: dict[int, Target] = {}
    for pod in (p for p in pods if p.base_rank is not None):
        for t in _targets_of(pod, pod.base_rank, inferred=False):
            if t.rank in by_rank:
                warnings.append(f"rank {t.rank} claimed by both {by_rank[t.rank].pod} and {t.pod}; kept {by_rank[t.rank].pod}")
                continue
            by_rank[t.rank] = t
    unknown = [p for p in pods if p.base_rank is None]
    free = iter(sorted(set(range(world_size or 0)) - set(by_rank)))
    next_rank = max(by_rank, default=-1) + 1
    for pod in unknown:
        ranks = []
        for _ in range(pod.local_world_size):
            r = next(free, None)
            if r is None:
                while next_rank in by_rank:
                    next_rank += 1
                r, next_rank = next_rank, next_rank + 1
            ranks.append(r)
        for local, r in enumerate(ranks):
            t = _targets_of(pod, r - local, inferred=True)[local]
            by_rank[r] = t
        warnings.append(f"{pod.pod}: no base rank known; its workers are not_registered targets {ranks}")
    if world_size:
        for r in sorted(set(range(world_size)) - set(by_rank)):
            by_rank[r] = Target(target_id_for_rank(r), r, 0, "", "", "", None, False,
                                f"no live pod of the job holds rank {r} (world size {world_size})")
        beyond = [r for r in by_rank if r >= world_size]
        if beyond:
            warnings.append(f"ranks {sorted(beyond)} are beyond the recorded world size {world_size}")
    return tuple(by_rank[r] for r in sorted(by_rank)), tuple(warnings)


def expand_replicas(pods: Iterable[PodFacts]) -> tuple[tuple[Target, ...], tuple[str, ...]]:
    """Targets of a serving revision: each pod is a replica with its own world (its workers say
    ranks 0..N-1, as every replica's do), so the capture numbers them apart, replica after
    replica in pod-name order, and keeps each worker's own rank (`worker_rank`) for its agent.
    """
    out: list[Target] = []
    offset = 0
    for pod in sorted(pods, key=lambda p: p.pod):
        base = pod.base_rank or 0
        for t in _targets_of(pod, offset, inferred=False):
            out.append(Target(t.target_id, t.rank, t.local_rank, t.pod, t.node, t.pod_uid, t.agent_url,
                              t.registered, t.note, worker_rank=base + t.local_rank))
        offset += pod.local_world_size
    return tuple(out), ()
