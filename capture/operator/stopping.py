"""Waiting on the operator's stop event without a helper task, so kopf's shutdown cannot cancel it.

When kopf stops (`kopf.operator`, `run_tasks`), it cancels every task of the event loop that did
not exist when it started, assuming they are its own. `asyncio.wait_for(stop.wait(), t)` starts a
new task for `stop.wait()` on every call, so a loop that began before kopf (the certificate
reloader, the resync, the Lease renewal) had its current wait cancelled by kopf's shutdown, and the
`CancelledError` came out of it: the operator exited 1 with a traceback on a plain SIGTERM,
whenever it had run past one interval (seen under load in tests/operator/test_command.py).
`asyncio.timeout` waits inside the caller's own task instead.
"""

from __future__ import annotations

import asyncio

__all__ = ["stopped_within"]


async def stopped_within(stop: asyncio.Event, seconds: float) -> bool:
    """True as soon as `stop` is set, False once `seconds` passed without it."""
    if stop.is_set():
        return True
    try:
        async with asyncio.timeout(seconds):
            await stop.wait()
    except TimeoutError:
        return False
    return True
