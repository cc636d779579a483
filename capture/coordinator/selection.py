"""Which replicas of a serving revision one capture takes (issue 30): a pure function of the
frozen snapshot and the request.

An alert names the pod it is about; the capture takes that pod plus `peers` other replicas of the
same revision (for the report to compare against), not every replica. A person may name pods, or
ask for `replicas` of them. Peers are chosen among replicas whose every worker is dispatchable
(registered, on a node an agent serves), in pod-name order, so the choice is repeatable. A named
pod the revision does not have is an explicit failed target of the capture, never silently
dropped. A training snapshot is never subset here: every rank of its world is captured.
"""

from __future__ import annotations

from dataclasses import replace

from gpulens.capture.models import CaptureRequest, target_id_for_rank

from .targets import Snapshot, Target

__all__ = ["select_replicas", "SelectionError"]


class SelectionError(Exception):
    """Nothing of what the request asked for is in the revision."""


def _renumber(targets: list[Target]) -> tuple[Target, ...]:
    """Capture ranks 0..n-1 over the selected targets, replica after replica (the manifest's ranks)."""
    return tuple(replace(t, rank=i, target_id=target_id_for_rank(i)) for i, t in enumerate(targets))


def select_replicas(snapshot: Snapshot, request: CaptureRequest) -> Snapshot:
    """The snapshot restricted to the replicas `request` asks for (all of them when it asks none)."""
    if not request.selects_pods:
        return snapshot
    by_pod: dict[str, list[Target]] = {}
    for t in snapshot.targets:
        by_pod.setdefault(t.pod, []).append(t)
    healthy = [p for p, ts in sorted(by_pod.items()) if p and all(t.registered and t.agent_url for t in ts)]
    warnings = list(snapshot.warnings)
    chosen: list[str] = []
    missing: list[str] = []
    for name in request.pods:
        (chosen if name in by_pod else missing).append(name)
    if request.pods:
        want = request.peers or 0
    else:
        want = request.replicas or 0
    peers = [p for p in healthy if p not in chosen][:want]
    if len(peers) < want:
        warnings.append(f"asked for {want} {'peer' if request.pods else 'replica'}(s), the revision has "
                        f"{len(peers)} more healthy replica(s)")
    if not chosen and not peers:
        raise SelectionError(f"none of the pods {list(request.pods)} is a live replica of this revision "
                             f"(it has {sorted(p for p in by_pod if p)})" if request.pods else
                             "the revision has no healthy replica to capture")
    picked: list[Target] = []
    for name in chosen + peers:
        picked.extend(sorted(by_pod[name], key=lambda t: t.local_rank))
    for name in missing:
        warnings.append(f"{name} is not a live replica of this revision: a failed target of this capture")
        picked.append(Target("", 0, 0, name, "", "", None, False,
                             f"{name} is not a live pod of this revision (gone, another revision, or misspelt)"))
    return Snapshot(_renumber(picked), None, snapshot.source, snapshot.taken_at, tuple(warnings))
