"""Where one rank's training steps lie in its trace: the windows every per-step number is taken over
(the evidence's shares per step, the cross-rank step times).

Two sources, the first a trace has:

- `ProfilerStep#N` markers, which only a loop that drives `torch.profiler` with `prof.step()` writes:
  each marker is one step, numbered N;
- the optimizer's own spans, `Optimizer.step#<Class>.step`, which PyTorch records on every
  `optimizer.step()` of any loop (an on-demand capture of a plain loop has these and no markers).
  A step's work runs from the end of the previous optimizer step to the end of its own (the hook's
  definition, capture/agent/steps.py), so a trace holding n optimizer steps holds n - 1 whole steps:
  the first one's work began before the collection did.

Numbering of optimizer windows: the capture's optimizer step numbers where the manifest has them
(an iteration capture's `iterations.first` is the trace's first optimizer step, the hook's count;
Kineto starts such a collection inside the previous step's post-hook), else `relative` (0 is the
trace's first optimizer step), which the cross-rank reduce lines up across ranks by time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["StepWindows", "step_windows", "PROFILER_STEP", "OPTIMIZER_STEP", "PROFILER", "OPTIMIZER", "RELATIVE"]

PROFILER_STEP = re.compile(r"^ProfilerStep#(\d+)$")
OPTIMIZER_STEP = re.compile(r"^Optimizer\.step#")
#: numbering kinds
PROFILER, OPTIMIZER, RELATIVE = "profiler_step", "optimizer_step", "relative"


@dataclass(frozen=True)
class StepWindows:
    numbering: str | None                          # PROFILER, OPTIMIZER, RELATIVE; None: no steps found
    steps: tuple[tuple[int, float, float], ...]    # (number, start, end) in the frame's time (us)

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def windows(self) -> list[tuple[float, float]]:
        return [(s, e) for _, s, e in self.steps]


def step_windows(cpu: "pd.DataFrame", names: list[str], first_optimizer_step: int | None = None) -> StepWindows:
    """The steps of one rank's CPU frame (HTA's, `stream < 0`): markers if any, else optimizer
    windows numbered from `first_optimizer_step` (the manifest's) or relative."""
    marker_ids = {i: int(m.group(1)) for i, n in enumerate(names) if (m := PROFILER_STEP.match(n))}
    if marker_ids:
        # one window per step number (a trace may hold the same marker on two threads)
        marks = cpu[cpu["name"].isin(list(marker_ids))].sort_values("ts").drop_duplicates("name")
        if len(marks):
            return StepWindows(PROFILER, tuple(
                (marker_ids[int(n)], float(ts), float(ts + dur))
                for n, ts, dur in zip(marks["name"].tolist(), marks["ts"].tolist(), marks["dur"].tolist())))
    opt_ids = [i for i, n in enumerate(names) if OPTIMIZER_STEP.match(n)]
    spans = cpu[cpu["name"].isin(opt_ids) & (cpu["dur"] >= 0)]
    # every optimizer.step() call is one count of the hook (and one Kineto iteration), nested or not
    ends = sorted({float(ts + dur) for ts, dur in zip(spans["ts"].tolist(), spans["dur"].tolist())})
    if len(ends) < 2:
        return StepWindows(None, ())
    numbering, base = (OPTIMIZER, first_optimizer_step) if first_optimizer_step is not None else (RELATIVE, 0)
    return StepWindows(numbering, tuple((base + k, ends[k - 1], ends[k]) for k in range(1, len(ends))))
