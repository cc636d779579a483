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

from gpulens.ground.logs import get_logger

from ..wire import limits
from ..statefiles import load_or_move_aside

__all__ = ["AlertEntry", "CaptureEntry", "Ledger"]

log = get_logger("gateway")
LEDGER_FILE = limits.JsonLimit("gateway ledger", 64 << 20)  # 7 days of alert episodes


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
    kind: str = "trace"           # issue 45: hang captures keep a cooldown of their own (cooldown_key)


@dataclass
class Ledger:
    path: Path | None = None
    retention_s: float = 7 * 24 * 3600
    alerts: dict[str, AlertEntry] = field(default_factory=dict)
    captures: dict[str, CaptureEntry] = field(default_factory=dict)
    last_start: dict[str, float] = field(default_factory=dict)

    @classmethod
    def open(cls, state_dir: Path | None, **kw: Any) -> "Ledger":
        """The persisted ledger; a truncated, wrong-shape or unreadable file is moved aside
        (gpulens.capture.statefiles) and the gateway starts with an empty one instead of crash-looping."""
        if state_dir is None:
            return cls(**kw)
        state_dir.mkdir(parents=True, exist_ok=True)
        ledger = cls(path=state_dir / "ledger.json", **kw)
        parsed = load_or_move_aside(ledger.path, _parse, component="gateway", limit=LEDGER_FILE)
        if parsed is not None:
            ledger.alerts, ledger.captures, ledger.last_start = parsed
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
            try:
                tmp.unlink()  # a full disk must not also leave a partial temp file behind
            except OSError:
                pass
            log.error("ledger.write_failed", path=str(self.path), error=str(exc))
            raise

    def started(self, entry: CaptureEntry) -> None:
        self.captures[entry.capture_id] = entry
        key = cooldown_key(entry.namespace, entry.job_id, entry.kind)
        self.last_start[key] = max(self.last_start.get(key, 0.0), entry.started_at)


def cooldown_key(namespace: str, job_id: str, kind: str = "trace") -> str:
    """What one cooldown covers: a job's traces, and apart from them its hang captures. A hang
    capture costs a stuck job nothing and a trace capture just before says nothing of the hang,
    so a stall after a traced slowdown is still captured; two hang captures are spaced alike."""
    return f"{namespace}/{job_id}" + ("" if kind == "trace" else f"#{kind}")


def _mapping(doc: dict, key: str) -> dict:
    value = doc.get(key, {})
    if not isinstance(value, dict):
        raise TypeError(f"{key!r} is {type(value).__name__}, not an object")
    return value


def _entry(kind, value: Any):
    if not isinstance(value, dict):
        raise TypeError(f"a {kind.__name__} is {type(value).__name__}, not an object")
    return kind(**value)


def _parse(doc: Any) -> tuple[dict[str, AlertEntry], dict[str, CaptureEntry], dict[str, float]]:
    """The ledger document's three maps; TypeError/ValueError for any other shape."""
    if not isinstance(doc, dict):
        raise TypeError(f"the ledger is {type(doc).__name__}, not an object")
    alerts = {str(k): _entry(AlertEntry, v) for k, v in _mapping(doc, "alerts").items()}
    captures = {str(k): _entry(CaptureEntry, v) for k, v in _mapping(doc, "captures").items()}
    last_start = {str(k): float(v) for k, v in _mapping(doc, "last_start").items()}
    for a in alerts.values():
        if not isinstance(a.recorded_at, (int, float)) or not isinstance(a.outcome, str):
            raise TypeError(f"alert {a.key!r} has a recorded_at or outcome of the wrong type")
    for c in captures.values():
        if not isinstance(c.started_at, (int, float)):
            raise TypeError(f"capture {c.capture_id!r} has a started_at of the wrong type")
    return alerts, captures, last_start
