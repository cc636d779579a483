"""The coordinator's view of node agents, over the agent's own client (`gpulens.capture.agent.client`).

One agent client per call (cheap: they share this session), so a rotated token file is used at
once. Errors are split the way the coordinator acts on them: `AgentUnavailable` (network,
timeout, 5xx, an answer that breaks the contract) is worth retrying; `AgentRefused` (4xx) is not.
"""

from __future__ import annotations

from typing import Any

import aiohttp

from gpulens.capture.agent.client import AgentClient as _NodeAgent
from gpulens.capture.agent.client import AgentError as _NodeAgentError
from gpulens.capture.models import Dispatch, TargetStatus

from ..wire.auth import SecretFile

__all__ = ["AgentFleet", "AgentFailure", "AgentUnavailable", "AgentRefused"]


class AgentFailure(Exception):
    """A call to one agent failed, as the coordinator acts on it (the agent's own client raises
    `gpulens.capture.agent.client.AgentError`, translated here)."""

    def __init__(self, url: str, message: str, status: int | None = None):
        super().__init__(message if url in message else f"{url}: {message}")
        self.url, self.status = url, status


class AgentUnavailable(AgentFailure):
    """The agent did not answer usefully; trying again may help."""


class AgentRefused(AgentFailure):
    """The agent answered 4xx: the request itself is wrong, a retry would be refused again."""


def _translate(url: str, exc: _NodeAgentError) -> AgentFailure:
    cls = AgentRefused if exc.kind in ("unauthorized", "bad_request", "not_found") else AgentUnavailable
    return cls(url, str(exc), exc.status)


class AgentFleet:
    """Every agent of a job through one session: the agent's base URL per call, the token read per call."""

    def __init__(self, session: aiohttp.ClientSession, token: SecretFile | None, *, timeout_s: float = 5.0):
        self._session, self._token, self._timeout_s = session, token, timeout_s

    def _agent(self, base: str) -> _NodeAgent:
        return _NodeAgent(base, self._token.read() if self._token else "", session=self._session,
                          timeout_s=self._timeout_s)

    async def put_target(self, base: str, capture_id: str, target_id: str, dispatch: Dispatch) -> TargetStatus:
        try:
            result = await self._agent(base).dispatch(capture_id, target_id, dispatch)
        except _NodeAgentError as exc:
            raise _translate(base, exc) from exc
        if result.status.target_id != target_id:
            raise AgentUnavailable(base, f"answered for target {result.status.target_id!r}, not {target_id!r}")
        return result.status

    async def get_capture(self, base: str, capture_id: str) -> list[TargetStatus] | None:
        """The agent's statuses for this capture; None when it never saw the capture (404)."""
        try:
            return await self._agent(base).status(capture_id)
        except _NodeAgentError as exc:
            raise _translate(base, exc) from exc

    async def cancel(self, base: str, capture_id: str) -> None:
        try:
            await self._agent(base).cancel(capture_id)
        except _NodeAgentError as exc:
            raise _translate(base, exc) from exc

    async def workers(self, base: str) -> list[dict[str, Any]]:
        """Live registration records (plus `alive`, `host_pid`) the agent holds."""
        try:
            views = await self._agent(base).workers()
        except _NodeAgentError as exc:
            raise _translate(base, exc) from exc
        return [dict(v.record.to_dict(), host_pid=v.host_pid, alive=v.alive,
                     steps=v.steps.to_dict() if v.steps is not None else None) for v in views]
