"""What the coordinator knows about one capture while it runs: per-target progress and phase.

Agent statuses are level-triggered facts; a terminal state (archived, failed) is final, so a late
or repeated answer can never undo it. Every change is published on the capture's event bus.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from gpulens.capture.models import Artifact, CaptureRequest, FailureReason, TargetState, TargetStatus

from .events import EventBus
from .targets import Snapshot, Target

__all__ = ["Phase", "TargetProgress", "CaptureRecord"]


class Phase:
    PREPARING = "preparing"
    CAPTURING = "capturing"
    CONVERGED = "converged"
    FAILED = "failed"        # could not run (no targets, discovery or manifest write failed)
    UNKNOWN = "unknown"      # only ever in answers about ids this process did not start

    DONE = frozenset({CONVERGED, FAILED})


@dataclass
class TargetProgress:
    """One target as the coordinator follows it: the agent's latest `TargetStatus` for it (the type the
    agent serves, so the two cannot drift apart) plus what only the coordinator knows: where the target
    is and how its dispatch went."""

    target: Target
    status: TargetStatus = field(init=False)
    accepted: bool = False           # the agent answered the dispatch (2xx)
    dispatch_attempts: int = 0
    dispatched_at: float | None = None     # first acceptance
    accepted_at: float = 0.0               # latest acceptance

    def __post_init__(self) -> None:
        self.status = TargetStatus(self.target.target_id)

    @property
    def state(self) -> TargetState:
        return self.status.state

    @property
    def reason(self) -> FailureReason | None:
        return self.status.reason

    @property
    def detail(self) -> str | None:
        return self.status.detail

    @property
    def updated_at(self) -> float:
        return self.status.updated_at

    @property
    def artifact(self) -> Artifact | None:
        return self.status.artifact

    @property
    def terminal(self) -> bool:
        return self.status.terminal

    def to_dict(self) -> dict[str, Any]:
        t = self.target
        out: dict[str, Any] = {"target_id": t.target_id, "rank": t.rank, "local_rank": t.local_rank, "pod": t.pod,
                               "node": t.node, "agent": t.agent_url, "state": self.state.value,
                               "reason": self.reason.value if self.reason else None, "detail": self.detail,
                               "updated_at": self.updated_at, "dispatch_attempts": self.dispatch_attempts}
        if self.artifact:
            out["artifact"] = self.artifact.to_dict()
        return out


@dataclass
class CaptureRecord:
    capture_id: str
    request: CaptureRequest
    namespace: str
    job_id: str
    attempt: int
    requested_at: float = field(default_factory=time.time)
    phase: str = Phase.PREPARING
    error: str | None = None
    cancelled: bool = False
    deadline: float | None = None
    agent_deadline: float | None = None
    quiet_until: float = 0.0
    converged_at: float | None = None
    manifest_written_at: float | None = None
    archive_prefix: str | None = None
    manifest_uri: str | None = None
    report_uri: str | None = None
    followed_by: str | None = None        # issue 45: a hang capture's Kineto window (a trace capture of its own)
    analysis: dict[str, Any] = field(default_factory=lambda: {"state": "pending"})
    annotation: dict[str, Any] = field(default_factory=lambda: {"state": "disabled"})
    alert_resolved_at: str | None = None
    start_iteration: int | None = None    # iteration captures: one absolute start for every rank (None: round-up)
    start_time_ms: int | None = None      # wall-clock captures: one instant every rank starts at (issue 47)
    snapshot: Snapshot | None = None
    targets: dict[str, TargetProgress] = field(default_factory=dict)
    budget: Any = None                 # issue 27: the coordinator's BudgetPlan (budget.py)
    bus: EventBus = field(init=False)

    def __post_init__(self) -> None:
        self.bus = EventBus(lambda: self.to_status(full=True))

    # --- changes ----------------------------------------------------------------------------

    def freeze(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot
        self.targets = {t.target_id: TargetProgress(t) for t in snapshot.targets}
        for p in self.targets.values():
            if not p.target.registered:
                self.update(p.target.target_id, TargetState.FAILED, FailureReason.NOT_REGISTERED, p.target.note)

    def set_phase(self, phase: str, error: str | None = None) -> None:
        if phase == self.phase and error == self.error:
            return
        self.phase, self.error = phase, error
        if phase in Phase.DONE and self.converged_at is None:
            self.converged_at = time.time()
        self.bus.publish({"event": "phase", "capture_id": self.capture_id, "phase": phase, "error": error,
                          "at": time.time()})

    def update(self, target_id: str, state: TargetState, reason: FailureReason | None = None,
               detail: str | None = None, artifact: Artifact | None = None) -> bool:
        """Apply one observed state; returns whether anything changed. Terminal states stick."""
        p = self.targets.get(target_id)
        if p is None or p.terminal:
            return False
        if (p.state, p.reason, p.detail) == (state, reason, detail) and artifact == p.artifact:
            return False
        s = p.status
        s.state, s.reason, s.detail, s.updated_at = state, reason, detail, time.time()
        if artifact is not None:
            s.artifact = artifact
        self.bus.publish({"event": "target", "capture_id": self.capture_id, "target_id": target_id,
                          "rank": p.target.rank, "state": state.value, "reason": reason.value if reason else None,
                          "detail": detail, "at": p.updated_at})
        return True

    def note(self, event: str, **fields: Any) -> None:
        self.bus.publish({"event": event, "capture_id": self.capture_id, "at": time.time(), **fields})

    # --- views ------------------------------------------------------------------------------

    @property
    def all_terminal(self) -> bool:
        return all(p.terminal for p in self.targets.values())

    @property
    def fully_succeeded(self) -> bool | None:
        if self.phase not in Phase.DONE:
            return None
        return self.phase == Phase.CONVERGED and bool(self.targets) and \
            all(p.state == TargetState.ARCHIVED for p in self.targets.values())

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in self.targets.values():
            key = p.state.value if p.state != TargetState.FAILED else f"failed:{p.reason.value if p.reason else '?'}"
            out[key] = out.get(key, 0) + 1
        return dict(sorted(out.items()))

    def missing_ranks(self) -> list[int]:
        return sorted(p.target.rank for p in self.targets.values() if p.state != TargetState.ARCHIVED)

    def to_status(self, full: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "capture_id": self.capture_id, "namespace": self.namespace, "job_id": self.job_id,
            "attempt": self.attempt, "phase": self.phase, "error": self.error, "cancelled": self.cancelled,
            "fully_succeeded": self.fully_succeeded, "requested_at": self.requested_at,
            "duration_ms": self.request.duration_ms, "deadline": self.deadline, "converged_at": self.converged_at,
            "manifest_written_at": self.manifest_written_at,
            "archive_prefix": self.archive_prefix, "manifest_uri": self.manifest_uri, "report_uri": self.report_uri,
            "analysis": dict(self.analysis), "annotation": dict(self.annotation),
            "reason": self.request.reason.to_dict(), "requested_by": self.request.requested_by,
            "alert_resolved_at": self.alert_resolved_at,
            "expected": len(self.targets), "counts": self.counts(),
        }
        if self.request.is_hang:
            out["kind"] = "hang"
            out["followed_by"] = self.followed_by
        if self.request.iterations:
            out["start_iteration"] = self.start_iteration
        elif self.start_time_ms is not None:
            out["start_time_ms"] = self.start_time_ms
        if self.phase in Phase.DONE:
            out["missing_ranks"] = self.missing_ranks()
        if full:
            out["request"] = self.request.to_dict()
            out["targets"] = [p.to_dict() for p in sorted(self.targets.values(), key=lambda p: p.target.rank)]
            if self.snapshot is not None:
                out["world_size"] = self.snapshot.world_size
                out["warnings"] = list(self.snapshot.warnings)
        return out
