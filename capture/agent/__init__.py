"""The node agent (`gpulens agent`): node-local capture facts.

It maps registered workers to host pids, triggers Kineto (through dynolog or its own IPC endpoint),
observes the trace files Kineto renames into place, verifies them in a worker pool, archives them,
and keeps one level-triggered status per (capture, target) on local disk for the coordinator to
pull. `AgentClient` is the coordinator's way in.
"""

from .client import AgentClient, AgentError, DispatchResult, WorkerView

__all__ = ["AgentClient", "AgentError", "DispatchResult", "WorkerView"]
