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
    TRACE_TIMEOUT = "trace_timeout"          # queued, but no final trace file before the deadline
    VERIFICATION_FAILED = "verification_failed"
    ARCHIVE_FAILED = "archive_failed"
    CANCELLED = "cancelled"
    INTERNAL_ERROR = "internal_error"


@dataclass
class TargetStatus:
    target_id: str
    state: TargetState = TargetState.PENDING
    reason: FailureReason | None = None
    detail: str | None = None
    updated_at: float = field(default_factory=time.time)
    artifact: Artifact | None = None

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

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
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "target_id": self.target_id,
            "state": self.state.value,
            "reason": self.reason.value if self.reason else None,
            "detail": self.detail,
            "updated_at": self.updated_at,
            "artifact": self.artifact.to_dict() if self.artifact else None,
        }
