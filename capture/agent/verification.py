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

Speed (issue 17: at least `json.load`'s, in constant memory): the reader yields a decoded batch of
~16 KiB of events at a time, `_Tally` checks each chunk with C-level passes, and sha256 runs on a helper
thread one chunk behind; bench/agent_verify.py measures it against `json.load` side by side.

With a `Staging` (issue 27) the same read also writes the archive copy: gzip on that helper thread,
the sha256 then covering the compressed bytes (staging.py). The copy is kept only when the trace
verified; `stored_path`, `stored_size` and `encoding` say where and what it is.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from itertools import compress, repeat
from math import isfinite
from operator import add, eq, ne
from typing import Any

from ..activities import CORE_ACTIVITY_TYPES, NEWER_ACTIVITY_TYPES
from .jsonstream import CHUNK, TraceStream, TraceSyntaxError
from .staging import StagedBytes, Staging

__all__ = ["Expectation", "Verdict", "verify_trace", "REQUIRED_KEYS", "must_be_present", "Staging"]

REQUIRED_KEYS = ("schemaVersion", "traceEvents", "displayTimeUnit", "baseTimeNanoseconds", "traceName")
ACTIVITY_CATEGORIES = frozenset(CORE_ACTIVITY_TYPES) | frozenset(NEWER_ACTIVITY_TYPES)
_CPU_CATEGORIES = frozenset({"cpu_op", "python_function", "user_annotation", "cpu_instant_event"})
_CPU_MASK = dict.fromkeys(_CPU_CATEGORIES, True)     # .get is a faster predicate than __contains__
MAX_PROBLEMS = 12
_STEP = re.compile(r"ProfilerStep#(\d+)")
_CAT_TYPES = frozenset({str, type(None)})
_NUMBERS = frozenset({int, float})     # exact types: bool is not a timestamp


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
    size: int = 0                   # the trace's own (uncompressed) bytes
    sha256: str = ""                # of the stored bytes: the gzip copy when staged, else the trace
    event_count: int = 0
    categories: dict[str, int] = field(default_factory=dict)
    trace_id: str | None = None
    first_event_at: float | None = None
    last_event_at: float | None = None
    first_step: int | None = None   # lowest / highest ProfilerStep#N in the trace
    last_step: int | None = None
    optimizer_steps: int = 0        # Optimizer.step#... spans
    collection: tuple[float, float] | None = None   # Kineto's own "PyTorch Profiler (0)" span: collection start..stop, unix s
    stored_path: str | None = None  # the verified archive copy (staged), None: archive the trace itself
    stored_size: int = 0            # bytes of what sha256 covers
    encoding: str = "identity"      # gzip when staged
    stage_error: str | None = None  # the copy could not be written (disk): the trace may be fine
    # issue 45: a well-formed trace of this request with no activity at all (Kineto's "CPU trace is
    # empty!"): the rank did no traced work for the whole window, a blocked rank's evidence
    empty: bool = False

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


class _Tally:
    """What one pass learns from the events. `batch` checks a decoded chunk with C-level passes
    (map/compress/set/min/max over the batch, no Python code per event) when every event is
    ordinary (an object whose cat is a string or absent, numeric finite ts/dur, hashable pid);
    otherwise `one` checks its events one at a time. Both reach the same totals."""

    def __init__(self, want_pid: int | None, problems: list[str]):
        self.want_pid, self.problems = want_pid, problems
        self.events = 0
        self.cats: Counter[Any] = Counter()     # counts None too (dropped in `categories`)
        self.ts_min: Any = None
        self.ts_max: Any = None
        self.foreign_pids: Counter[Any] = Counter()
        self.steps: list[int] = []
        self.optimizer_steps = 0
        self.collection: tuple[Any, Any] | None = None     # Kineto's "Trace" span, same units

    @property
    def categories(self) -> dict[str, int]:
        return {c: n for c, n in self.cats.items() if c is not None}

    def batch(self, batch: list) -> None:
        if len(batch) < 16 or not self._fast(batch):     # a few events: the loop is cheaper
            for item in batch:
                self.one(item)

    def _fast(self, batch: list) -> bool:
        """Check `batch` at C speed, or return False having changed nothing."""
        get = dict.get
        try:
            cats = list(map(get, batch, repeat("cat")))          # TypeError: an item is not an object
            cat_set = set(cats)                                  # TypeError: a list or object as cat
        except TypeError:
            return False
        if not set(map(type, cat_set)) <= _CAT_TYPES:
            return False
        phs = list(map(get, batch, repeat("ph")))
        tss = list(map(get, batch, repeat("ts")))
        durs = list(map(get, batch, repeat("dur"), repeat(0)))     # a missing dur ends at ts
        if "M" in phs:                                           # metadata events are not timed
            timed = list(map(ne, phs, repeat("M")))
            tss, durs = list(compress(tss, timed)), list(compress(durs, timed))
        if not set(map(type, tss)) | set(map(type, durs)) <= _NUMBERS:   # exact: bool is not a number
            return False
        try:
            if not isfinite(sum(tss) + sum(durs)):               # NaN/inf: compare one by one
                return False
        except OverflowError:                                    # an int too big for a float
            return False
        pids: list[Any] = []
        if self.want_pid is not None and not cat_set.isdisjoint(_CPU_CATEGORIES):
            pids = list(map(get, batch, repeat("pid")))
            if not cat_set <= _CPU_CATEGORIES:                   # only the CPU events' pids
                pids = list(compress(pids, map(_CPU_MASK.get, cats)))
            try:
                pid_set = set(pids)
            except TypeError:                                    # a list as pid
                return False
            if pid_set <= {self.want_pid}:
                pids = []
        # commit (nothing above changed the tally)
        self.events += len(batch)
        self.cats.update(cats)
        if tss:
            lo, hi = min(tss), max(map(add, tss, durs))
            if self.ts_min is None or lo < self.ts_min:
                self.ts_min = lo
            if self.ts_max is None or hi > self.ts_max:
                self.ts_max = hi
        for pid in pids:
            if pid != self.want_pid:
                self.foreign_pids[pid] += 1
        if "user_annotation" in cat_set:
            for item in compress(batch, map(eq, cats, repeat("user_annotation"))):
                self._step(item)
        if "Trace" in cat_set:
            for item in compress(batch, map(eq, cats, repeat("Trace"))):
                self._collection(item)
        return True

    def one(self, item: Any) -> None:
        self.events += 1
        if type(item) is not dict:
            _add(self.problems, f"traceEvents[{self.events - 1}] is not an object")
            return
        get = item.get
        cat = get("cat")
        if cat is not None:
            if type(cat) is not str:
                cat = repr(cat)          # a list or object as "cat" is counted, not a crash
            self.cats[cat] += 1
        ts = get("ts")
        if type(ts) in _NUMBERS and get("ph") != "M":
            dur = get("dur")
            end = ts + dur if type(dur) in _NUMBERS else ts
            if self.ts_min is None or ts < self.ts_min:
                self.ts_min = ts
            if self.ts_max is None or end > self.ts_max:
                self.ts_max = end
        if self.want_pid is not None and cat in _CPU_CATEGORIES and get("pid") != self.want_pid:
            pid = get("pid")
            self.foreign_pids[pid if _hashable(pid) else repr(pid)] += 1
        if cat == "user_annotation":
            self._step(item)
        elif cat == "Trace":
            self._collection(item)

    def _collection(self, item: dict) -> None:
        """Kineto's span over the whole collection ("PyTorch Profiler (0)", cat "Trace")."""
        ts, dur, name = item.get("ts"), item.get("dur"), item.get("name")
        if (self.collection is None and item.get("ph") == "X" and isinstance(name, str)
                and name.startswith("PyTorch Profiler") and type(ts) in _NUMBERS and type(dur) in _NUMBERS):
            self.collection = (ts, ts + dur)

    def _step(self, item: dict) -> None:
        if item.get("ph") == "X":
            name = item.get("name")
            if isinstance(name, str):
                m = _STEP.fullmatch(name)
                if m:
                    self.steps.append(int(m.group(1)))
                elif name.startswith("Optimizer.step#"):
                    self.optimizer_steps += 1


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def verify_trace(path: str, exp: Expectation, *, chunk: int = CHUNK, stage: Staging | None = None) -> Verdict:
    """One pass over `path`; never raises for bad content (only the verdict says so). With `stage`
    the gzip archive copy is written in the same pass and kept only when the verdict is ok."""
    try:        # a thread pays off from a few chunks on (starting one costs ~0.1 ms)
        threaded = os.stat(path).st_size > 4 * chunk
    except OSError:
        threaded = False
    sha = StagedBytes(threaded, stage)
    try:
        verdict = _verify(path, exp, chunk, sha)
        if not verdict.ok or stage is None:
            sha.abort()
            return verdict
        verdict.stored_path = sha.finish()
        verdict.stored_size, verdict.stage_error = sha.stored_size, sha.error
        verdict.sha256 = sha.hexdigest() if sha.error is None else ""
        verdict.encoding = "gzip"
        return verdict
    finally:
        sha.close()


def _verify(path: str, exp: Expectation, chunk: int, sha: StagedBytes) -> Verdict:
    problems: list[str] = []
    top: dict[str, Any] = {}
    tally = _Tally(exp.pid, problems)
    try:
        with open(path, "rb") as f:
            for kind, item in TraceStream(f, chunk=chunk, on_bytes=sha.update, batches=True):
                if kind == "key":
                    name, value = item
                    top[name] = value if name != "traceEvents" else True
                else:
                    tally.batch(item)
    except TraceSyntaxError as exc:
        problems.insert(0, f"not valid JSON: {exc}")
    except OSError as exc:
        return Verdict(False, [f"unreadable: {exc}"], sha.size, sha.hexdigest())
    # finish hashing if parsing stopped early (the manifest's checksum is always of the whole file)
    if problems and problems[0].startswith("not valid JSON") and sha.stage is None:
        try:
            with open(path, "rb") as f:
                f.seek(sha.size)
                for data in iter(lambda: f.read(CHUNK), b""):
                    sha.update(data)
        except OSError:
            pass
        return Verdict(False, problems, sha.size, sha.hexdigest(), tally.events, tally.categories)
    if problems and problems[0].startswith("not valid JSON"):     # staged: the copy goes, no checksum
        return Verdict(False, problems, sha.size, "", tally.events, tally.categories)
    events, cats, size = tally.events, tally.categories, sha.size
    ts_min, ts_max, foreign_pids, steps = tally.ts_min, tally.ts_max, tally.foreign_pids, tally.steps

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
    collection = (base / 1e9 + tally.collection[0] / 1e6, base / 1e9 + tally.collection[1] / 1e6) \
        if isinstance(base, int) and tally.collection is not None else None
    empty = bool(problems) and not activity_cats and all(p.startswith(_EMPTY_ONLY) for p in problems)
    return Verdict(not problems, problems, size, sha.hexdigest(), events, cats, found_id, first, last,
                   min(steps) if steps else None, max(steps) if steps else None, tally.optimizer_steps,
                   collection, stored_size=sha.stored_size, empty=empty)


#: the only problems an empty trace of this very request has (its name, id and pid all checked out)
_EMPTY_ONLY = ("requested activity types absent", "no timed events")


def _add(problems: list[str], text: str) -> None:
    if len(problems) < MAX_PROBLEMS:
        problems.append(text)
