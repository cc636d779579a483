"""Reading a worker's optimizer step count, as the trainer hook publishes it (hooks/site/_gpulens_steps.py).

The hook writes, after every optimizer step, the count Kineto's step tracker holds and the wall
clock into a ring of 4,096 entries in a small memory-mapped file beside the registration record.
From it the agent learns, without asking the job anything:

- where a rank is now (`latest`) and how fast it steps (`rate`), so the coordinator can choose one
  absolute start iteration far enough ahead for every rank;
- which optimizer steps a trace holds: those whose work lies inside Kineto's collection span
  (`steps_during`).

Kineto's iteration number is the count less one (its counter starts at -1 and each `step()`
increments it first); `KINETO_FIRST_TRACED` says how a start iteration N shows in a trace: the
post-hook of step N + 1 moves Kineto to N and starts the collection, so the first step whose work
is collected is N + 2 (measured with torch 2.13 by tests/agent/test_start_iteration_torch.py: start
361 and 3 iterations collected steps 362..365's post-hooks, i.e. the work of steps 363..365).
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass

from gpulens.hooks.site import _gpulens_steps as _format

__all__ = ["StepLog", "read_steps", "StepsUnreadable", "kineto_iteration", "first_traced_step", "KINETO_FIRST_TRACED"]

# The file's layout has one definition, the writer's: the hook's stdlib-only module, which this
# reader imports as a module of the installed package (issue 47).
MAGIC, HEADER, ENTRY, HEADER_SIZE, VERSION = (
    _format.MAGIC, _format.HEADER, _format.ENTRY, _format.HEADER_SIZE, _format.VERSION)
MAX_SLOTS = 1 << 16
KINETO_FIRST_TRACED = 2   # first traced optimizer step count = PROFILE_START_ITERATION + this


class StepsUnreadable(ValueError):
    """The file is missing, truncated or not a step file; the message says which."""


def kineto_iteration(step_count: int) -> int:
    """Kineto's iteration counter after `step_count` optimizer steps (-1 before the first)."""
    return step_count - 1


def first_traced_step(start_iteration: int) -> int:
    """The count of the first optimizer step a trace started at `start_iteration` records whole."""
    return start_iteration + KINETO_FIRST_TRACED


@dataclass(frozen=True)
class StepLog:
    latest: int                     # optimizer steps so far (-1: the hook is armed, nothing stepped yet)
    latest_at: float                # unix seconds of that step
    steps: tuple[int, ...]          # the ring's entries, ascending
    times: tuple[float, ...]        # their post-hook times, unix seconds

    @property
    def kineto_iteration(self) -> int:
        return kineto_iteration(self.latest)

    def rate(self, window_s: float = 10.0) -> float | None:
        """Steps per second over the last `window_s` of entries (None with fewer than two)."""
        if len(self.steps) < 2:
            return None
        lo = bisect.bisect_left(self.times, self.times[-1] - window_s)
        lo = min(lo, len(self.steps) - 2)
        span = self.times[-1] - self.times[lo]
        if span <= 0:
            return None
        return (self.steps[-1] - self.steps[lo]) / span

    def steps_during(self, start: float, end: float) -> tuple[int, int] | None:
        """The first and last optimizer step whose work a collection [start, end] (unix seconds)
        holds, or None when it holds none or the ring no longer reaches back to `start`.

        Step s's work runs from step s-1's post-hook to its own. Kineto starts and stops a
        collection *inside* a post-hook (PyTorch's, just before ours), so the boundary steps' own
        post-hook times sit microseconds from the edges; the midpoint of each step's work is half
        a step away from them, which no clock difference between Kineto and `time.time_ns` blurs."""
        if len(self.times) < 2 or self.times[0] > start:
            return None
        inside = [s for (p, tp), (s, ts) in zip(zip(self.steps, self.times), zip(self.steps[1:], self.times[1:]))
                  if s == p + 1 and start <= (tp + ts) / 2 <= end]
        return (inside[0], inside[-1]) if inside else None


def read_steps(path: str | os.PathLike) -> StepLog:
    """One consistent read of a step file; StepsUnreadable when it is not one."""
    try:
        with open(path, "rb") as f:
            data = f.read(HEADER_SIZE + MAX_SLOTS * ENTRY.size + 1)
    except OSError as exc:
        raise StepsUnreadable(f"cannot read {path}: {exc.strerror or exc}") from exc
    if len(data) < HEADER_SIZE:
        raise StepsUnreadable(f"{path}: {len(data)} bytes, shorter than its header")
    magic, version, slots, latest, latest_ns = HEADER.unpack_from(data, 0)
    if magic != MAGIC or version != VERSION:
        raise StepsUnreadable(f"{path}: not a gpulens step file (magic {magic!r}, version {version})")
    if not 1 <= slots <= MAX_SLOTS or len(data) < HEADER_SIZE + slots * ENTRY.size:
        raise StepsUnreadable(f"{path}: {slots} slots do not fit its {len(data)} bytes")
    pairs = []
    oldest = latest - slots + 1
    for slot, (step, t_ns) in enumerate(ENTRY.iter_unpack(data[HEADER_SIZE:HEADER_SIZE + slots * ENTRY.size])):
        # an entry counts only where it belongs (its slot) and within the ring's current span:
        # stale slots of an earlier lap and never-written zeros are left out
        if oldest <= step <= latest and step >= 1 and t_ns > 0 and step % slots == slot:
            pairs.append((step, t_ns / 1e9))
    pairs.sort()
    return StepLog(latest, latest_ns / 1e9 if latest_ns > 0 else 0.0,
                   tuple(s for s, _ in pairs), tuple(t for _, t in pairs))
