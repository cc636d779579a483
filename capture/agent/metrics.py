"""The node agent's own metrics (served on `/metrics`): how its targets end, how dynolog answers,
how quickly trace files are seen, verified and archived.

One `AgentMetrics` per running agent, each with its own registry (capture/wire/metrics_http.py). Labels are bounded: target
outcomes by failure reason (a fixed enum), RPCs by dynolog method; never a capture or target id.
Every (outcome, reason) pair starts at 0, so `rate()` sees the first failure. The names are listed
in docs/metrics.md, the capture plane's catalogue.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import Counter, Histogram

from ..wire.metrics_http import OwnMetrics
from ..models import FailureReason, TargetState, TargetStatus

__all__ = ["AgentMetrics"]

# dynolog answers in ms; a stuck one hits the client's 3 s step timeout
_RPC_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# the agent's watcher sees a renamed file within its poll (~0.1-1 s); minutes mean it is starved
_OBSERVE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class AgentMetrics(OwnMetrics):
    def __post_init__(self) -> None:
        r = self.registry
        self.targets = Counter("gpulens_agent_targets", "Targets this agent ended, by outcome (archived or failed) and "
                               "failure reason.", ["outcome", "reason"], registry=r)
        self.dynolog_rpc = Histogram("gpulens_agent_dynolog_rpc_duration_seconds", "Duration of dynolog RPC calls, "
                                     "answered or not, by method.", ["method"], buckets=_RPC_BUCKETS, registry=r)
        self.dynolog_errors = Counter("gpulens_agent_dynolog_rpc_errors", "dynolog RPC calls that failed, by method "
                                      "and reason (dynolog_unreachable; dynolog_refused: it answered a failure "
                                      "document; dynolog_error: no usable answer).", ["method", "reason"],
                                      registry=r)
        self.observation_delay = Histogram("gpulens_agent_observation_delay_seconds", "From a trace file's last "
                                           "write (Kineto renames it into place right after) to the agent seeing it.",
                                           buckets=_OBSERVE_BUCKETS, registry=r)
        self.verified_bytes = Counter("gpulens_agent_verified_bytes", "Trace bytes verified (passed or not).",
                                      registry=r)
        self.verification_seconds = Counter("gpulens_agent_verification_seconds", "Wall-clock seconds spent "
                                            "verifying traces; verified_bytes / this is the throughput.", registry=r)
        self.archive_retries = Counter("gpulens_agent_archive_retries", "Archive uploads that failed and were "
                                       "retried.", registry=r)
        self.late_traces = Counter("gpulens_agent_late_traces", "Traces that landed after their target had ended "
                                   "(a deadline outrun, a refusal misjudged) and were archived as <target>.late.json.",
                                   registry=r)
        self.targets.labels("archived", "")
        for reason in FailureReason:
            self.targets.labels("failed", reason.value)

    def target_ended(self, status: TargetStatus) -> None:
        if status.state is TargetState.ARCHIVED:
            self.targets.labels("archived", "").inc()
        elif status.state is TargetState.FAILED and status.reason is not None:
            self.targets.labels("failed", status.reason.value).inc()

    def dynolog_call(self, method: str, seconds: float, error: str | None) -> None:
        """DynologClient's `on_call` hook."""
        self.dynolog_rpc.labels(method).observe(seconds)
        if error is not None:
            self.dynolog_errors.labels(method, error).inc()

    def verified(self, size: int, seconds: float) -> None:
        self.verified_bytes.inc(max(0, size))
        self.verification_seconds.inc(max(0.0, seconds))
