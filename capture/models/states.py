"""Target states and failure reasons.

A target is one worker process. `dispatched` means the agent accepted the request;
`queued_by_dynolog` means dynolog put the config in the process's pending slot. Neither means
Kineto took it: only `trace_observed` (Kineto's final rename happened) says a trace exists.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from .. import schemas
from .manifest import Artifact


class TargetState(str, Enum):
    PENDING = "pending"
    DISPATCHED = "dispatched"
    NOT_MATCHED = "not_matched"            # dynolog knows no such process (yet): retried until the deadline
    WAITING_FOR_SLOT = "waiting_for_slot"  # matched, but an earlier config is still pending: retried
    QUEUED_BY_DYNOLOG = "queued_by_dynolog"
    TRACE_OBSERVED = "trace_observed"
    VERIFIED = "verified"
    ARCHIVED = "archived"
    FAILED = "failed"


TERMINAL_STATES = frozenset({TargetState.ARCHIVED, TargetState.FAILED})


class FailureReason(str, Enum):
    NOT_REGISTERED = "not_registered"        # the pod's worker never wrote a registration record
    PROCESS_GONE = "process_gone"            # the registered process exited
    NOT_MATCHED = "not_matched"              # dynolog never matched the pid before the deadline
    BUSY_TIMEOUT = "busy_timeout"            # the process's config slot stayed busy until the deadline
    AGENT_UNREACHABLE = "agent_unreachable"  # the node agent did not answer dispatch or polls
    DYNOLOG_UNREACHABLE = "dynolog_unreachable"
    DYNOLOG_ERROR = "dynolog_error"          # dynolog answered {"status": ...} only
    TRACE_TIMEOUT = "trace_timeout"          # queued, but no final trace file before the deadline (dynolog still answers)
    DYNOLOG_LOST = "dynolog_lost"            # queued, no trace by the deadline, and dynolog no longer answers
    KINETO_REFUSED = "kineto_refused"        # Kineto fetched the config and dropped it (builtin endpoint sees it)
    MISSED_START = "missed_start"            # the rank was past the capture's start iteration before Kineto could take it
    VERIFICATION_FAILED = "verification_failed"
    TRACE_EMPTY = "trace_empty"              # the rank's trace of the window holds no activity: it was blocked (issue 45)
    ARCHIVE_FAILED = "archive_failed"
    NO_DISK_SPACE = "no_disk_space"          # the node's free space would not hold the trace budget (issue 27)
    NO_HANG_EVIDENCE = "no_hang_evidence"    # a hang capture had neither the rank's dump nor its stacks (issue 45)
    CANCELLED = "cancelled"
    INTERNAL_ERROR = "internal_error"


MAX_TRIGGER_ATTEMPTS = 32  # distinct answers kept per target (repeats are counted, not listed)


@dataclass
class TriggerAttempt:
    """One trigger answer, in dynolog's own words (the strongest fact the agent has before a file
    appears), or the error when the backend did not answer. Identical consecutive answers are one
    entry with a `count`, so a target retried every second for minutes keeps a short history."""

    at: float                                    # the first attempt that got this answer
    backend: str                                 # dynolog | builtin
    processes_matched: list[int] | None = None   # processesMatched (None: no answer)
    triggered: list[int] | None = None           # activityProfilersTriggered
    busy: int | None = None                      # activityProfilersBusy
    error: str | None = None                     # a FailureReason value when the backend failed
    count: int = 1
    last_at: float | None = None                 # the latest attempt with this answer (count > 1)

    def same_answer(self, other: "TriggerAttempt") -> bool:
        return (self.backend, self.processes_matched, self.triggered, self.busy, self.error) == \
            (other.backend, other.processes_matched, other.triggered, other.busy, other.error)

    def describe(self) -> str:
        """dynolog's raw fields as a person reads them in a detail."""
        when = _hms(self.last_at or self.at)
        if self.error is not None:
            return f"{self.error} at {when}"
        return (f"processesMatched={self.processes_matched} activityProfilersTriggered={self.triggered} "
                f"activityProfilersBusy={self.busy} at {when}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TriggerAttempt":
        return cls(at=d["at"], backend=d["backend"], processes_matched=d.get("processesMatched"),
                   triggered=d.get("activityProfilersTriggered"), busy=d.get("activityProfilersBusy"),
                   error=d.get("error"), count=d.get("count", 1), last_at=d.get("last_at"))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"at": self.at, "backend": self.backend, "count": self.count}
        if self.last_at is not None:
            out["last_at"] = self.last_at
        if self.error is not None:
            out["error"] = self.error
        else:
            out.update({"processesMatched": self.processes_matched, "activityProfilersTriggered": self.triggered,
                        "activityProfilersBusy": self.busy})
        return out


def _hms(t: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(t)) + "Z"


@dataclass
class TargetStatus:
    target_id: str
    state: TargetState = TargetState.PENDING
    reason: FailureReason | None = None
    detail: str | None = None
    updated_at: float = field(default_factory=time.time)
    artifact: Artifact | None = None
    trigger_attempts: list[TriggerAttempt] = field(default_factory=list)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    def record_attempt(self, attempt: TriggerAttempt) -> bool:
        """Add one trigger answer; True when it is a new entry (a repeat only counts up)."""
        last = self.trigger_attempts[-1] if self.trigger_attempts else None
        if last is not None and last.same_answer(attempt):
            last.count += 1
            last.last_at = attempt.at
            return False
        self.trigger_attempts.append(attempt)
        del self.trigger_attempts[:-MAX_TRIGGER_ATTEMPTS]
        return True

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TargetStatus":
        schemas.validate("target_status", data)
        return cls(
            target_id=data["target_id"],
            state=TargetState(data["state"]),
            reason=FailureReason(data["reason"]) if data.get("reason") else None,
            detail=data.get("detail"),
            updated_at=data.get("updated_at", time.time()),
            artifact=Artifact.from_dict(data["artifact"]) if data.get("artifact") else None,
            trigger_attempts=[TriggerAttempt.from_dict(a) for a in data.get("trigger_attempts") or []],
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "target_id": self.target_id,
            "state": self.state.value,
            "reason": self.reason.value if self.reason else None,
            "detail": self.detail,
            "updated_at": self.updated_at,
            "artifact": self.artifact.to_dict() if self.artifact else None,
            "trigger_attempts": [a.to_dict() for a in self.trigger_attempts],
        }
