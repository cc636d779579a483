"""Trigger backends behind one interface: "put this config in that process's pending slot".

- `dynolog`: stock dynolog's RPC. The trace id is dynolog's (it overrides any we send), so the
  agent learns it from the file.
- `builtin`: the agent's own IPC endpoint (`KinetoEndpoint`). The agent picks the trace id, so
  verification can check that the file answers *this* request.

Both return the same `PidOutcome`, read from the same result shape, and neither ever claims that
Kineto started: that is only known when the file appears. Requests always carry the worker's
Kineto job id (the per-pod SLURM_JOB_ID the hook set) and its explicit pid, which is what makes pid
37 of one pod distinct from pid 37 of another.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass
from typing import Protocol

from gpulens.ground.logs import get_logger

from ..dynolog import DynologClient, KinetoEndpoint, OnDemandResult, PidOutcome, TriggerFailed

__all__ = ["Trigger", "TriggerAnswer", "DynologTrigger", "BuiltinTrigger", "choose_trigger"]

_log = get_logger("agent")


@dataclass(frozen=True)
class TriggerAnswer:
    outcome: PidOutcome
    result: OnDemandResult
    trace_id: str | None  # None: whoever queued it chose the id (dynolog)


class Trigger(Protocol):
    name: str

    async def request(self, config: str, pid: int, job_id: int, *, trace_id: str | None = None,
                      moot_if: str | None = None) -> TriggerAnswer:
        """Raises TriggerFailed when the backend itself failed. `trace_id`, `moot_if`: for a config
        queued again after a restart, the id it had before (a backend that chooses ids keeps it) and
        the trace file whose presence makes it moot (a backend that sees Kineto's polls drops it then)."""

    async def lost(self) -> TriggerFailed | None:
        """Why the backend no longer answers (a cheap call, short timeout); None while it does."""

    def settle(self, trace_id: str | None) -> None:
        """The trace with `trace_id` landed or started: whatever the backend remembers of it as
        pending is over (builtin: Kineto's held config; dynolog: nothing to do)."""

    def retract(self, trace_id: str | None) -> bool:
        """Take back a config the trainer has not fetched; True only when it surely never will
        (builtin: the slot is ours; dynolog has no call for it)."""

    def holds_unstarted(self, trace_id: str | None) -> bool:
        """Does the backend know the config `trace_id` to be fetched and still unstarted? (False
        when it cannot know: dynolog never sees what Kineto does with a config.)"""


class DynologTrigger:
    name = "dynolog"

    def __init__(self, client: DynologClient, *, process_limit: int = 64, probe_timeout_s: float = 1.0):
        # A worker's own children inherit its job id and list it as an ancestor, so dynolog matches
        # them too; a generous limit keeps them from using up the worker's turn.
        self.client, self.process_limit = client, process_limit
        self.probe = client.with_timeout(min(probe_timeout_s, client.timeout_s))

    async def request(self, config: str, pid: int, job_id: int, *, trace_id: str | None = None,
                      moot_if: str | None = None) -> TriggerAnswer:
        # dynolog chooses the trace id itself and cannot be told to drop a config: both are ignored
        result = await self.client.set_kineto_ondemand_request(config, [pid], job_id, self.process_limit)
        extra = sorted(set(result.processes_matched) - {pid})
        if extra:
            _log.info("trigger.extra_matched", pid=pid, job=job_id, others=",".join(map(str, extra)))
        return TriggerAnswer(result.outcome_for(pid), result, None)

    def settle(self, trace_id: str | None) -> None:
        return None

    def holds_unstarted(self, trace_id: str | None) -> bool:
        return False

    def retract(self, trace_id: str | None) -> bool:
        return False

    async def lost(self) -> TriggerFailed | None:
        """getVersion: it reads nothing and changes nothing in dynolog (a pending config survives it)."""
        try:
            await self.probe.get_version()
        except TriggerFailed as exc:
            return exc
        return None


class BuiltinTrigger:
    name = "builtin"

    def __init__(self, endpoint: KinetoEndpoint):
        self.endpoint = endpoint

    async def request(self, config: str, pid: int, job_id: int, *, trace_id: str | None = None,
                      moot_if: str | None = None) -> TriggerAnswer:
        # Queued again after a restart, a config keeps its id: the endpoint answers Kineto before the
        # agent writes that it did, so Kineto may trace the earlier copy, and its file must verify.
        trace_id = trace_id or str(secrets.randbits(62))
        result = self.endpoint.trigger(config, [pid], job_id, trace_id=trace_id, moot_if=moot_if)
        outcome = result.outcome_for(pid)
        return TriggerAnswer(outcome, result, trace_id if outcome is PidOutcome.QUEUED else None)

    async def lost(self) -> TriggerFailed | None:
        return None  # the endpoint lives in this process: it cannot be gone while the agent runs

    def settle(self, trace_id: str | None) -> None:
        if trace_id is not None:
            self.endpoint.settle(trace_id)

    def holds_unstarted(self, trace_id: str | None) -> bool:
        return trace_id is not None and self.endpoint.holds_unstarted(trace_id)

    def retract(self, trace_id: str | None) -> bool:
        return trace_id is not None and self.endpoint.retract(trace_id)


async def choose_trigger(mode: str, dynolog_addr: str, *, probe_timeout_s: float = 1.5) -> str:
    """`auto` -> `dynolog` when a dynolog answers getVersion at `dynolog_addr`, else `builtin`."""
    if mode != "auto":
        return mode
    try:
        version = await asyncio.wait_for(DynologClient.from_addr(dynolog_addr, timeout_s=probe_timeout_s).get_version(),
                                         probe_timeout_s * 2)
    except (TriggerFailed, asyncio.TimeoutError, OSError, ValueError) as exc:
        _log.info("trigger.auto_builtin", dynolog_addr=dynolog_addr, why=str(exc))
        return "builtin"
    _log.info("trigger.auto_dynolog", dynolog_addr=dynolog_addr, version=version)
    return "dynolog"
