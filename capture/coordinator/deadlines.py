"""When a capture must be over: the window plus what the trigger path is observed to add.

Stock dynolog hands a config to the trainer at its next poll (up to 5 s), Kineto warms up for a
fixed 7 s, traces for the window, then writes the file (about 1 s for 2 s of CPU trace); the
agent then verifies and archives it (reference/dynolog-observed.md, "Timing"). The agent gets
a deadline after which it fails a target itself; the coordinator waits a little longer, so the
agent's own verdict (busy_timeout, trace_timeout, ...) reaches the manifest rather than a guess.
If captures are observed to start later than the nominal delay (a busy trainer, a slow poll),
later deadlines stretch to match.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

__all__ = ["DeadlinePolicy", "Deadlines", "DelayTracker"]


@dataclass(frozen=True)
class Deadlines:
    requested_at: float
    agent: float        # sent in each dispatch: the agent fails what is not archived by then
    coordinator: float  # after this, the coordinator stops waiting and converges
    quiet_until: float = 0.0  # no trace can exist before this: agents are polled less often until then


@dataclass(frozen=True)
class DeadlinePolicy:
    start_delay_s: float = 12.0     # trainer poll (<= 5 s) + Kineto warm-up (7 s)
    dispatch_s: float = 5.0         # fan-out and agent -> dynolog round trips
    write_s: float = 5.0            # Kineto writes the file
    write_per_window: float = 0.5   # ... and larger windows make larger files
    archive_s: float = 20.0         # verify + archive on the node
    report_s: float = 10.0          # agent deadline -> coordinator deadline (a few polls)
    max_start_delay_s: float = 120.0
    kineto_poll_s: float = 5.0      # the trainer polls for configs this often: traces start 0..5 s apart
    hang_evidence_s: float = 30.0   # issue 45: the hook's dump (a bounded 10 s wait) + py-spy's read (a bounded 10 s)

    def compute(self, requested_at: float, duration_ms: int, observed_start_delay_s: float | None = None, *,
                starts_at: float | None = None) -> Deadlines:
        """`starts_at`: the instant a wall-clock capture starts on every rank (the coordinator chose
        it): the trace ends by then + the window, whatever the poll and warm-up would have added."""
        window = duration_ms / 1000.0
        start = self.start_delay_s
        if observed_start_delay_s is not None:
            start = min(max(start, observed_start_delay_s * 1.25), max(self.max_start_delay_s, self.start_delay_s))
        agent = requested_at + self.dispatch_s + start + window + self.write_s + self.write_per_window * window + self.archive_s
        quiet = requested_at + max(0.0, self.start_delay_s - self.kineto_poll_s) + window
        if starts_at is not None:
            agent = max(agent, starts_at + window + self.write_s + self.write_per_window * window + self.archive_s)
            quiet = max(quiet, starts_at + window)
        return Deadlines(requested_at, agent, agent + self.report_s, quiet)

    def compute_hang(self, requested_at: float) -> Deadlines:
        """A hang capture has no Kineto in its path: each agent asks its ranks' hooks and reads their
        stacks at once, each with a bounded wait, then archives one small document a rank."""
        agent = requested_at + self.dispatch_s + self.hang_evidence_s + self.archive_s
        return Deadlines(requested_at, agent, agent + self.report_s, requested_at)


@dataclass
class DelayTracker:
    """The longest recently observed delay from dispatch to a trace on disk, less the window."""

    keep: int = 32
    _seen: deque = field(default_factory=deque)

    def observe(self, delay_s: float) -> None:
        if delay_s >= 0:
            self._seen.append(delay_s)
            while len(self._seen) > self.keep:
                self._seen.popleft()

    def estimate(self) -> float | None:
        return max(self._seen) if self._seen else None
