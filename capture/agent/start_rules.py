"""When a rank's trace starts, whether a config can still start, and whether one still holds its process.

One room for the rules the pipeline applies around Kineto's start (issue 47):

- **Where every rank starts.** An iteration capture starts every rank at one Kineto iteration the
  coordinator chose (`start_iteration`, PROFILE_START_ITERATION with round-up 1); a wall-clock
  capture at one instant it chose (`start_time_ms`, PROFILE_START_TIME), so no rank's Kineto derives
  its own start from the tick on which it happened to read the config. An iteration config that can
  no longer be sent in time (the rank already past the iteration) is never sent: `missed_start`,
  saying why (its process held another capture's config meanwhile, or the coordinator's lead was too
  short). A wall-clock config with less than Kineto's poll, tick and warm-up left before the instant
  (an agent restarted mid-capture, a config held behind another) is still the rank's evidence: it is
  sent with PROFILE_START_TIME=0, Kineto starts it on its own clock, and the artifact's `window`
  names why (`late_start`) beside the start's skew from the instant.
- **What holds a process.** Kineto ignores a config sent while it holds an earlier one it has not
  started ("another profile request is pending"), so the agent sends none then. A wall-clock
  config holds its process only until its start (plus two profiler ticks): by then Kineto has
  either activated it (busy: a new config waits in the endpoint's or dynolog's slot until it is
  idle, as for any trace) or cancelled it (its warm-up refusal), and either way a new config is
  taken. A config Kineto's polls showed it never ran (builtin endpoint) holds nothing.
- **When a trace can no longer come.** Kineto opens `<file>.tmp` when it *activates* a config, before
  it checks the warm-up, and writes into it only when the collection ends, so an empty `.tmp` is
  not a trace being written: a refused wall-clock config leaves one behind for good. A wall-clock
  config is therefore over once its window and the write time have passed with no file, whatever
  `.tmp` lies there; an iteration config holds while its `.tmp` exists (it starts at an iteration,
  never refused for time) and until the rank stepped past its window.
- **Alignment after the fact.** An iteration trace whose first optimizer step is not the chosen
  one started late (`misaligned`); the manifest's `iterations` says which steps each rank holds.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from ..dynolog import MIN_START_LEAD_MS
from ..models import Dispatch
from .steps import StepLog, first_traced_step

if TYPE_CHECKING:
    from .store import TargetRecord

__all__ = ["HOLD_SLACK_S", "missed_before", "late_start", "holds_process", "tmp_being_written",
           "never_written", "misaligned", "iterations_of", "window_of"]

#: A wall-clock config is activated or cancelled by Kineto's profiler tick (1 s) before its start; two
#: ticks past it, whatever Kineto did with it is done.
HOLD_SLACK_S = 2.0
#: Kineto's time-based start when the config says 0: its parse time (about its fetch) + 5 s warm-up + 2 s.
IMPLICIT_START_S = 7.0
#: Kineto's on-demand config poll: a queued config is fetched within this long.
KINETO_POLL_S = 5.0


def _hms(t: float | None) -> str:
    if t is None:
        return "?"
    return time.strftime("%H:%M:%S", time.gmtime(t)) + f".{int(t * 1000) % 1000:03d}Z"


def _held_note(held_by: "TargetRecord | None") -> str:
    if held_by is None:
        return ""
    return (f" Its process still held capture {held_by.capture_id} target {held_by.target_id}'s config until then "
            f"(Kineto ignores a new config while it holds one it has not started), so this one could not be sent")


def late_start(spec: Dispatch, now: float, held_by: "TargetRecord | None" = None) -> str | None:
    """A wall-clock config whose chosen instant can no longer be met: why (the rank is then asked to
    start on Kineto's own clock, its skew recorded), or None."""
    if spec.iterations or not spec.start_time_ms or spec.start_time_ms - now * 1000 >= MIN_START_LEAD_MS:
        return None
    start = spec.start_time_ms / 1000.0
    return (f"the capture starts every rank's window at {_hms(start)}, {start - now:.1f} s from when this rank's "
            f"config could be sent: too close for Kineto to fetch it (its poll, up to 5 s), reach it on its 1 s "
            f"profiler tick and warm up 5 s (>= {MIN_START_LEAD_MS / 1000:g} s needed), so this rank started on "
            f"Kineto's own clock (about 7 s after its fetch).{_held_note(held_by)}"
            + ("" if held_by else " The coordinator's --wall-start-lead-s sets how far ahead it chooses"))


def implicit_start(rec: "TargetRecord", poll_s: float = KINETO_POLL_S) -> float:
    """When Kineto starts a config sent with PROFILE_START_TIME=0: about 7 s after it fetched it."""
    return (rec.delivered_at or ((rec.queued_at or rec.accepted_at) + poll_s)) + IMPLICIT_START_S


def missed_before(spec: Dispatch, steps: StepLog | None, now: float, held_by: "TargetRecord | None" = None) -> str | None:
    """Before queueing: the reason this iteration config can no longer start where the capture starts
    every rank, or None: the rank is already at or past the start iteration (Kineto would move a past
    start to its next step, out of line with the others). A wall-clock config is never missed: see
    `late_start`."""
    if spec.iterations and spec.start_iteration is not None:
        start = spec.start_iteration
        if steps is None or steps.kineto_iteration < start:
            return None   # behind it (or unknown: then the trace itself is checked after verification)
        why = _held_note(held_by) or (" (the coordinator's --start-lead-s sets how far ahead it chooses)")
        return (f"rank {spec.rank} was already at Kineto iteration {steps.kineto_iteration} (optimizer step "
                f"{steps.latest}) before its config could be queued; the capture starts every rank at iteration "
                f"{start}, so this rank was not asked.{why}")
    return None


def holds_process(other: "TargetRecord", now: float) -> bool:
    """May `other`'s config (queued, no trace yet) still be pending, unstarted, in its Kineto?"""
    if other.kineto_refusal is not None and other.kineto_started_at is None:
        return False                      # the endpoint saw Kineto stay idle past its start: dropped
    spec = other.spec
    if not spec.iterations and spec.start_time_ms and not other.late_start \
            and now > spec.start_time_ms / 1000.0 + HOLD_SLACK_S:
        return False                      # activated (busy: a new config waits its turn) or cancelled
    # an iteration config, or one on Kineto's own clock (no instant to judge by): until its trace
    # appears or never_written says it cannot
    return True


def tmp_being_written(watch_path: str | None) -> bool:
    """Kineto writes into its `.tmp` only once the collection ends; an empty one proves nothing."""
    if not watch_path:
        return False
    try:
        return os.path.getsize(watch_path + ".tmp") > 0
    except OSError:
        return False


def never_written(rec: "TargetRecord", steps: StepLog | None, now: float, passed_at: list[float], *,
                  poll_s: float, write_s: float) -> str | None:
    """Why a queued config's trace can no longer appear (its process may take another), or None."""
    spec = rec.spec
    if rec.kineto_started_at is not None and rec.kineto_idle_at is not None:
        # Kineto renames its file before it goes idle, so a .tmp left behind after an idle poll is a
        # write that failed, not one in progress
        left = " (its .tmp was left behind: Kineto's rename failed)" if (
            rec.watch_path and os.path.exists(rec.watch_path + ".tmp")) else ""
        return f"Kineto's polls showed the trace run and end{left}"
    if rec.kineto_refusal is not None and rec.kineto_started_at is None and not tmp_being_written(rec.watch_path):
        return "Kineto's polls showed it never ran the config (idle past its start)"
    if not spec.iterations:
        if tmp_being_written(rec.watch_path):
            return None                    # Kineto is writing it right now
        if spec.start_time_ms and not rec.late_start:
            start = spec.start_time_ms / 1000.0
            note = f"a wall-clock config due to start at {_hms(start)}"
        else:   # Kineto's own start: 7 s after its fetch
            start = implicit_start(rec, poll_s)
            note = f"a time-based config due to start by {_hms(start)}"
        due = start + spec.duration_ms / 1000.0 + write_s
        if now <= due:
            return None
        tmp = " (the empty .tmp there is what Kineto left when it cancelled it)" if (
            rec.watch_path and os.path.exists(rec.watch_path + ".tmp")) else ""
        return f"{note} is long past its window with no file{tmp}"
    if rec.watch_path and os.path.exists(rec.watch_path + ".tmp"):
        return None                        # an iteration trace started: Kineto writes it at its end
    if spec.start_iteration is None:
        return None                        # a round-up start may lie far ahead: only the longest linger ends it
    if steps is None or steps.kineto_iteration <= spec.start_iteration + spec.iterations:
        return None
    if not passed_at:
        passed_at.append(now)
    if now - passed_at[0] < write_s:
        return None
    return (f"the rank stepped past iteration {spec.start_iteration + spec.iterations} (the window's end) "
            f"{now - passed_at[0]:.0f} s ago and no file came")


def misaligned(spec: Dispatch, traced: tuple[int, int] | None) -> str | None:
    """An iteration trace that did not start at the capture's chosen iteration: the reason, or None."""
    if spec.start_iteration is None or traced is None or traced[0] == first_traced_step(spec.start_iteration):
        return None
    return (f"traced optimizer steps {traced[0]}..{traced[1]}, but the capture starts every rank "
            f"at Kineto iteration {spec.start_iteration} (optimizer step "
            f"{first_traced_step(spec.start_iteration)}): Kineto took the config after that "
            f"iteration and started at its next step")


def iterations_of(spec: Dispatch, verdict: dict) -> dict:
    """The manifest's `iterations`: optimizer step numbers from the hook's counter when it mapped
    the trace (every rank of an aligned capture has the same ones, with or without torch.profiler
    in the loop), else the trace's own ProfilerStep#N markers."""
    counted = verdict.get("step_first") is not None
    steps = verdict["step_last"] - verdict["step_first"] + 1 if counted else int(verdict.get("optimizer_steps") or 0)
    return {"requested": spec.iterations, "roundup": 1 if spec.start_iteration is not None else (spec.iteration_roundup or 1),
            "start": spec.start_iteration,
            "numbering": "optimizer_step" if counted else "profiler_step",
            "first": verdict.get("step_first") if counted else verdict.get("first_step"),
            "last": verdict.get("step_last") if counted else verdict.get("last_step"),
            **({"collected_last": verdict.get("step_collected_last")} if counted else {}),
            "optimizer_steps": steps, "stepped": steps > 0}


def window_of(spec: Dispatch, verdict: dict, late: str | None = None) -> dict[str, Any] | None:
    """The manifest's `window` of a wall-clock trace: when this rank's collection really ran (unix s,
    Kineto's own collection span), beside the instant the capture chose for every rank and, when the
    rank could not be asked in time for it, why (`late_start`)."""
    if spec.iterations or verdict.get("window_start") is None:
        return None
    out: dict[str, Any] = {"start": verdict["window_start"], "end": verdict["window_end"]}
    if spec.start_time_ms:
        out["chosen_start"] = spec.start_time_ms / 1000.0
        out["start_skew_s"] = round(verdict["window_start"] - spec.start_time_ms / 1000.0, 3)
        if late:
            out["late_start"] = late
    return out
