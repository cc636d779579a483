"""The capture manifest: the receipt analysis trusts, and nothing else."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from .. import schemas
from ..wire import limits

SCHEMA_VERSION = 1


def target_id_for_rank(rank: int) -> str:
    """Target ids are per worker process; within one (job, attempt) the global rank names it."""
    return f"rank-{rank}"


@dataclass(frozen=True)
class ExpectedTarget:
    target_id: str
    rank: int
    local_rank: int
    pod: str
    node: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Artifact:
    target_id: str
    rank: int
    local_rank: int
    node: str
    pod: str
    pid: int
    attempt: int
    uri: str
    size: int
    sha256: str
    trace_id: str | None
    event_count: int | None = None
    # iteration-based captures: requested/roundup, the trace's first and last ProfilerStep#N, the
    # optimizer steps Kineto counted, and whether it stepped at all (else Kineto's time fallback)
    iterations: dict[str, Any] | None = None
    # issue 27: {budget, estimate, uncompressed, stored, encoding, gpu_buffer_mb, stopped_early}; `size`
    # and `sha256` are of the stored bytes (gzip for .json.gz), what analysis fetches and checks
    sizes: dict[str, Any] | None = None
    # issue 30: a serving capture numbers replicas apart in `rank`; this is the worker's own rank
    # (what its trace's distributedInfo.rank says). None: `rank` is the worker's own.
    worker_rank: int | None = None
    # issue 47, wall-clock captures: when this rank's collection ran (unix s: start, end), the instant
    # the capture chose for every rank (chosen_start) and how far this rank's start fell from it
    window: dict[str, Any] | None = None
    # issue 45: "hang_evidence" for a hang capture's per-rank document (schema hang_evidence); None: a trace
    kind: str | None = None

    @property
    def is_trace(self) -> bool:
        return self.kind is None

    @property
    def own_rank(self) -> int:
        """The rank the worker itself reports (its trace's distributedInfo.rank)."""
        return self.rank if self.worker_rank is None else self.worker_rank

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Artifact":
        schemas.validate("manifest", _wrap(artifacts=[data]))
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key in ("event_count", "iterations", "sizes", "worker_rank", "window", "kind"):
            if d[key] is None:
                del d[key]
        return d


@dataclass(frozen=True)
class Failure:
    target_id: str
    reason: str
    detail: str
    rank: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Manifest:
    capture_id: str
    job_id: str
    attempt: int
    requested_at: float
    duration_ms: int
    expected_targets: list[ExpectedTarget]
    artifacts: list[Artifact] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    deadline: float | None = None
    converged_at: float | None = None
    request: dict[str, Any] = field(default_factory=dict)
    archive_prefix: str | None = None
    created_at: float = field(default_factory=time.time)
    start_time_ms: int | None = None    # wall-clock captures: the instant every rank's window was to start

    @property
    def fully_succeeded(self) -> bool:
        archived = {a.target_id for a in self.artifacts}
        return bool(self.expected_targets) and all(t.target_id in archived for t in self.expected_targets)

    @property
    def missing_ranks(self) -> list[int]:
        archived = {a.target_id for a in self.artifacts}
        return sorted(t.rank for t in self.expected_targets if t.target_id not in archived)

    def to_dict(self) -> dict[str, Any]:
        window: dict[str, Any] = {"requested_at": self.requested_at, "duration_ms": self.duration_ms,
                                  "converged_at": self.converged_at}
        if self.deadline is not None:
            window["deadline"] = self.deadline
        if self.start_time_ms is not None:
            window["start_time_ms"] = self.start_time_ms
        out: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "capture_id": self.capture_id,
            "job_id": self.job_id,
            "attempt": self.attempt,
            "window": window,
            "request": self.request,
            "expected_targets": [t.to_dict() for t in self.expected_targets],
            "artifacts": [a.to_dict() for a in self.artifacts],
            "failures": [f.to_dict() for f in self.failures],
            "created_at": self.created_at,
            "fully_succeeded": self.fully_succeeded,
        }
        if self.archive_prefix is not None:
            out["archive_prefix"] = self.archive_prefix
        return schemas.validate("manifest", out)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Manifest":
        schemas.validate("manifest", data)
        w = data["window"]
        return cls(
            capture_id=data["capture_id"],
            job_id=data["job_id"],
            attempt=data["attempt"],
            requested_at=w["requested_at"],
            duration_ms=w["duration_ms"],
            deadline=w.get("deadline"),
            converged_at=w.get("converged_at"),
            start_time_ms=w.get("start_time_ms"),
            expected_targets=[ExpectedTarget(**t) for t in data["expected_targets"]],
            artifacts=[Artifact(**a) for a in data["artifacts"]],
            failures=[Failure(**f) for f in data["failures"]],
            request=data.get("request", {}),
            archive_prefix=data.get("archive_prefix"),
            created_at=data["created_at"],
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> "Manifest":
        return cls.from_dict(limits.loads(text, limits.MANIFEST_FILE))


def _wrap(**parts: Any) -> dict[str, Any]:
    """A minimal manifest around `parts`, to validate a fragment against its $def in context."""
    base: dict[str, Any] = {"schema_version": 1, "capture_id": "x", "job_id": "x", "attempt": 0,
                            "window": {"requested_at": 0, "duration_ms": 1}, "expected_targets": [],
                            "artifacts": [], "failures": [], "created_at": 0}
    base.update(parts)
    return base
