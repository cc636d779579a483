"""The node's side of the trace budget (issue 27): room on disk before triggering, where the
archive copy is staged, and the size facts of an archived trace.

Before a config goes to Kineto the agent asks each filesystem that will take bytes of this capture
how much is free: Kineto's folder takes the trace (up to the budget), the staging folder its gzip
copy (counted at the budget too, the worst case for JSON that gzip cannot shrink). Both must keep
`reserve_bytes` free afterwards; when one would not, the target fails `no_disk_space` with the
numbers, before anything was asked of the trainer. The archive copy itself stops at that reserve
too (staging.py), so nothing gpulens writes can fill the node.

The check is per node, not per rank (issue 43): eight ranks of one node dispatched at once each
passed alone against room for one. `NodeReservations` holds every in-flight target's claim (its
trace and its staging copy, at the budget) from its check until the target is over and its local
files gone; a new target is measured against the free space less what the others hold on the same
filesystem. A claim is kept whole while its trace is written (the free space then shows part of it
twice): conservative, by at most one budget per in-flight target.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..models import Dispatch
from ..models.budget import DEFAULT_BUDGET_MB, MIB
from .staging import Staging

__all__ = ["NodeDisk", "NodeReservations", "stage_path", "space_problem", "artifact_sizes", "stopped_early"]

DEFAULT_MIN_FREE = 1 << 30          # --min-free-mb 1024
DEFAULT_BUDGET = DEFAULT_BUDGET_MB * MIB    # a dispatch without a budget (an older coordinator)


@dataclass(frozen=True)
class NodeDisk:
    """The agent's disk policy: where gzip copies are staged (`compress_level` 0: none, the trace is
    archived as it is), the free space it always leaves, the budget assumed when a dispatch has none."""

    staging_dir: Path
    compress_level: int = 1
    min_free_bytes: int = DEFAULT_MIN_FREE
    default_budget_bytes: int = DEFAULT_BUDGET

    def needs(self, spec: Dispatch, trace_folder: Path) -> list[tuple[Path, int]]:
        """What this target may write where: its trace, and its gzip copy when staged (OSError when
        the staging folder cannot be made)."""
        budget = spec.budget.budget_bytes if spec.budget else self.default_budget_bytes
        needs = [(Path(trace_folder), budget)]
        if self.compress_level > 0:
            self.staging_dir.mkdir(parents=True, exist_ok=True)
            needs.append((self.staging_dir, budget))
        return needs

    def refusal(self, spec: Dispatch, trace_folder: Path, held: "NodeReservations | None" = None,
                key: tuple[str, str] | None = None) -> str | None:
        """Why this target must not be triggered (no room for its budget beside what the node's
        other in-flight targets hold), or None; with `held`, a target that fits is claimed there."""
        try:
            needs = self.needs(spec, trace_folder)
        except OSError as exc:
            return f"cannot prepare the staging folder {self.staging_dir}: {exc}"
        if held is None:
            return space_problem(needs, self.min_free_bytes)
        return held.claim(key or ("", ""), needs, self.min_free_bytes)

    def staging(self, capture_id: str, target_id: str) -> Staging | None:
        if self.compress_level <= 0:
            return None
        self.staging_dir.mkdir(parents=True, exist_ok=True)
        return Staging(str(stage_path(self.staging_dir, capture_id, target_id)), level=self.compress_level,
                       min_free_bytes=self.min_free_bytes)


class NodeReservations:
    """Every in-flight target's claim on the node's filesystems (one per agent, owned by its pipeline)."""

    def __init__(self) -> None:
        self._claims: dict[tuple[str, str], list[tuple[int, int]]] = {}

    def held(self, dev: int, but: tuple[str, str] | None = None) -> tuple[int, int]:
        """(bytes, targets) the claims other than `but` hold on filesystem `dev`."""
        total = count = 0
        for key, claims in self._claims.items():
            mine = sum(n for d, n in claims if d == dev)
            if key != but and mine:
                total, count = total + mine, count + 1
        return total, count

    def claim(self, key: tuple[str, str], needs: list[tuple[Path, int]], reserve_bytes: int) -> str | None:
        """Claim `needs` for `key` when they fit beside every other claim; else why not (nothing claimed)."""
        per_dev: dict[int, int] = {}
        problem = space_problem(needs, reserve_bytes, held=lambda dev: self.held(dev, but=key), per_dev=per_dev)
        if problem is None:
            self._claims[key] = list(per_dev.items())
        return problem

    def release(self, key: tuple[str, str]) -> None:
        self._claims.pop(key, None)

    def __len__(self) -> int:
        return len(self._claims)


def stage_path(staging_dir: Path, capture_id: str, target_id: str) -> Path:
    """One flat file per (capture, target): no folder to clean up (ids never contain a dot or '/')."""
    return Path(staging_dir) / f"{capture_id}.{target_id}.json.gz"


def space_problem(needs: list[tuple[Path, int]], reserve_bytes: int, held=None,
                  per_dev: dict[int, int] | None = None) -> str | None:
    """None when every folder's filesystem holds what it must take plus the reserve, beside what
    `held(dev)` says other targets hold there ((bytes, targets)); else why not. Folders on one
    filesystem add up (st_dev), so a shared disk is not counted twice as free; `per_dev`, when
    given, receives those sums (what a claim records, without reading the folders again)."""
    by_dev: dict[int, tuple[Path, int, int]] = {}
    for folder, need in needs:
        try:
            st = os.statvfs(folder)
            dev = os.stat(folder).st_dev
        except OSError as exc:
            return f"cannot read the free space of {folder}: {exc}"
        free = st.f_bavail * st.f_frsize
        first, total, _ = by_dev.get(dev, (folder, 0, free))
        by_dev[dev] = (first, total + need, free)
    if per_dev is not None:
        per_dev.update({dev: total for dev, (_, total, _) in by_dev.items()})
    for dev, (folder, need, free) in by_dev.items():
        others, count = held(dev) if held else (0, 0)
        if free - others < need + reserve_bytes:
            beside = (f", of which {count} other in-flight target{'s' if count != 1 else ''} of this node "
                      f"hold{'' if count != 1 else 's'} {_mib(others)}") if count else ""
            return (f"{folder} has {_mib(free)} free{beside}; this capture's budget needs {_mib(need)} there "
                    f"and the agent keeps {_mib(reserve_bytes)} free (--min-free-mb): refused before "
                    "triggering, nothing was asked of the trainer")
    return None


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def stopped_early(spec: Dispatch, verdict: dict[str, Any]) -> str | None:
    """Why the trace is shorter than asked, when the verdict shows it: an iteration trace that
    stepped but holds fewer optimizer steps than requested (Kineto ends a trace early when its GPU
    buffer, ACTIVITIES_MAX_GPU_BUFFER_SIZE_MB, is full: "terminating tracing")."""
    steps = int(verdict.get("optimizer_steps") or 0)
    if spec.iterations and 0 < steps < spec.iterations:
        cap = spec.budget.gpu_buffer_mb if spec.budget and spec.budget.gpu_buffer_mb else 128
        return (f"{steps} of {spec.iterations} iterations traced: Kineto stopped early (its GPU buffer of "
                f"{cap} MB full, or the process stopped stepping)")
    return None


def artifact_sizes(spec: Dispatch, verdict: dict[str, Any]) -> dict[str, Any]:
    """The manifest artifact's `sizes`: budget and estimate as sent, bytes as found."""
    b = spec.budget
    stored = int(verdict.get("stored_size") or verdict.get("size") or 0)
    return {"budget": b.budget_bytes if b else None, "estimate": b.estimate_bytes if b else None,
            "uncompressed": int(verdict.get("size") or 0), "stored": stored,
            "encoding": verdict.get("encoding") or "identity", "gpu_buffer_mb": b.gpu_buffer_mb if b else None,
            "stopped_early": stopped_early(spec, verdict)}
