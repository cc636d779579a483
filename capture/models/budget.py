"""A capture's trace budget as it travels: coordinator -> agent (dispatch) -> manifest (issue 27).

The coordinator prices a request (capture/coordinator/budget.py) and sends each rank's agent what
it decided: the budget in bytes of uncompressed trace JSON per rank, its own estimate of what the
trace will weigh, and the GPU buffer cap it put into Kineto's config. The agent checks its disk
against `budget_bytes` before triggering and records all of it, with the real sizes, in the
artifact's `sizes`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["TraceBudget", "MIB", "DEFAULT_BUDGET_MB"]

MIB = 1 << 20
#: per rank, uncompressed JSON (docs/coordinator.md, "Trace budget"): under chrome://tracing's ~256 MB
#: string ceiling with room for the estimate's error; Perfetto's UI holds it (2-4x in memory); HTA
#: needs ~1 GB of RAM per rank for it; gzip stores it in ~20 MB
DEFAULT_BUDGET_MB = 200


@dataclass(frozen=True)
class TraceBudget:
    budget_bytes: int               # uncompressed trace JSON one rank may write
    estimate_bytes: int             # what the coordinator expects this capture to write per rank
    gpu_buffer_mb: int | None = None  # ACTIVITIES_MAX_GPU_BUFFER_SIZE_MB sent to Kineto (None: Kineto's 128)
    basis: str = ""                 # how the estimate was made, for people

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TraceBudget":
        return cls(**{k: data[k] for k in ("budget_bytes", "estimate_bytes", "gpu_buffer_mb", "basis") if k in data})

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}
