"""Is this file the trace we asked for? Checked in one streaming pass, in a worker process.

Checks (each failure is one line in `Verdict.problems`):
- valid JSON to the last byte (a truncated file fails; its bytes stay on disk);
- Kineto's top-level keys: schemaVersion, traceEvents, displayTimeUnit, baseTimeNanoseconds,
  traceName; traceName's file name is this file's (a renamed or copied file is not bound to us);
- `trace_id` equals the one the trigger set, when the agent knows it (builtin endpoint);
- every timed event lies inside the capture's wall-clock window (unix time = baseTimeNanoseconds +
  ts), and the traced span is not longer than the requested duration plus slack;
- CPU events carry the target's pid (its pid in its own namespace);
- the requested activity types that the process must produce are present, and activity types not
  requested are ABSENT. The negative check is the one that proves Kineto honoured ACTIVITY_TYPES:
  Kineto's default set includes python_function, so "cpu_op present" passes either way.
The same pass yields size, sha256 and the event count for the manifest, and for iteration-based
requests the `ProfilerStep#N` numbers the trace covers and its `Optimizer.step#...` spans (Kineto
counts optimizer steps: a trace with none is the short time trace Kineto falls back to when the
process never steps). Iteration traces are not held to the duration: N steps take what they take.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from ..activities import CORE_ACTIVITY_TYPES, NEWER_ACTIVITY_TYPES
from .jsonstream import CHUNK, TraceStream, TraceSyntaxError

__all__ = ["Expectation", "Verdict", "verify_trace", "REQUIRED_KEYS", "must_be_present"]

REQUIRED_KEYS = ("schemaVersion", "traceEvents", "displayTimeUnit", "baseTimeNanoseconds", "traceName")
ACTIVITY_CATEGORIES = frozenset(CORE_ACTIVITY_TYPES) | frozenset(NEWER_ACTIVITY_TYPES)
_CPU_CATEGORIES = frozenset({"cpu_op", "python_function", "user_annotation", "cpu_instant_event"})
MAX_PROBLEMS = 12
_STEP = re.compile(r"ProfilerStep#(\d+)")


@dataclass(frozen=True)
class Expectation:
    activities: tuple[str, ...]
    window_start: float             # unix seconds: no event may start before (the dispatch, less clock slack)
    window_end: float               # unix seconds: no event may end after (the observation, plus slack)
    duration_ms: int
    with_stack: bool = False
    pid: int | None = None          # the target's pid in its own namespace
    trace_id: str | None = None     # known only when the agent set it (builtin endpoint)
    span_slack_ms: int = 1500
    iterations: int | None = None   # an iteration-based request: the span is not bounded by duration_ms


@dataclass
class Verdict:
    ok: bool
    problems: list[str] = field(default_factory=list)
    size: int = 0
    sha256: str = ""
    event_count: int = 0
    categories: dict[str, int] = field(default_factory=dict)
    trace_id: str | None = None
    first_event_at: float | None = None
    last_event_at: float | None = None
    first_step: int | None = None   # lowest / highest ProfilerStep#N in the trace
    last_step: int | None = None
    optimizer_steps: int = 0        # Optimizer.step#... spans

    @property
    def detail(self) -> str:
        return "; ".join(self.problems) if self.problems else "ok"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def must_be_present(activities: tuple[str, ...], with_stack: bool, gpu: bool) -> set[str]:
    """Requested types every armed training process produces in any window: cpu_op; python_function
    when stacks are on; kernel on a GPU. Others (annotations, memcpy) depend on the user's code."""
    need = {"cpu_op"} | ({"python_function"} if with_stack else set()) | ({"kernel"} if gpu else set())
    return need & set(activities)


