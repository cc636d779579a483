"""Price a capture before anything is asked of a trainer: a byte budget per rank (issue 27).

Every capture has a budget of uncompressed trace JSON per rank (the request's `budget_mb`, else the
coordinator's `--budget-mb`, 200 by default: docs/coordinator.md, "Trace budget"). The coordinator
estimates what the request would write per rank and fits it:

- **bytes per unit**, measured when it can: over every capture of the job that archived a trace,
  the largest rank's uncompressed bytes per optimizer step (iteration captures) or per second of
  window (time captures), divided by the payload factor of that capture's options, the largest
  of each kind (`combined`: alternating wall and iteration captures each keep their own measure).
  Otherwise a conservative start (`CONSERVATIVE_PER_ITERATION`, `CONSERVATIVE_PER_SECOND`) that the
  first capture of that kind corrects.
- **payload options** multiply it (`OPTION_FACTORS`): `record_shapes`, `with_stack`,
  `profile_memory`, `with_flops` add args and events to every op.
- **fit**: iterations (or the window) are cut to what `HEADROOM` of the budget holds. When not even
  one iteration (or `MIN_WINDOW_MS`) fits, payload options are dropped, costliest first, until one
  does; when a bare capture does not fit either the request is refused with the numbers.
- **the trainer's buffers**: `ACTIVITIES_MAX_GPU_BUFFER_SIZE_MB` goes to Kineto as half the budget
  (4..128 MB). A GPU activity's JSON is at least twice its CUPTI record, so the cap cannot cut a
  trace that fits the budget, and it bounds the memory Kineto holds in the trainer's process.

Nothing here looks at a node: the agent checks its own disk against the same budget (agent/space.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from gpulens.capture.models import CaptureOptions, CaptureRequest, Manifest, TraceBudget
from gpulens.capture.models.budget import DEFAULT_BUDGET_MB, MIB

__all__ = ["BudgetRefused", "BudgetPlan", "Measured", "plan_budget", "measured_from", "combined", "OPTION_FACTORS",
           "CONSERVATIVE_PER_ITERATION", "CONSERVATIVE_PER_SECOND", "HEADROOM", "MIN_WINDOW_MS", "DEFAULT_BUDGET_MB"]

#: published per-rank, per-step sizes start at ~5 MB for a debug-size model (torchtitan) and reach
#: ~150 MB for a large MoE: 8 MiB per step is the start for a job never measured
CONSERVATIVE_PER_ITERATION = 8 * MIB
CONSERVATIVE_PER_SECOND = 16 * MIB        # a few such steps per second
#: how much each payload option multiplies a trace (costliest first: the order options are dropped in)
OPTION_FACTORS = {"with_stack": 2.5, "record_shapes": 1.6, "profile_memory": 1.3, "with_flops": 1.1}
HEADROOM = 0.8                            # plan for 80% of the budget: estimates are estimates
MIN_WINDOW_MS = 100                       # the shortest window a request may ask for (schema)
GPU_BUFFER_MB = (4, 128)                  # one CUPTI buffer .. Kineto's own default


class BudgetRefused(ValueError):
    """Not even a bare capture fits the budget; the message has the numbers."""


@dataclass(frozen=True)
class Measured:
    """The job's trace size as its captures showed it, without their payload factors."""

    per_iteration: float | None = None
    per_second: float | None = None
    capture_id: str = ""              # the capture that measured per_iteration (or per_second, alone)
    per_second_from: str = ""         # the capture that measured per_second, when combined
    captures: int = 1                 # how many of the job's captures were measured

    def source(self, kind: str) -> str:
        ids = self.per_second_from or self.capture_id if kind == "second" else self.capture_id
        return f"capture {ids}" + (f" (largest of {self.captures} measured captures)" if self.captures > 1 else "")


@dataclass(frozen=True)
class BudgetPlan:
    request: CaptureRequest           # what will be asked of the trainers (maybe reduced)
    budget: TraceBudget
    changes: tuple[str, ...] = ()     # what was reduced, and why, for people

    def to_dict(self) -> dict[str, Any]:
        return self.budget.to_dict() | {"changes": list(self.changes)}


def payload_factor(options: CaptureOptions) -> float:
    f = 1.0
    for name, factor in OPTION_FACTORS.items():
        if getattr(options, name):
            f *= factor
    return f


