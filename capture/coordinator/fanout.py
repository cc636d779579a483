"""Dispatch to node agents and pull their statuses, one independent worker per agent.

Each agent gets its own task, its own connection budget and its own back-off, so a node that is
slow or silently drops packets delays only its own targets; at the deadline those end as
`agent_unreachable` while every other agent's targets have long been archived.

Dispatch is at-least-once, keyed by (capture id, target id): a target is re-sent with back-off
until its agent accepts it, and again whenever the agent's level-triggered answer no longer lists
a target it accepted (an agent that lost its state must not silently lose the target).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from gpulens.capture.models import Dispatch, FailureReason, TargetState, TargetStatus
from gpulens.ground.logs import get_logger

from .agents import AgentFleet, AgentRefused, AgentUnavailable
from .deadlines import DelayTracker
from .progress import CaptureRecord, TargetProgress

__all__ = ["FanoutSettings", "AgentWorker", "dispatch_for", "overdue_failure"]

log = get_logger("coordinator")


@dataclass(frozen=True)
class FanoutSettings:
    poll_interval_s: float = 1.0
    quiet_poll_interval_s: float = 3.0   # before any trace can exist (each poll costs ~0.5 ms CPU per target)
    max_poll_interval_s: float = 5.0     # while an agent does not answer
    dispatch_concurrency: int = 8        # per agent
    backoff_initial_s: float = 0.25
    backoff_max_s: float = 5.0
    start_lead_s: float = 12.0           # iteration captures start this far ahead of the furthest rank (dispatch + Kineto's 5 s poll)
    wall_start_lead_s: float = 16.0      # wall-clock captures start this long after dispatch on every rank (issue 47):
                                         # the agent's 12 s (poll, tick, warm-up, slack) + 4 s to reach it


#: Kineto starts an iteration trace at the next multiple of the round-up after the step count it has
#: when its poll (every 5 s, each rank at its own phase) fetches the config; every rank shares one
#: round-up, so they start on the same iteration unless a multiple falls between their counts. 100
#: keeps that rare for jobs slower than ~5 steps/s; faster jobs should ask for a larger one.
DEFAULT_ROUNDUP = 100


def dispatch_for(record: CaptureRecord, p: TargetProgress) -> Dispatch:
    r, t = record.request, p.target
    roundup = (r.iteration_roundup or DEFAULT_ROUNDUP) if r.iterations else None
    return Dispatch(job_id=record.job_id, attempt=record.attempt, rank=t.rank, duration_ms=r.duration_ms,
                    activities=tuple(r.activities), deadline=record.agent_deadline, archive_prefix=record.archive_prefix,
                    local_rank=t.local_rank, pod=t.pod or None, pod_uid=t.pod_uid or None,
                    requested_at=record.requested_at, options=r.options, iterations=r.iterations,
                    iteration_roundup=roundup, start_iteration=record.start_iteration if r.iterations else None,
                    start_time_ms=None if r.iterations else record.start_time_ms,
                    budget=record.budget.budget if record.budget else None, worker_rank=t.worker_rank, kind=r.kind)


_OVERDUE = {
    TargetState.NOT_MATCHED: (FailureReason.NOT_MATCHED, "dynolog never matched the process before the deadline"),
    TargetState.WAITING_FOR_SLOT: (FailureReason.BUSY_TIMEOUT, "the process's config slot stayed busy until the deadline"),
    TargetState.TRACE_OBSERVED: (FailureReason.VERIFICATION_FAILED, "the trace was observed but not verified before the deadline"),
    TargetState.VERIFIED: (FailureReason.ARCHIVE_FAILED, "the trace was verified but not archived before the deadline"),
}


def overdue_failure(p: TargetProgress, agent_answering: bool, last_error: str | None) -> tuple[FailureReason, str]:
    """Why a target that is not terminal at the coordinator's deadline failed; claims only what was seen."""
    if not p.accepted:
        return FailureReason.AGENT_UNREACHABLE, f"the agent never accepted the dispatch ({p.dispatch_attempts} tries): {last_error or 'no answer'}"
    if not agent_answering:
        return FailureReason.AGENT_UNREACHABLE, f"the agent stopped answering (last state {p.state.value}): {last_error or 'no answer'}"
    reason, detail = _OVERDUE.get(p.state, (FailureReason.TRACE_TIMEOUT, f"no trace before the deadline (last state {p.state.value})"))
    return reason, detail


