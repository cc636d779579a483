"""Builds the Kineto on-demand config text, refusing anything Kineto would silently mangle.

Kineto's parser (dynolog-kineto-protocol.md 4.1) splits each line on `=` and must get exactly two
parts, cuts lines at `#`, and on any bad value stops parsing and still *accepts* the half-read
config, which is then dropped at activation: the request vanishes although dynolog reported it
triggered. So every value is checked here, before anything is sent:

- the log file name is unique per (capture, target): Kineto deletes an existing file of the same
  final name before renaming its new trace over it, so a reused name lets a queued second trace
  destroy the first; it must contain `.json` (Kineto inserts `_<pid>` before the first `.json`,
  without it several processes would write one file) and no `..` (newer Kineto refuses such paths);
- only activity names every Kineto since 2023 knows (one unknown name kills the request);
- no value may contain `=`, `#`, `..` or a line break;
- `PROFILE_START_TIME=0` means "as soon as possible" (Kineto: parse time + 5 s warm-up + 2 s, from
  whatever tick it reads the config on); wall-clock captures send the explicit start the
  coordinator chose for every rank (issue 47), which must leave room for the poll (<= 5 s), a
  profiler tick (1 s), the warm-up (5 s) and a second of slack, so it has to be at least 12 s in
  the future when built (the agent also checks it before each send: `start_rules`);
- an iteration-based trace (section 4.4) sends `PROFILE_START_ITERATION=0` (always past, so Kineto
  starts at the next multiple of `PROFILE_START_ITERATION_ROUNDUP` after its current optimizer
  step count: one round-up for every rank of a capture gives them the same start iteration),
  `ACTIVITIES_ITERATIONS=N` and no warm-up iterations; `ACTIVITIES_DURATION_MSECS` becomes the
  short (<= 500 ms) window Kineto (>= 2025-09) falls back to when the process never steps. With a
  `start_iteration` the coordinator chose from the ranks' published step counts it sends that
  absolute `PROFILE_START_ITERATION` with round-up 1 instead: every rank that fetches it in time
  starts on exactly that iteration (one that fetches later would start at its next step, which
  the agent refuses beforehand and detects afterwards as `missed_start`).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

from ..activities import CORE_ACTIVITY_TYPES, unknown_activities
from ..models import CaptureOptions

__all__ = ["KinetoConfigError", "TraceConfig", "build_config", "log_file_for", "kineto_trace_path", "MIN_START_LEAD_MS",
           "tick_aligned_start_ms"]

MIN_START_LEAD_MS = 12_000
TICK_MS = 1_000  # Kineto's profiler loop (`kControllerIntervalMsecs`)
MAX_DURATION_MS = 600_000
MAX_ITERATIONS = 10_000
MAX_ROUNDUP = 1_000_000
MAX_START_ITERATION = 10**12


def tick_aligned_start_ms(earliest: float, phase_ms: int = 0) -> int:
    """The first instant at or after `earliest` (unix seconds) that lies `phase_ms` into a second, in ms.

    Why: Kineto's profiler thread ticks on a fixed 1 s grid and activates a time-based config on
    the first tick at or after start - warm-up - 1 s, then cancels it unless that tick still lies
    at least the warm-up before the start, so the config survives only a tick later than its grid
    point by less than the grid's offset from the start. The grid takes the phase of the last
    instant the thread slept until: a trace's start, then its end when that falls between two
    ticks (a window that is not whole seconds). A start on the phase where the process's last
    window ended therefore leaves a whole tick of room; one at an arbitrary millisecond leaves a
    random fraction of it (measured with torch 2.13: 0.993-1.000 s on the phase, 0.11-0.62 s off
    it; docs/agent.md). The coordinator passes the phase its job's last wall-clock window ended on.
    """
    phase = int(phase_ms) % TICK_MS
    ms = math.ceil(earliest * 1000)             # whole ms, never before `earliest`
    return ms + (phase - ms) % TICK_MS
FALLBACK_MS = 500         # the time trace Kineto makes of an iteration request when nothing steps


class KinetoConfigError(ValueError):
    """A config value Kineto would mangle or drop; `.field` names it."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


