"""Decide which archived ranks go into one HTA run, and account for every rank that does not.

HTA aligns ranks by subtracting the smallest raw timestamp across all of them, so ranks must be
on one clock: files from another job (or another clock base) silently produce nonsense or an
int64 overflow deep inside HTA. Ranks are grouped by clock (Kineto's `baseTimeNanoseconds`, or
absolute epoch-µs timestamps) and by start time within the capture window; the largest group is
analysed (ties: the group holding the lowest rank) and every other rank is reported as excluded
with the reason. Within that group, files that state a different `distributedInfo.world_size`
than the majority are from another job and excluded too. Expected ranks with no
archived artifact are reported as missing with the manifest's failure reason.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, replace

from gpulens.capture.models import Artifact, Manifest

from .exclusions import Exclusion
from .trace_inspection import Inspected, TraceFacts

__all__ = ["RankEntry", "RankPlan", "plan_ranks", "START_SLACK_S", "WINDOW_SKEW_S", "WINDOW_START_SLACK_S"]

#: ranks of one capture start tracing within the window; allow this much more for slow pickup
START_SLACK_S = 300.0
#: clocks of trainer and coordinator may differ this much (the agent's verification allows the same)
WINDOW_SKEW_S = 5.0
#: a trace starts at most this long after the request: dynolog's start delay (poll <= 5 s + Kineto
#: warm-up ~7 s; the coordinator allows 12 s or 1.25x the longest observed) with a wide margin
WINDOW_START_SLACK_S = 120.0


@dataclass(frozen=True)
class RankEntry:
    rank: int | None
    target_id: str
    status: str                      # "analysed" | "excluded" | "missing"
    reason: str | None = None        # Exclusion value, or the manifest's failure reason for missing ranks
    detail: str = ""
    artifact: Artifact | None = None
    facts: TraceFacts | None = None
    hta_path: str | None = None
    placement: tuple[str, str] | None = None  # (node, pod) of an expected rank without an artifact


@dataclass(frozen=True)
class RankPlan:
    entries: list[RankEntry]

    @property
    def analysed(self) -> dict[int, str]:
        return {e.rank: e.hta_path for e in self.entries if e.status == "analysed"}

    def with_status(self, status: str) -> list[RankEntry]:
        return [e for e in self.entries if e.status == status]

    def excluding(self, failed: dict[int, str], reason: Exclusion) -> "RankPlan":
        """The same plan with the analysed ranks in `failed` moved to excluded, with their detail."""
        return RankPlan([replace(e, status="excluded", reason=reason.value, detail=failed[e.rank], hta_path=None)
                         if e.status == "analysed" and e.rank in failed else e for e in self.entries])


def plan_ranks(manifest: Manifest, inspected: list[Inspected]) -> RankPlan:
    """`inspected` is in the manifest's artifact order (one per artifact)."""
    entries: list[RankEntry] = []
    candidates: list[RankEntry] = []
    holder: dict[int, str] = {}
    for artifact, result in zip(manifest.artifacts, inspected):
        base = dict(rank=artifact.rank, target_id=artifact.target_id, artifact=artifact, facts=result.facts)
        if result.exclusion is not None:
            entries.append(RankEntry(status="excluded", reason=result.exclusion.value, detail=result.detail, **base))
            continue
        facts = result.facts
        # A serving capture numbers replicas apart: each worker's trace states its own replica's rank.
        if facts.distributed_rank is not None and facts.distributed_rank != artifact.own_rank:
            entries.append(RankEntry(status="excluded", reason=Exclusion.RANK_MISMATCH.value,
                                     detail=f"the trace says distributedInfo.rank={facts.distributed_rank}; "
                                            f"the manifest binds it to rank {artifact.own_rank}"
                                            + (f" (capture rank {artifact.rank})" if artifact.worker_rank is not None
                                               else ""), **base))
            continue
        if artifact.rank in holder:
            entries.append(RankEntry(status="excluded", reason=Exclusion.DUPLICATE_RANK.value,
                                     detail=f"rank {artifact.rank} is already analysed from {holder[artifact.rank]}",
                                     **base))
            continue
        holder[artifact.rank] = artifact.target_id
        candidates.append(RankEntry(status="analysed", hta_path=result.hta_path, **base))

    kept, dropped = _one_clock(candidates, manifest.duration_ms / 1000.0 + START_SLACK_S)
    kept, other_job = _one_world_size(kept)
    kept, outside = _in_window(kept, manifest)
    other_job.extend(outside)
    entries.extend(kept)
    entries.extend(dropped)
    entries.extend(other_job)
    entries.extend(_missing(manifest))
    entries.sort(key=lambda e: (e.rank if e.rank is not None else 1 << 62, e.status != "analysed", e.target_id))
    return RankPlan(entries)


