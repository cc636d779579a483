"""Coordinator -> agent: trace this one target (PUT /v1/captures/{capture_id}/targets/{target_id})."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .. import schemas
from .budget import TraceBudget
from .request import CaptureOptions


@dataclass(frozen=True)
class Dispatch:
    job_id: str
    attempt: int
    rank: int
    duration_ms: int
    activities: tuple[str, ...]
    deadline: float
    archive_prefix: str
    local_rank: int | None = None
    pod: str | None = None
    pod_uid: str | None = None
    requested_at: float | None = None
    options: CaptureOptions = field(default_factory=CaptureOptions)
    iterations: int | None = None          # iteration-based trace of this many optimizer steps ...
    iteration_roundup: int | None = None   # ... starting at a multiple of this, the same for every rank
    start_iteration: int | None = None     # ... or at exactly this Kineto iteration (round-up 1), chosen by the coordinator
    start_time_ms: int | None = None       # a wall-clock trace starts at this instant (ms since the epoch) on every rank
    budget: TraceBudget | None = None      # issue 27: bytes this rank's trace may take (the agent checks its disk)
    worker_rank: int | None = None         # issue 30: the worker's registered rank when `rank` is a serving capture's number
    kind: str = "trace"                    # issue 45: "hang": the rank's hang evidence instead of a trace

    @property
    def registered_rank(self) -> int:
        """The rank to find the worker's registration record by."""
        return self.rank if self.worker_rank is None else self.worker_rank

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Dispatch":
        schemas.validate("dispatch", data)
        d = dict(data)
        d["activities"] = tuple(d["activities"])
        d["options"] = CaptureOptions(**d.get("options", {}))
        if "budget" in d:
            d["budget"] = TraceBudget.from_dict(d["budget"])
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["activities"] = list(self.activities)
        if self.budget is not None:
            d["budget"] = self.budget.to_dict()
        if self.kind == "trace":
            del d["kind"]    # what agents before issue 45 read
        return {k: v for k, v in d.items() if v is not None}
