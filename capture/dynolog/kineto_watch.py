"""What Kineto did with a config it fetched, read from its own polls (builtin endpoint only).

Kineto never answers a config: it refuses one only in its own log (dynolog-kineto-protocol.md 3.4,
4.5). But every poll says whether its activity profiler can take a config: bit 2 of the `req`
type is set exactly when it is idle (`ConfigLoader::readOnDemandConfigFromDaemon` ->
`canAcceptConfig` = `!isActive()`, and `isAsyncActive` is any run-loop state but WaitForRequest;
kineto AsyncActivityProfilerHandler.h). torch 2.13 sends 3 when idle and 1 while tracing
(measured). So after a fetch:

- a busy poll means Kineto started the config (warm-up, collection or writing: `started`);
- an idle poll after a busy one means that trace is over (`finished`: the file must exist now,
  Kineto renames it into place before it goes idle);
- a time-based config must be activated with >= 5 s of warm-up left before its start, or Kineto
  cancels it ("insufficient time for warmup", "start timestamp is in the past", or a config it
  could not parse). With `PROFILE_START_TIME=0` the start is parse time + 7 s, so activation is due
  within 2 s of the fetch; with the explicit start the coordinator chooses (issue 47) it is due by
  that start - 5 s. Activation itself (PyTorch's profiler start, the Python tracer with stacks)
  can take seconds on a starved machine before the state turns busy, so the verdict waits for an
  idle poll 6 s or more past that due time (`grace_s` = 8 s after the fetch for a start of 0) with
  no busy one between: by then a trace that was activated is still busy (its warm-up runs until
  the start) or already written, which the pipeline checks before it fails the target (`refused`,
  cause `not_started`). With a 5 s poll that is the second poll past the due time;
- while a fetched iteration-based config waits unstarted in Kineto for its start iteration (its
  polls stay idle), Kineto ignores every further config: "Ignored request - another profile
  request is pending." (measured with torch 2.13). A config fetched then is `refused` with cause
  `another_pending`, naming the one Kineto holds.

An iteration-based config that waits idle is never called refused: it may start at its iteration.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["KinetoOutcome", "KinetoWatch", "is_iteration_config", "start_time_of", "REFUSAL_GRACE_S"]

REFUSAL_GRACE_S = 8.0     # > Kineto's 2 s activation window + slow activation, past its 7 s warm-up start
WARMUP_S = 5.0            # Kineto's ACTIVITIES_WARMUP_PERIOD_SECS default: a start is activated this long before
MAX_HELD = 8              # fetched configs remembered per process (iteration ones may wait long)


def _values(config: str) -> dict[str, str]:
    values: dict[str, str] = {}
    for line in config.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            values[key.strip()] = value.strip()
    return values


def start_time_of(config: str) -> float | None:
    """A time-based config's explicit PROFILE_START_TIME in unix seconds (None: 0, absent or unreadable)."""
    try:
        ms = int(_values(config).get("PROFILE_START_TIME", "0"))
    except ValueError:
        return None
    return ms / 1000.0 if ms > 0 else None


def is_iteration_config(config: str) -> bool:
    """Kineto's rule (4.4): iteration-based when PROFILE_START_ITERATION >= 0 and ACTIVITIES_ITERATIONS > 0."""
    values = _values(config)
    try:
        return int(values.get("PROFILE_START_ITERATION", "-1")) >= 0 and int(values.get("ACTIVITIES_ITERATIONS", "0")) > 0
    except ValueError:
        return False


@dataclass(frozen=True)
class KinetoOutcome:
    """One thing Kineto's polls revealed about a fetched config (`kind`: started, finished, refused)."""

    kind: str
    job_id: int
    pid: int
    trace_id: str | None
    fetched_at: float            # wall clock
    at: float                    # wall clock of the poll that told
    cause: str | None = None     # refused: not_started | another_pending
    held_trace_id: str | None = None   # another_pending: the config Kineto still holds
    start_at: float | None = None      # the config's explicit start (wall clock), if it had one

    def describe(self) -> str:
        when = _hms(self.fetched_at)
        if self.cause == "another_pending":
            return (f"Kineto in pid {self.pid} fetched the config at {when} but ignored it: it still held an earlier "
                    f"config it had not started (trace id {self.held_trace_id}; an iteration-aligned capture waits for "
                    "its start iteration), and while one is pending Kineto ignores new ones (it logs 'Ignored request "
                    "- another profile request is pending.' only with KINETO_LOG_LEVEL=2 or lower)")
        if self.cause == "not_started" and self.start_at is not None:
            return (f"Kineto in pid {self.pid} fetched the config at {when} and did not run it: it was still idle "
                    f"(accepting configs) at {_hms(self.at)}, past the trace's start at {_hms(self.start_at)}. That is "
                    "Kineto's warm-up refusal ('Not starting tracing - insufficient time for warmup' or 'start timestamp "
                    "is in the past' in the trainer's log: its 1 s profiler tick came late, on a loaded machine or a "
                    "stopped process), or a config it could not parse; a torch.profiler session in the trainer also "
                    "cancels on-demand traces. The rank is free for the next capture")
        if self.cause == "not_started":
            return (f"Kineto in pid {self.pid} fetched the config at {when} and dropped it: it was still idle (accepting "
                    f"configs) at {_hms(self.at)}, long past the 2 s in which a trace must start its warm-up. Its log says "
                    "why: Kineto's warm-up refusal ('insufficient time for warmup' or 'start timestamp is in the past': "
                    "its 1 s profiler tick came late, on a loaded machine or a stopped process), or 'Failed to parse "
                    "config'; a torch.profiler session in the trainer also cancels on-demand traces. The rank is free "
                    "for the next capture")
        if self.kind == "started":
            return f"Kineto in pid {self.pid} started the trace (warm-up) by {_hms(self.at)}"
        return f"Kineto in pid {self.pid} finished tracing by {_hms(self.at)}"


