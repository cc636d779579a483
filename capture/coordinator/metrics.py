"""The coordinator's own metrics (served on `/metrics`): how its captures and their targets end,
and how long captures take to converge.

One `CoordinatorMetrics` per coordinator, with its own registry (capture/wire/metrics_http.py). Labels are bounded enums, never a capture id; the job is the scrape target's (one
coordinator per job attempt). Every label pair starts at 0 so `rate()` sees the first failure.
Catalogue: docs/metrics.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import Counter, Histogram

from ..wire.metrics_http import OwnMetrics
from ..models import FailureReason, TargetState
from .progress import CaptureRecord, Phase

__all__ = ["CoordinatorMetrics", "CAPTURE_FAILURES"]

# why a capture could not run, from the error it ended with (service.py sets these three)
CAPTURE_FAILURES = (("discovery:", "discovery_failed"), ("the manifest could not be written", "manifest_write_failed"),
                    ("internal error", "internal_error"))
# request -> every target final: dispatch + start delay + window + archive, typically 25-90 s
_CONVERGE_BUCKETS = (5.0, 10.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 180.0, 300.0, 600.0)


@dataclass
class CoordinatorMetrics(OwnMetrics):
    def __post_init__(self) -> None:
        r = self.registry
        self.captures = Counter("gpulens_coordinator_captures", "Captures this coordinator finished, by outcome "
                                "(succeeded: every rank archived; partial: some ranks failed; failed: could not run) "
                                "and, for failed, the reason.", ["outcome", "reason"], registry=r)
        self.targets = Counter("gpulens_coordinator_targets", "Targets of finished captures, by outcome (archived or "
                               "failed) and failure reason.", ["outcome", "reason"], registry=r)
        self.convergence = Histogram("gpulens_coordinator_convergence_seconds", "From a capture's request to every "
                                     "target archived or failed (converged captures only).",
                                     buckets=_CONVERGE_BUCKETS, registry=r)
        for outcome in ("succeeded", "partial"):
            self.captures.labels(outcome, "")
        for _, reason in CAPTURE_FAILURES + (("", "other"),):
            self.captures.labels("failed", reason)
        self.targets.labels("archived", "")
        for fr in FailureReason:
            self.targets.labels("failed", fr.value)

    def capture_ended(self, record: CaptureRecord) -> None:
        """Once per finished capture (the service calls it when the phase is done)."""
        if record.phase == Phase.FAILED:
            error = record.error or ""
            reason = next((r for prefix, r in CAPTURE_FAILURES if error.startswith(prefix)), "other")
            self.captures.labels("failed", reason).inc()
        elif record.phase == Phase.CONVERGED:
            self.captures.labels("succeeded" if record.fully_succeeded else "partial", "").inc()
            if record.converged_at is not None:
                self.convergence.observe(max(0.0, record.converged_at - record.requested_at))
        else:
            return
        for p in record.targets.values():
            if p.state is TargetState.ARCHIVED:
                self.targets.labels("archived", "").inc()
            elif p.state is TargetState.FAILED and p.reason is not None:
                self.targets.labels("failed", p.reason.value).inc()
