"""The node agent (`gpulens agent`): node-local capture facts.

It maps registered workers to host pids, triggers Kineto (through dynolog or its own IPC endpoint),
observes the trace files Kineto renames into place, verifies them in a worker pool, archives them,
and keeps one level-triggered status per (capture, target) on local disk for the coordinator to
pull. `AgentClient` is the coordinator's way in.

The client is imported on first use (PEP 562): the verifier's pool workers are fresh interpreters
(spawn) that import `verification` through this package, and the client's imports (aiohttp, the
models and their JSON Schemas) made each worker's first trace wait ~3 s on a quiet machine, many
more on a loaded one (a late trace not archived within 30 s, side by side with other lanes).
"""

from __future__ import annotations

from typing import Any

__all__ = ["AgentClient", "AgentError", "DispatchResult", "WorkerView"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import client
        return getattr(client, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