@dataclass(frozen=True)
class TraceConfig:
    log_file: str
    duration_ms: int
    activities: tuple[str, ...] = ("cpu_op",)
    options: CaptureOptions = field(default_factory=CaptureOptions)
    start_time_ms: int = 0        # 0: Kineto starts after its own warm-up
    trace_id: str | None = None   # the builtin endpoint sets it; dynolog overrides any given one
    allow_newer_activities: bool = False
    iterations: int = 0           # > 0: iteration-based trace of this many optimizer steps
    iteration_roundup: int = 1    # start at a multiple of this (one value for the whole capture)
    start_iteration: int | None = None   # or at exactly this iteration (round-up 1): one number for every rank
    max_gpu_buffer_mb: int | None = None  # ACTIVITIES_MAX_GPU_BUFFER_SIZE_MB (issue 27's budget); None: Kineto's 128


def log_file_for(trace_dir: str, capture_id: str, target_id: str) -> str:
    """`<trace_dir>/<capture_id>/<target_id>.json`: unique per (capture, target)."""
    for name, value in (("capture_id", capture_id), ("target_id", target_id)):
        if not value or "/" in value or value in (".", "..") or ".json" in value:
            raise KinetoConfigError(name, f"{value!r} cannot be part of a trace file name")
    return os.path.join(trace_dir, capture_id, f"{target_id}.json")


def kineto_trace_path(log_file: str, pid: int) -> str:
    """The final name Kineto writes for `log_file` in process `pid` (its own namespace's pid)."""
    for marker in (".pt.trace.json", ".json"):
        i = log_file.find(marker)
        if i >= 0:
            return f"{log_file[:i]}_{pid}{log_file[i:]}"
    return log_file


def _check_value(field: str, value: str) -> str:
    for bad in ("=", "#", "..", "\n", "\r"):
        if bad in value:
            raise KinetoConfigError(field, f"{value!r} contains {bad!r}, which Kineto's config parser cannot carry")
    if value != value.strip():
        raise KinetoConfigError(field, f"{value!r} has surrounding whitespace, which Kineto trims")
    return value