def verify_trace(path: str, exp: Expectation, *, chunk: int = CHUNK) -> Verdict:
    """One pass over `path`; never raises for bad content (only the verdict says so)."""
    sha = hashlib.sha256()
    size = 0

    def count(data: bytes) -> None:
        nonlocal size
        size += len(data)
        sha.update(data)

    problems: list[str] = []
    top: dict[str, Any] = {}
    cats: Counter[str] = Counter()
    events = 0
    ts_min = ts_max = None
    foreign_pids: Counter[Any] = Counter()
    steps: list[int] = []
    optimizer_steps = 0
    try:
        with open(path, "rb") as f:
            for kind, item in TraceStream(f, chunk=chunk, on_bytes=count):
                if kind == "key":
                    name, value = item
                    top[name] = value if name != "traceEvents" else True
                    continue
                events += 1
                if not isinstance(item, dict):
                    _add(problems, f"traceEvents[{events - 1}] is not an object")
                    continue
                cat = item.get("cat")
                if cat is not None:
                    cats[cat] += 1
                ph, ts = item.get("ph"), item.get("ts")
                if ph != "M" and isinstance(ts, (int, float)) and not isinstance(ts, bool):
                    dur = item.get("dur")
                    end = ts + dur if isinstance(dur, (int, float)) and not isinstance(dur, bool) else ts
                    ts_min = ts if ts_min is None or ts < ts_min else ts_min
                    ts_max = end if ts_max is None or end > ts_max else ts_max
                if exp.pid is not None and cat in _CPU_CATEGORIES and item.get("pid") != exp.pid:
                    foreign_pids[item.get("pid")] += 1
                if cat == "user_annotation" and ph == "X":
                    name = item.get("name")
                    if isinstance(name, str):
                        m = _STEP.fullmatch(name)
                        if m:
                            steps.append(int(m.group(1)))
                        elif name.startswith("Optimizer.step#"):
                            optimizer_steps += 1
    except TraceSyntaxError as exc:
        problems.insert(0, f"not valid JSON: {exc}")
    except OSError as exc:
        return Verdict(False, [f"unreadable: {exc}"], size, sha.hexdigest())
    # finish hashing if parsing stopped early (the manifest's checksum is always of the whole file)
    if problems and problems[0].startswith("not valid JSON"):
        try:
            with open(path, "rb") as f:
                f.seek(size)
                for data in iter(lambda: f.read(CHUNK), b""):
                    count(data)
        except OSError:
            pass
        return Verdict(False, problems, size, sha.hexdigest(), events, dict(cats))

    for key in REQUIRED_KEYS:
        if key not in top:
            _add(problems, f"top-level key {key!r} missing (not a Kineto trace)")
    trace_name = top.get("traceName")
    if isinstance(trace_name, str) and os.path.basename(trace_name) != os.path.basename(path):
        _add(problems, f"traceName {os.path.basename(trace_name)!r} is not this file ({os.path.basename(path)!r})")
    found_id = top.get("trace_id")
    found_id = str(found_id) if found_id is not None else None
    if exp.trace_id is not None and found_id != exp.trace_id:
        _add(problems, f"trace_id {found_id!r} is not the requested {exp.trace_id!r}")
    if foreign_pids:
        pid, n = foreign_pids.most_common(1)[0]
        _add(problems, f"{sum(foreign_pids.values())} CPU events are not from pid {exp.pid} (e.g. {n} from {pid!r})")

    first = last = None
    base = top.get("baseTimeNanoseconds")
    if isinstance(base, int) and ts_min is not None:
        # ts is in microseconds (Chrome trace format); displayTimeUnit only changes how viewers show it
        first, last = base / 1e9 + ts_min / 1e6, base / 1e9 + ts_max / 1e6
        if first < exp.window_start:
            _add(problems, f"events start {exp.window_start - first:.1f} s before the capture window")
        if last > exp.window_end:
            _add(problems, f"events end {last - exp.window_end:.1f} s after the capture window")
        span_ms = (last - first) * 1000
        if exp.iterations is None and span_ms > exp.duration_ms + exp.span_slack_ms:
            _add(problems, f"events span {span_ms:.0f} ms, the request was {exp.duration_ms} ms")
    elif ts_min is None:
        _add(problems, "no timed events")

    activity_cats = {c: n for c, n in cats.items() if c in ACTIVITY_CATEGORIES}
    unrequested = sorted(set(activity_cats) - set(exp.activities))
    if unrequested:
        _add(problems, "activity types not requested are present: "
                       + ", ".join(f"{c} ({activity_cats[c]} events)" for c in unrequested))
    gpu = bool(top.get("deviceProperties"))
    missing = sorted(must_be_present(exp.activities, exp.with_stack, gpu) - set(activity_cats))
    if missing:
        _add(problems, "requested activity types absent: " + ", ".join(missing))
    return Verdict(not problems, problems, size, sha.hexdigest(), events, dict(cats), found_id, first, last,
                   min(steps) if steps else None, max(steps) if steps else None, optimizer_steps)


def _add(problems: list[str], text: str) -> None:
    if len(problems) < MAX_PROBLEMS:
        problems.append(text)