@dataclass
class _Held:
    trace_id: str | None
    iterations: bool
    fetched_mono: float
    fetched_at: float
    started: bool = False
    start_at: float | None = None     # explicit PROFILE_START_TIME (wall clock)


@dataclass
class KinetoWatch:
    """Per process (the endpoint's key), the configs it fetched and what its polls say since."""

    emit: Callable[[KinetoOutcome], None]
    grace_s: float = REFUSAL_GRACE_S
    clock: Callable[[], float] = time.monotonic
    _held: dict[object, list[_Held]] = field(default_factory=dict)

    def on_poll(self, key: object, job_id: int, pid: int, accepting: bool) -> None:
        """Call for every poll, before a config is handed over on it."""
        held = self._held.get(key)
        if not held:
            return
        now, wall = self.clock(), time.time()
        if not accepting:  # busy: Kineto runs the config it scheduled first
            if not any(h.started for h in held):
                held[0].started = True
                self._emit("started", job_id, pid, held[0], wall)
            return
        keep: list[_Held] = []
        for h in held:
            if h.started:
                self._emit("finished", job_id, pid, h, wall)
            elif not h.iterations and self._past_due(h, now, wall):
                self._emit("refused", job_id, pid, h, wall, cause="not_started")
            else:
                keep.append(h)
        if keep:
            self._held[key] = keep[-MAX_HELD:]
        else:
            self._held.pop(key, None)

    def on_fetch(self, key: object, job_id: int, pid: int, trace_id: str | None, config: str) -> None:
        """Call when a config was handed over on a poll (after `on_poll` for that poll)."""
        now, wall = self.clock(), time.time()
        h = _Held(trace_id, is_iteration_config(config), now, wall, start_at=start_time_of(config))
        waiting = [k for k in self._held.get(key, []) if not k.started and k.iterations]
        if waiting:
            self._emit("refused", job_id, pid, h, wall, cause="another_pending", held=waiting[0].trace_id)
            return
        self._held.setdefault(key, []).append(h)

    def _past_due(self, h: _Held, now: float, wall: float) -> bool:
        """Idle this long after its activation was due, a time-based config was not run: `grace_s`
        after the fetch for Kineto's own start (activation due within 2 s), and as long past the
        explicit start less its warm-up (in the watch's clock, from the fetch's two readings)."""
        if h.start_at is None:
            return now - h.fetched_mono >= self.grace_s
        activate_by = h.fetched_mono + (h.start_at - h.fetched_at) - WARMUP_S
        return now - activate_by >= self.grace_s - 2.0

    def unfetch(self, key: object, trace_id: str | None) -> None:
        """The handover of `trace_id` on `key`'s last poll was taken back (its answer was never sent)."""
        held = [h for h in self._held.get(key, []) if not (h.trace_id == trace_id and not h.started)]
        if held:
            self._held[key] = held
        else:
            self._held.pop(key, None)

    def forget(self, key: object) -> None:
        self._held.pop(key, None)

    def settle(self, trace_id: str) -> bool:
        """A fact from outside the polls ended the config with `trace_id`: its trace landed (or its
        `.tmp` appeared, or the rank stepped past its start iteration). An iteration trace that
        starts and ends between two polls (5 s apart; a few fast steps) is never seen busy, so
        without this it would be held "unstarted" for ever and every later config called
        refused. Returns whether it was held."""
        found = False
        for key in list(self._held):
            keep = [h for h in self._held[key] if h.trace_id != trace_id]
            found = found or len(keep) != len(self._held[key])
            if keep:
                self._held[key] = keep
            else:
                del self._held[key]
        return found

    def holds_unstarted(self, trace_id: str) -> bool:
        """Is the config with `trace_id` still held by its Kineto, fetched and never seen started?"""
        return any(h.trace_id == trace_id and not h.started for held in self._held.values() for h in held)

    def _emit(self, kind: str, job_id: int, pid: int, h: _Held, wall: float, *, cause: str | None = None,
              held: str | None = None) -> None:
        self.emit(KinetoOutcome(kind, job_id, pid, h.trace_id, h.fetched_at, wall, cause, held, h.start_at))


def _hms(t: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(t)) + "Z"
