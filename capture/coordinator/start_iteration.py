"""One absolute start iteration for every rank of an iteration capture.

Kineto starts an iteration trace at `PROFILE_START_ITERATION` only if it fetched the config before
its own count reached it; with a round-up instead, each rank rounds up from the step at which *it*
fetched the config, and ranks that fetch on either side of a multiple trace different iterations
(issue 34: 1701-1703 beside 1801-1803 in one pod). So the coordinator reads every rank's published
step count through its node agent (`GET /v1/workers`, `steps`) and chooses one number far enough
ahead that every rank's Kineto fetches the config before it: the furthest rank's count projected
to now, plus what the fastest rank steps in `lead_s` (dispatch, the agent's trigger, Kineto's 5 s
poll), at least 2. A rank that is past it anyway ends `missed_start`; none traces other iterations
silently. Ranks of one DDP job step in lockstep, so readings from some ranks speak for all; with
none (an older hook, no torch optimizer), the round-up remains.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gpulens.capture.models import StepReading

__all__ = ["StartPlan", "plan_start", "MIN_AHEAD"]

MIN_AHEAD = 2


@dataclass(frozen=True)
class StartPlan:
    iteration: int | None    # Kineto's PROFILE_START_ITERATION for every rank; None: the round-up decides
    window_s: float          # until the slowest rank should have stepped through the traced iterations (0: unknown)
    detail: str


def plan_start(readings: dict[int, StepReading | None], iterations: int, *, now: float, lead_s: float) -> StartPlan:
    known = {rank: r for rank, r in readings.items() if r is not None and r.count >= 1}
    if not known:
        silent = ", ".join(map(str, sorted(readings))) or "none"
        return StartPlan(None, 0.0, f"no rank publishes its optimizer step count (ranks {silent}: a hook without "
                                    "the step counter, or nothing stepped yet): each rank starts at the next "
                                    "multiple of the round-up")
    projected = {rank: r.kineto_iteration + (r.per_s or 0.0) * max(0.0, now - r.at) for rank, r in known.items()}
    fastest = max((r.per_s or 0.0) for r in known.values())
    slowest = min((r.per_s or 0.0) for r in known.values())
    ahead = max(MIN_AHEAD, math.ceil(fastest * lead_s))
    front = max(projected, key=projected.get)
    start = math.ceil(projected[front]) + ahead
    window = (start + iterations + 2 - min(projected.values())) / slowest if slowest > 0 else 0.0
    detail = (f"every rank starts at Kineto iteration {start}: rank {front} was furthest at ~{projected[front]:.0f} "
              f"({fastest:.2f} steps/s); {ahead} steps ahead cover {lead_s:g} s of dispatch and Kineto's poll "
              f"({len(known)} of {len(readings)} ranks publish their count)")
    return StartPlan(start, window, detail)
