"""What a trigger request achieved, per process, said no more strongly than it was observed.

dynolog's `setKinetOnDemandRequest` answer (and the builtin endpoint's, which copies its shape)
only says whether a config was *put in a process's pending slot*. Whether Kineto then took it is
known only when its trace file appears. Reference: dynolog-kineto-protocol.md sections 1.5, 1.6.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

__all__ = ["OnDemandResult", "PidOutcome", "TriggerFailed", "DynologRefused"]


class TriggerFailed(Exception):
    """The trigger itself failed. `.reason` is a FailureReason value (dynolog_unreachable, dynolog_error)."""

    #: the agent's `gpulens_agent_dynolog_rpc_errors_total` reason (the target's reason unless more precise)
    metric_reason: str

    def __init__(self, reason: str, detail: str, *, retryable: bool = False):
        super().__init__(detail)
        self.reason, self.detail, self.retryable = reason, detail, retryable
        self.metric_reason = reason


class DynologRefused(TriggerFailed):
    """dynolog answered with a failure document, `{"status": "failed..."}` (protocol 1.4, 1.5): it is
    up and said no. The target fails `dynolog_error`; the RPC error counter says `dynolog_refused`, so
    an operator tells a dynolog that refuses requests from one that answers garbage."""

    def __init__(self, detail: str):
        super().__init__("dynolog_error", detail)
        self.metric_reason = "dynolog_refused"


class PidOutcome(str, Enum):
    NOT_MATCHED = "not_matched"            # no registered process of that job has this pid (yet)
    WAITING_FOR_SLOT = "waiting_for_slot"  # matched, but an earlier config was not fetched yet (busy)
    QUEUED = "queued_by_dynolog"           # config placed in the process's pending slot
    LIMITED = "limited"                    # matched, neither triggered nor busy: process_limit reached


@dataclass(frozen=True)
class OnDemandResult:
    """The success body of setKinetOnDemandRequest (pids are leaf pids in the trainer's namespace)."""

    processes_matched: tuple[int, ...] = ()
    activity_triggered: tuple[int, ...] = ()
    activity_busy: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_body(cls, body: Any) -> "OnDemandResult":
        """Parse dynolog's answer; a `{"status": ...}`-only body is a failure carrying its text."""
        if not isinstance(body, dict):
            raise TriggerFailed("dynolog_error", f"dynolog answered a non-object: {body!r:.200}")
        if "processesMatched" not in body:
            status = body.get("status", body)
            raise TriggerFailed("dynolog_error", f"dynolog refused the request: {status}")
        try:
            matched = tuple(int(p) for p in body["processesMatched"])
            triggered = tuple(int(p) for p in body.get("activityProfilersTriggered", []))
            busy = int(body.get("activityProfilersBusy", 0))
        except (TypeError, ValueError) as exc:
            raise TriggerFailed("dynolog_error", f"malformed dynolog answer {body!r:.200}: {exc}") from exc
        return cls(matched, triggered, busy)

    def outcome_for(self, pid: int) -> PidOutcome:
        if pid in self.activity_triggered:
            return PidOutcome.QUEUED
        if pid not in self.processes_matched:
            return PidOutcome.NOT_MATCHED
        # Matched but not triggered: dynolog counts busy processes without naming them. The agent
        # asks for one pid per request, so a busy count > 0 is that process's full slot.
        return PidOutcome.WAITING_FOR_SLOT if self.activity_busy > 0 else PidOutcome.LIMITED

    def to_dict(self) -> dict[str, Any]:
        """The wire shape (keys sorted as nlohmann writes them)."""
        return {"activityProfilersBusy": self.activity_busy, "activityProfilersTriggered": list(self.activity_triggered),
                "eventProfilersBusy": 0, "eventProfilersTriggered": [], "processesMatched": list(self.processes_matched)}
