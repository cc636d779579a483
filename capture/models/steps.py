"""A worker's optimizer step count as its node agent reads it: part of `GET /v1/workers`.

The trainer hook publishes the count (hooks/site/_gpulens_steps.py); the agent reads it
(gpulens.capture.agent.steps) and the coordinator chooses one absolute start iteration for a capture's
ranks from these readings (gpulens.capture.coordinator.start_iteration).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from math import isfinite
from typing import Any

__all__ = ["StepReading"]


@dataclass(frozen=True)
class StepReading:
    count: int                 # optimizer steps so far, as Kineto's step tracker counts them
    at: float                  # unix seconds of the latest one
    per_s: float | None        # recent steps per second (None: too few steps to tell)

    @property
    def kineto_iteration(self) -> int:
        """Kineto's own iteration counter: it starts at -1 and each step increments it first."""
        return self.count - 1

    @classmethod
    def from_dict(cls, data: Any) -> "StepReading":
        """ValueError for anything that is not a reading (an agent's answer is input like any other)."""
        if not isinstance(data, dict):
            raise ValueError("steps: not an object")
        count, at, per_s = data.get("count"), data.get("at"), data.get("per_s")
        if type(count) is not int or count < -1:
            raise ValueError(f"steps.count: {count!r} is not an integer >= -1")
        if type(at) not in (int, float) or not isfinite(at) or at < 0:
            raise ValueError(f"steps.at: {at!r} is not a time")
        if per_s is not None and (type(per_s) not in (int, float) or not isfinite(per_s) or per_s < 0):
            raise ValueError(f"steps.per_s: {per_s!r} is not a rate")
        return cls(count, float(at), None if per_s is None else float(per_s))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["kineto_iteration"] = self.kineto_iteration
        return d
