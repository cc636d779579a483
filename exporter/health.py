"""Per-source health: up or not, a state word, a human reason, and an error count.

Every source reports here instead of raising into the scrape, so one broken source (a malformed
dcgm-exporter page, NVML gone) leaves the others' metrics intact and says why in
`gpulens_exporter_source_up` / `_source_info` / `_source_errors_total`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

__all__ = ["SourceHealth", "OK", "WAITING", "DISABLED", "FAILING"]

OK, WAITING, DISABLED, FAILING = "ok", "waiting", "disabled", "failing"


@dataclass
class _State:
    state: str
    reason: str
    errors: int = 0


class SourceHealth:
    def __init__(self, name: str, state: str = WAITING, reason: str = "starting"):
        self.name = name
        self._lock = threading.Lock()
        self._s = _State(state, reason)

    def ok(self, reason: str = "") -> None:
        with self._lock:
            self._s.state, self._s.reason = OK, reason

    def waiting(self, reason: str) -> None:
        with self._lock:
            self._s.state, self._s.reason = WAITING, reason

    def disabled(self, reason: str) -> None:
        with self._lock:
            self._s.state, self._s.reason = DISABLED, reason

    def failing(self, reason: str, count: bool = True) -> None:
        with self._lock:
            self._s.state, self._s.reason = FAILING, reason
            if count:
                self._s.errors += 1

    def error(self, n: int = 1) -> None:
        """Count an error without changing the state (e.g. one bad registration file)."""
        with self._lock:
            self._s.errors += n

    def view(self) -> tuple[str, str, int]:
        with self._lock:
            return self._s.state, self._s.reason, self._s.errors
