"""A capture request: what to trace, for how long, and why."""

from __future__ import annotations

import secrets
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from .. import schemas
from ..activities import DEFAULT_CPU_ACTIVITIES


def new_capture_id(now: float | None = None) -> str:
    """A sortable, unique capture instance id: `c-<utc yyyymmddThhmmss>-<8 hex>`."""
    stamp = time.strftime("%Y%m%dt%H%M%S", time.gmtime(now if now is not None else time.time()))
    return f"c-{stamp}-{secrets.token_hex(4)}"


@dataclass(frozen=True)
class CaptureOptions:
    record_shapes: bool = False
    with_stack: bool = False
    profile_memory: bool = False
    with_flops: bool = False
    with_modules: bool = False


@dataclass(frozen=True)
class CaptureReason:
    kind: Literal["alert", "manual"] = "manual"
    alertname: str | None = None
    fingerprint: str | None = None
    starts_at: str | None = None
    diagnosis: str | None = None
    workload: str | None = None   # "<namespace>/<pod>" the alert named: the report leads with it
    text: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class CaptureRequest:
    job_id: str
    duration_ms: int = 2000
    attempt: int | None = None
    activities: tuple[str, ...] = DEFAULT_CPU_ACTIVITIES
    options: CaptureOptions = field(default_factory=CaptureOptions)
    reason: CaptureReason = field(default_factory=CaptureReason)
    requested_by: str = "unknown"
    capture_id: str | None = None
    # Trace this many training iterations (optimizer steps) instead of a wall-clock window;
    # duration_ms then bounds how long they may take (and is Kineto's window if the job never steps).
    iterations: int | None = None
    iteration_roundup: int | None = None   # None: the coordinator's DEFAULT_ROUNDUP
    baseline: bool = False   # a healthy reference capture of the job: later reports compare with it
    budget_mb: int | None = None   # issue 27: uncompressed trace MiB per rank (None: the coordinator's default)
    # Serving workloads (issue 30): which replicas of the revision; all empty: every replica.
    pods: tuple[str, ...] = ()     # these pods (an alert's pod) ...
    peers: int | None = None       # ... plus this many other replicas, for comparison
    replicas: int | None = None    # or, naming none: this many replicas
    # issue 45: "hang" takes every rank's Flight Recorder dump and stacks instead of a Kineto window
    kind: Literal["trace", "hang"] = "trace"

    @property
    def is_hang(self) -> bool:
        return self.kind == "hang"

    @property
    def selects_pods(self) -> bool:
        return bool(self.pods) or self.peers is not None or self.replicas is not None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CaptureRequest":
        schemas.validate("capture_request", data)
        return cls(
            job_id=data["job_id"],
            duration_ms=data["duration_ms"],
            attempt=data.get("attempt"),
            activities=tuple(data.get("activities") or DEFAULT_CPU_ACTIVITIES),
            options=CaptureOptions(**data.get("options", {})),
            reason=CaptureReason(**data.get("reason", {"kind": "manual"})),
            requested_by=data.get("requested_by", "unknown"),
            capture_id=data.get("capture_id"),
            iterations=data.get("iterations"),
            iteration_roundup=data.get("iteration_roundup"),
            baseline=data.get("baseline", False),
            budget_mb=data.get("budget_mb"),
            pods=tuple(data.get("pods") or ()),
            peers=data.get("peers"),
            replicas=data.get("replicas"),
            kind=data.get("kind", "trace"),
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "job_id": self.job_id,
            "duration_ms": self.duration_ms,
            "activities": list(self.activities),
            "options": asdict(self.options),
            "reason": self.reason.to_dict(),
            "requested_by": self.requested_by,
        }
        if self.attempt is not None:
            out["attempt"] = self.attempt
        if self.capture_id is not None:
            out["capture_id"] = self.capture_id
        if self.iterations is not None:
            out["iterations"] = self.iterations
        if self.iteration_roundup is not None:
            out["iteration_roundup"] = self.iteration_roundup
        if self.baseline:
            out["baseline"] = True
        if self.budget_mb is not None:
            out["budget_mb"] = self.budget_mb
        if self.pods:
            out["pods"] = list(self.pods)
        if self.peers is not None:
            out["peers"] = self.peers
        if self.replicas is not None:
            out["replicas"] = self.replicas
        if self.kind != "trace":
            out["kind"] = self.kind
        return out