class AgentWorker:
    """Everything the coordinator does with one agent for one capture."""

    def __init__(self, record: CaptureRecord, agent_url: str, targets: list[TargetProgress], client: AgentFleet,
                 settings: FanoutSettings, delays: DelayTracker | None = None):
        self.record, self.url, self.targets = record, agent_url, {p.target.target_id: p for p in targets}
        self.client, self.settings, self.delays = client, settings, delays
        self.answering = False
        self.last_error: str | None = None
        self._sem = asyncio.Semaphore(settings.dispatch_concurrency)
        self._dispatching: dict[str, asyncio.Task] = {}
        self.log = log.bind(capture_id=record.capture_id, agent=agent_url)

    def _open(self) -> list[TargetProgress]:
        return [p for p in self.targets.values() if not p.terminal]

    def _apply(self, status: TargetStatus) -> None:
        p = self.targets.get(status.target_id)
        if p is None:
            return
        before = p.state
        if self.record.update(status.target_id, status.state, status.reason, status.detail, status.artifact):
            self.log.info("target.state", target_id=status.target_id, state=status.state.value,
                          reason=status.reason.value if status.reason else None)
        if (self.delays is not None and not self.record.request.is_hang   # no Kineto in a hang capture's path
                and before != TargetState.TRACE_OBSERVED and p.dispatched_at
                and status.state in (TargetState.TRACE_OBSERVED, TargetState.VERIFIED, TargetState.ARCHIVED)):
            self.delays.observe(time.time() - p.dispatched_at - self.record.request.duration_ms / 1000.0)

    async def _dispatch(self, p: TargetProgress) -> None:
        delay = self.settings.backoff_initial_s
        body = dispatch_for(self.record, p)
        while not p.terminal and time.time() < self.record.agent_deadline:
            async with self._sem:
                p.dispatch_attempts += 1
                try:
                    status = await self.client.put_target(self.url, self.record.capture_id, p.target.target_id, body)
                except AgentRefused as exc:
                    self.log.error("dispatch.refused", target_id=p.target.target_id, error=str(exc))
                    self.record.update(p.target.target_id, TargetState.FAILED, FailureReason.INTERNAL_ERROR,
                                       f"the agent refused the dispatch: {exc}")
                    return
                except AgentUnavailable as exc:
                    self.last_error = str(exc)
                    self.log.warning("dispatch.retry", target_id=p.target.target_id, attempt=p.dispatch_attempts,
                                     error=str(exc))
                else:
                    p.accepted, p.accepted_at = True, time.time()
                    p.dispatched_at = p.dispatched_at or p.accepted_at
                    self.answering, self.last_error = True, None
                    self._apply(status)
                    return
            await asyncio.sleep(min(delay, max(0.0, self.record.agent_deadline - time.time())))
            delay = min(delay * 2, self.settings.backoff_max_s)

    def _ensure_dispatch(self, p: TargetProgress) -> None:
        task = self._dispatching.get(p.target.target_id)
        if task is None or task.done():
            self._dispatching[p.target.target_id] = asyncio.create_task(self._dispatch(p))

    async def _poll(self) -> None:
        asked_at = time.time()
        try:
            statuses = await self.client.get_capture(self.url, self.record.capture_id)
        except AgentRefused as exc:
            self.answering, self.last_error = True, str(exc)
            self.log.error("poll.refused", error=str(exc))
            return
        except AgentUnavailable as exc:
            if self.answering:
                self.log.warning("agent.unreachable", error=str(exc))
            self.answering, self.last_error = False, str(exc)
            return
        self.answering, self.last_error = True, None
        seen = set()
        for status in statuses or []:
            seen.add(status.target_id)
            self._apply(status)
        for p in self._open():
            if (p.accepted and p.accepted_at < asked_at and p.target.target_id not in seen
                    and time.time() < self.record.agent_deadline):
                # accepted before, unknown now: the agent lost it; send it again (a repeat is a no-op)
                self.log.warning("dispatch.repeat", target_id=p.target.target_id)
                p.accepted = False
                self._ensure_dispatch(p)

    async def run(self, cancelled: asyncio.Event) -> None:
        """Dispatch, then pull statuses until every target of this agent is terminal or the deadline passes."""
        for p in self._open():
            self._ensure_dispatch(p)
        interval = self.settings.poll_interval_s
        told_cancel = False
        try:
            while self._open() and time.time() < self.record.deadline:
                if cancelled.is_set() and not told_cancel:
                    told_cancel = await self._cancel()
                    if not self._open():
                        break
                sleep = min(interval, max(0.0, self.record.deadline - time.time()))
                if cancelled.is_set():
                    await asyncio.sleep(sleep)
                else:
                    try:  # wake early on cancel
                        await asyncio.wait_for(cancelled.wait(), sleep)
                        continue
                    except asyncio.TimeoutError:
                        pass
                await self._poll()
                interval = self._next_interval(interval)
        finally:
            for task in self._dispatching.values():
                task.cancel()
            await asyncio.gather(*self._dispatching.values(), return_exceptions=True)
        for p in self._open():
            reason, detail = overdue_failure(p, self.answering, self.last_error)
            self.record.update(p.target.target_id, TargetState.FAILED, reason, detail)
            self.log.warning("target.overdue", target_id=p.target.target_id, reason=reason.value)

    def _next_interval(self, interval: float) -> float:
        if not self.answering:
            return min(interval * 2, self.settings.max_poll_interval_s)
        if time.time() < self.record.quiet_until:   # Kineto is still warming up: only failures can show
            return min(self.settings.quiet_poll_interval_s, max(self.settings.poll_interval_s,
                                                                self.record.quiet_until - time.time()))
        return self.settings.poll_interval_s

    async def _cancel(self) -> bool:
        """Logical cancel: targets never accepted end now; the agent fails what it has not queued."""
        for p in self._open():
            if not p.accepted:
                task = self._dispatching.get(p.target.target_id)
                if task:
                    task.cancel()
                self.record.update(p.target.target_id, TargetState.FAILED, FailureReason.CANCELLED,
                                   "cancelled before the agent accepted it")
        if not any(p.accepted for p in self._open()):
            return True
        try:
            await self.client.cancel(self.url, self.record.capture_id)
            return True
        except (AgentUnavailable, AgentRefused) as exc:
            self.log.warning("cancel.retry", error=str(exc))
            return False