def measured_from(manifest: Manifest, request: CaptureRequest) -> Measured | None:
    """Bytes per optimizer step (or per second) of the largest rank of a finished capture; None for
    a hang capture (its documents say nothing of a trace's size)."""
    if request.is_hang:
        return None
    factor = payload_factor(request.options)
    per_it = per_s = None
    for a in manifest.artifacts:
        size = (a.sizes or {}).get("uncompressed")
        if not size:
            continue
        steps = (a.iterations or {}).get("optimizer_steps") if request.iterations else None
        if request.iterations and steps:
            per_it = max(per_it or 0.0, size / steps / factor)
        elif not request.iterations:
            per_s = max(per_s or 0.0, size / (request.duration_ms / 1000) / factor)
    if per_it is None and per_s is None:
        return None
    return Measured(per_it, per_s, manifest.capture_id)


def combined(measures: "list[Measured]") -> Measured | None:
    """Every measured capture of the job as one measure: per kind, the largest (a budget is a cap)."""
    if not measures:
        return None
    its = [m for m in measures if m.per_iteration]
    secs = [m for m in measures if m.per_second]
    it = max(its, key=lambda m: m.per_iteration) if its else None
    sec = max(secs, key=lambda m: m.per_second) if secs else None
    return Measured(it.per_iteration if it else None, sec.per_second if sec else None,
                    capture_id=(it or sec).capture_id, per_second_from=sec.capture_id if sec else "",
                    captures=len(measures))


def plan_budget(request: CaptureRequest, *, default_mb: int = DEFAULT_BUDGET_MB,
                measured: Measured | None = None) -> BudgetPlan:
    """The request fitted to its budget, or BudgetRefused."""
    budget_mb = request.budget_mb or default_mb
    budget = budget_mb * MIB
    iterative = bool(request.iterations)
    if iterative:
        base = measured.per_iteration if measured and measured.per_iteration else None
        basis = (f"{_mib(base)} per iteration measured by {measured.source('iteration')}" if base
                 else f"{_mib(CONSERVATIVE_PER_ITERATION)} per iteration (conservative: no iteration capture of this job measured yet)")
        base = base or CONSERVATIVE_PER_ITERATION
    else:
        base = measured.per_second if measured and measured.per_second else None
        basis = (f"{_mib(base)} per second measured by {measured.source('second')}" if base
                 else f"{_mib(CONSERVATIVE_PER_SECOND)} per second (conservative: no wall-clock capture of this job measured yet)")
        base = base or CONSERVATIVE_PER_SECOND
    options, changes = request.options, []
    while True:
        per_unit = base * payload_factor(options)
        if iterative:
            fits = int(HEADROOM * budget // per_unit)
            ok = fits >= 1
        else:
            fits = int(HEADROOM * budget / per_unit * 1000)
            ok = fits >= MIN_WINDOW_MS
        if ok:
            break
        dropped = next((n for n in OPTION_FACTORS if getattr(options, n)), None)
        if dropped is None:
            unit = "1 iteration" if iterative else f"a {MIN_WINDOW_MS} ms window"
            raise BudgetRefused(f"{unit} is estimated at {_mib(per_unit * (1 if iterative else MIN_WINDOW_MS / 1000))} "
                                f"per rank ({basis}), more than {HEADROOM:.0%} of the {budget_mb} MiB budget: "
                                "ask for a larger --budget-mb")
        options = replace(options, **{dropped: False})
        changes.append(f"{dropped} dropped: with it not even {'1 iteration' if iterative else f'{MIN_WINDOW_MS} ms'} "
                       f"fits the {budget_mb} MiB budget (it multiplies the trace by ~{OPTION_FACTORS[dropped]})")
    new = replace(request, options=options, budget_mb=budget_mb)
    if iterative and fits < request.iterations:
        changes.append(f"iterations {request.iterations} -> {fits}: ~{_mib(per_unit)} each, the budget is {budget_mb} MiB")
        new = replace(new, iterations=fits)
    elif not iterative and fits < request.duration_ms:
        changes.append(f"window {request.duration_ms} ms -> {fits} ms: ~{_mib(per_unit)} per second, "
                       f"the budget is {budget_mb} MiB")
        new = replace(new, duration_ms=fits)
    units = new.iterations if iterative else new.duration_ms / 1000
    gpu_mb = max(GPU_BUFFER_MB[0], min(GPU_BUFFER_MB[1], budget_mb // 2))
    tb = TraceBudget(budget_bytes=budget, estimate_bytes=int(per_unit * units), gpu_buffer_mb=gpu_mb,
                     basis=basis + (f"; options x{payload_factor(options):g}" if payload_factor(options) != 1 else ""))
    return BudgetPlan(new, tb, tuple(changes))


def _mib(n: float) -> str:
    return f"{n / MIB:.1f} MiB"
