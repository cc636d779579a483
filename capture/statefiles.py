"""Load a JSON state file, or move it aside: the one rule for every component that persists state.

A component's own state file (the gateway's ledger, the agent's target facts) can be truncated by
a crash of an older version, filled with valid JSON of the wrong shape (`null`, `[]`, a hand
edit), or be unreadable. Start-up must not crash-loop on it and must not silently overwrite it:
the file is renamed to `<stem>.bad-<unix time>[-n]` next to where it was (nothing is deleted, a
person can look), one structured log line says why, and the caller starts without it.

Deliberately free of the exporter and of the trainer hook (which is stdlib-only and has its own
write rule), so any component may import it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

from gpulens.ground.logs import get_logger

from .wire import limits

__all__ = ["load_or_move_aside", "move_aside", "WRONG_SHAPE"]

T = TypeVar("T")
# what a parser raises for "valid JSON, wrong shape" (SchemaError is a ValueError)
WRONG_SHAPE = (ValueError, TypeError, KeyError, AttributeError)


def move_aside(path: Path, *, now: float | None = None) -> Path:
    """Rename `path` to a free `<stem>.bad-<time>[-n]` in the same folder; returns the new path."""
    stamp = int(now if now is not None else time.time())
    for n in range(1000):
        target = path.with_name(f"{path.stem}.bad-{stamp}{'' if n == 0 else f'-{n}'}")
        if not target.exists():
            os.replace(path, target)
            return target
    raise FileExistsError(f"no free name to move {path} aside")


def load_or_move_aside(path: Path, parse: Callable[[Any], T], *, component: str,
                       limit: limits.JsonLimit = limits.STATE_FILE, context: dict[str, Any] | None = None) -> T | None:
    """`parse(json.loads(file))`, or None when the file is absent or was moved aside.

    `parse` must raise one of WRONG_SHAPE for a document it does not accept; it is the place for
    every shape check (top-level type, nested types, ids matching the file's name).
    """
    log = get_logger(component)
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(limit.max_bytes + 1)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return _aside(log, path, f"unreadable: {exc}", context)
    try:
        doc = limits.loads(raw, limit)
    except limits.JsonLimitError as exc:
        return _aside(log, path, str(exc), context)
    except ValueError as exc:  # truncated, not UTF-8, not JSON
        return _aside(log, path, f"not JSON: {exc}", context)
    try:
        return parse(doc)
    except WRONG_SHAPE as exc:
        return _aside(log, path, f"wrong shape: {type(exc).__name__}: {exc}", context)


def _aside(log, path: Path, why: str, context: dict[str, Any] | None) -> None:
    try:
        moved: str = str(move_aside(path))
    except OSError as exc:
        moved = f"(could not move it: {exc})"
    log.error("state.moved_aside", path=str(path), moved_to=moved, error=why[:300], **(context or {}))
    return None
