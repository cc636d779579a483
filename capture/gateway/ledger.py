"""The gateway's memory: which alert episodes it has handled, which captures it started where,
and when each job last got one (the cooldown). Persisted to `<state dir>/ledger.json` after every
change (atomic replace), so a restarted gateway still treats Alertmanager's repeats as repeats.

An episode whose forward has not been confirmed stays `forwarding` with its pre-assigned capture
id: the retry sends the same id, and the coordinator answers "already started" instead of
starting a second capture.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpulens.logs import get_logger

__all__ = ["AlertEntry", "CaptureEntry", "Ledger"]

log = get_logger("gateway")


@dataclass
class AlertEntry:
    key: str
    fingerprint: str
    starts_at: str
    namespace: str
    job_id: str
    outcome: str                  # forwarding | started | cooldown | busy | rejected
    capture_id: str | None = None
    detail: str | None = None
    recorded_at: float = field(default_factory=time.time)
    resolved_at: str | None = None


@dataclass
class CaptureEntry:
    capture_id: str
    namespace: str
    job_id: str
    coordinator_url: str
    started_at: float
    reason: dict[str, Any] = field(default_factory=dict)


@dataclass
class Ledger:
    path: Path | None = None
    retention_s: float = 7 * 24 * 3600
    alerts: dict[str, AlertEntry] = field(default_factory=dict)
    captures: dict[str, CaptureEntry] = field(default_factory=dict)
    last_start: dict[str, float] = field(default_factory=dict)

    @classmethod
    def open(cls, state_dir: Path | None, **kw: Any) -> "Ledger":
        if state_dir is None:
            return cls(**kw)
        state_dir.mkdir(parents=True, exist_ok=True)
        ledger = cls(path=state_dir / "ledger.json", **kw)
        try:
            doc = json.loads(ledger.path.read_text())
            ledger.alerts = {k: AlertEntry(**v) for k, v in doc.get("alerts", {}).items()}
            ledger.captures = {k: CaptureEntry(**v) for k, v in doc.get("captures", {}).items()}
            ledger.last_start = {k: float(v) for k, v in doc.get("last_start", {}).items()}
        except FileNotFoundError:
            pass
        except (OSError, ValueError, TypeError) as exc:
            # keep the unreadable file for a person; start empty rather than not at all
            log.error("ledger.unreadable", path=str(ledger.path), error=str(exc))
            os.replace(ledger.path, ledger.path.with_suffix(f".bad-{int(time.time())}"))
        ledger.prune()
        return ledger

    def prune(self, now: float | None = None) -> None:
        cutoff = (now or time.time()) - self.retention_s
        self.alerts = {k: v for k, v in self.alerts.items() if v.recorded_at >= cutoff or v.outcome == "forwarding"}
        self.captures = {k: v for k, v in self.captures.items() if v.started_at >= cutoff}
        self.last_start = {k: v for k, v in self.last_start.items() if v >= cutoff}

    def save(self) -> None:
        if self.path is None:
            return
        doc = {"alerts": {k: asdict(v) for k, v in self.alerts.items()},
               "captures": {k: asdict(v) for k, v in self.captures.items()},
               "last_start": self.last_start}
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        try:
            with open(tmp, "w") as f:
                json.dump(doc, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as exc:
            log.error("ledger.write_failed", path=str(self.path), error=str(exc))
            raise

    def started(self, entry: CaptureEntry) -> None:
        self.captures[entry.capture_id] = entry
        key = f"{entry.namespace}/{entry.job_id}"
        self.last_start[key] = max(self.last_start.get(key, 0.0), entry.started_at)