def _one_clock(candidates: list[RankEntry], tolerance_s: float) -> tuple[list[RankEntry], list[RankEntry]]:
    groups: list[list[RankEntry]] = []
    by_clock: dict[str, list[RankEntry]] = {}
    for c in candidates:
        by_clock.setdefault(c.facts.clock, []).append(c)
    for members in by_clock.values():
        timed = sorted((m for m in members if m.facts.start_epoch_s is not None), key=lambda m: m.facts.start_epoch_s)
        untimed = [m for m in members if m.facts.start_epoch_s is None]
        cluster: list[RankEntry] = []
        for m in timed:
            if cluster and m.facts.start_epoch_s - cluster[0].facts.start_epoch_s > tolerance_s:
                groups.append(cluster)
                cluster = []
            cluster.append(m)
        if cluster:
            groups.append(cluster)
        if untimed:
            groups.append(untimed)
    if not groups:
        return [], []
    best = max(groups, key=lambda g: (len(g), -min(m.rank for m in g)))
    ref = best[0].facts
    dropped = []
    for g in groups:
        if g is best:
            continue
        for m in g:
            dropped.append(RankEntry(
                rank=m.rank, target_id=m.target_id, status="excluded", reason=Exclusion.CLOCK_MISMATCH.value,
                detail=(f"clock {m.facts.clock} starting at {_fmt(m.facts.start_epoch_s)} does not match the "
                        f"{len(best)} analysed rank(s) on clock {ref.clock} starting at {_fmt(ref.start_epoch_s)}: "
                        "not the same job and window"),
                artifact=m.artifact, facts=m.facts))
    return best, dropped


def _in_window(group: list[RankEntry], manifest: Manifest) -> tuple[list[RankEntry], list[RankEntry]]:
    """Each trace must start in [requested_at - skew, requested_at + start slack] and end before the
    manifest was written (+ skew): a trace from another time is not this capture's, whatever its clock."""
    lo = manifest.requested_at - WINDOW_SKEW_S
    hi = manifest.requested_at + WINDOW_START_SLACK_S
    end_hi = manifest.created_at + WINDOW_SKEW_S
    kept, out = [], []
    for m in group:
        start, end = m.facts.start_epoch_s, m.facts.end_epoch_s
        if start is None or (lo <= start <= hi and end <= end_hi):
            kept.append(m)  # a trace on an unknowable clock cannot be checked; its clock group decided
            continue
        out.append(replace(m, status="excluded", reason=Exclusion.OUTSIDE_WINDOW.value, hta_path=None, detail=(
            f"the trace spans {_fmt(start)} .. {_fmt(end)}; the capture was requested at "
            f"{_fmt(manifest.requested_at)} (a trace starts within -{WINDOW_SKEW_S:g} s .. +{WINDOW_START_SLACK_S:g} s "
            f"of that) and its manifest written at {_fmt(manifest.created_at)}")))
    return kept, out


def _one_world_size(group: list[RankEntry]) -> tuple[list[RankEntry], list[RankEntry]]:
    """Ranks of one job agree on distributedInfo.world_size where their files state it."""
    holders: dict[int, list[int]] = {}
    for m in group:
        if m.facts.world_size is not None:
            holders.setdefault(m.facts.world_size, []).append(m.rank)
    if len(holders) <= 1:
        return group, []
    size = max(holders, key=lambda s: (len(holders[s]), -min(holders[s])))
    keep = [m for m in group if m.facts.world_size in (None, size)]
    drop = [RankEntry(rank=m.rank, target_id=m.target_id, status="excluded",
                      reason=Exclusion.WORLD_SIZE_MISMATCH.value,
                      detail=(f"the trace says distributedInfo.world_size={m.facts.world_size}; the "
                              f"{len(holders[size])} analysed rank(s) that state it say {size}: not the same job"),
                      artifact=m.artifact, facts=m.facts)
            for m in group if m.facts.world_size not in (None, size)]
    return keep, drop


def _fmt(epoch_s: float | None) -> str:
    if epoch_s is None:
        return "an unknown time"
    return dt.datetime.fromtimestamp(epoch_s, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _missing(manifest: Manifest) -> list[RankEntry]:
    archived = {a.target_id for a in manifest.artifacts}
    failures = {f.target_id: f for f in manifest.failures}
    out = []
    seen = set()
    for t in manifest.expected_targets:
        if t.target_id in archived or t.target_id in seen:
            continue
        seen.add(t.target_id)
        f = failures.get(t.target_id)
        out.append(RankEntry(rank=t.rank, target_id=t.target_id, status="missing",
                             reason=f.reason if f else "not_archived",
                             detail=f.detail if f else "expected, but the manifest has no artifact for it",
                             placement=(t.node, t.pod)))
    for f in manifest.failures:  # failures for targets the expectation list does not name
        if f.target_id not in archived and f.target_id not in seen:
            seen.add(f.target_id)
            out.append(RankEntry(rank=f.rank, target_id=f.target_id, status="missing", reason=f.reason,
                                 detail=f.detail))
    return out