def build_config(cfg: TraceConfig, *, now: float | None = None) -> str:
    """The config text (newline-separated KEY=VALUE, no trailing newline), or KinetoConfigError."""
    log_file = _check_value("log_file", cfg.log_file)
    if not os.path.isabs(log_file):
        raise KinetoConfigError("log_file", f"{log_file!r} is relative: Kineto resolves it in the trainer's cwd (or ignores it)")
    if ".json" not in os.path.basename(log_file):
        raise KinetoConfigError("log_file", f"{log_file!r} has no '.json': Kineto would not insert the pid")
    if isinstance(cfg.duration_ms, bool) or not isinstance(cfg.duration_ms, int) or not 1 <= cfg.duration_ms <= MAX_DURATION_MS:
        raise KinetoConfigError("duration_ms", f"{cfg.duration_ms!r} is not an integer in 1..{MAX_DURATION_MS}")
    if not cfg.activities:
        raise KinetoConfigError("activities", "at least one activity type is needed (empty means Kineto's whole default set)")
    bad = unknown_activities(list(cfg.activities), allow_newer=cfg.allow_newer_activities)
    if bad:
        raise KinetoConfigError("activities", f"unknown to some Kineto versions: {', '.join(map(repr, bad))} "
                                        f"(allowed: {', '.join(CORE_ACTIVITY_TYPES)})")
    for name in cfg.activities:
        _check_value("activities", name)
    if cfg.start_time_ms:
        lead = cfg.start_time_ms - int((time.time() if now is None else now) * 1000)
        if lead < MIN_START_LEAD_MS:
            raise KinetoConfigError("start_time_ms", f"starts in {lead} ms; needs >= {MIN_START_LEAD_MS} ms "
                                               "(poll + profiler tick + warm-up), else Kineto drops it as past")
    for name, value, top in (("iterations", cfg.iterations, MAX_ITERATIONS),
                             ("iteration_roundup", cfg.iteration_roundup, MAX_ROUNDUP)):
        if isinstance(value, bool) or not isinstance(value, int) or not (0 if name == "iterations" else 1) <= value <= top:
            raise KinetoConfigError(name, f"{value!r} is not an integer in range (max {top})")
    if cfg.start_iteration is not None and (isinstance(cfg.start_iteration, bool) or not isinstance(cfg.start_iteration, int)
                                            or not 0 <= cfg.start_iteration <= MAX_START_ITERATION):
        raise KinetoConfigError("start_iteration", f"{cfg.start_iteration!r} is not an integer in 0..{MAX_START_ITERATION}")
    if cfg.start_iteration is not None and not cfg.iterations:
        raise KinetoConfigError("start_iteration", "a start iteration needs iterations > 0")
    if cfg.iterations and cfg.start_time_ms:
        raise KinetoConfigError("start_time_ms", "an iteration-based trace starts at an iteration, not at a time")
    if cfg.trace_id is not None and not (cfg.trace_id.isdigit() and len(cfg.trace_id) <= 32):
        raise KinetoConfigError("trace_id", f"{cfg.trace_id!r} is not a decimal id")
    o = cfg.options
    lines = [
        f"ACTIVITIES_LOG_FILE={log_file}",
        f"PROFILE_START_TIME={int(cfg.start_time_ms)}",
        f"ACTIVITIES_DURATION_MSECS={cfg.duration_ms}",
        f"ACTIVITY_TYPES={','.join(cfg.activities)}",
        f"PROFILE_REPORT_INPUT_SHAPES={_b(o.record_shapes)}",
        # PROFILE_PROFILE_MEMORY adds memory events to the JSON trace. PROFILE_MEMORY (what dyno
        # also sets) would switch Kineto to a pickle memory snapshot and no trace at all.
        f"PROFILE_PROFILE_MEMORY={_b(o.profile_memory)}",
        f"PROFILE_WITH_STACK={_b(o.with_stack)}",
        f"PROFILE_WITH_FLOPS={_b(o.with_flops)}",
        f"PROFILE_WITH_MODULES={_b(o.with_modules)}",
    ]
    if cfg.iterations:
        lines[2] = f"ACTIVITIES_DURATION_MSECS={min(cfg.duration_ms, FALLBACK_MS)}"
        start, roundup = (0, cfg.iteration_roundup) if cfg.start_iteration is None else (cfg.start_iteration, 1)
        lines += [f"PROFILE_START_ITERATION={start}", f"PROFILE_START_ITERATION_ROUNDUP={roundup}",
                  "ACTIVITIES_WARMUP_ITERATIONS=0", f"ACTIVITIES_ITERATIONS={cfg.iterations}"]
    if cfg.max_gpu_buffer_mb is not None:
        if isinstance(cfg.max_gpu_buffer_mb, bool) or not isinstance(cfg.max_gpu_buffer_mb, int) \
                or not 1 <= cfg.max_gpu_buffer_mb <= 1 << 16:
            raise KinetoConfigError("max_gpu_buffer_mb", f"{cfg.max_gpu_buffer_mb!r} is not an integer in 1..65536")
        lines.append(f"ACTIVITIES_MAX_GPU_BUFFER_SIZE_MB={cfg.max_gpu_buffer_mb}")
    if cfg.trace_id is not None:
        lines.append(f"REQUEST_TRACE_ID={cfg.trace_id}")
    return "\n".join(lines)


def _b(flag: bool) -> str:
    return "true" if flag else "false"
