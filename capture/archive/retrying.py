"""Uploads that survive a store being briefly down: bounded retries with backoff, then a clear end.

A node's trace must not be lost because S3 blipped, and must not be reported archived before the
store confirmed it. `put_file_retrying` retries only errors the store marked retryable (network,
5xx, throttling), backs off exponentially, stops at the attempt limit or the deadline, and then
raises one `ArchiveError` that says how often it tried and what failed last. The local file is
never touched here: deleting it is the caller's decision, after success.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .base import ArchiveError, ArchiveStore

__all__ = ["RetryPolicy", "put_file_retrying"]


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 8
    first_delay_s: float = 0.5
    max_delay_s: float = 15.0
    factor: float = 2.0

    def delay(self, attempt: int) -> float:
        """Pause after failed attempt number `attempt` (1-based)."""
        return min(self.max_delay_s, self.first_delay_s * self.factor ** (attempt - 1))


async def put_file_retrying(store: ArchiveStore, local: Path, key: str, *, policy: RetryPolicy = RetryPolicy(),
                            deadline: float | None = None,
                            on_retry: Callable[[int, ArchiveError, float], None] | None = None) -> str:
    """Upload `local` to `<store prefix>/<key>` (in a thread); returns the URI the store confirmed.

    `deadline` is unix seconds; no new attempt starts after it. `on_retry(attempt, error, delay)`
    is called before each pause (for logs and status details).
    """
    attempt = 0
    while True:
        attempt += 1
        try:
            return await asyncio.to_thread(store.put_file, Path(local), key)
        except ArchiveError as exc:
            last = exc
        pause = policy.delay(attempt)
        out_of_time = deadline is not None and time.time() + pause > deadline
        if not last.retryable or attempt >= policy.attempts or out_of_time:
            why = "not retryable" if not last.retryable else ("deadline reached" if out_of_time else "attempts exhausted")
            raise ArchiveError(f"archiving {local} failed after {attempt} attempt(s) ({why}): {last}", retryable=False) from last
        if on_retry is not None:
            on_retry(attempt, last, pause)
        await asyncio.sleep(pause)
