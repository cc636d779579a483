"""Structured logging shared by every gpulens process: one logfmt line per event.

    ts=2026-11-29T07:40:01.123Z level=info component=agent event=target.queued capture_id=c-... target_id=rank-0

Call sites name the event and pass ids as fields, so a capture can be followed across processes
with one grep for its capture_id.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

__all__ = ["EventLogger", "get_logger", "setup_logging", "format_fields"]


def _quote(value: Any) -> str:
    text = str(value)
    if text == "" or any(c in text for c in ' ="\n\t'):
        text = '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return text


def format_fields(fields: dict[str, Any]) -> str:
    return " ".join(f"{k}={_quote(v)}" for k, v in fields.items() if v is not None)


class _LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        fields = {"ts": ts, "level": record.levelname.lower(), "component": record.name.removeprefix("gpulens.")}
        fields.update(getattr(record, "gpulens_fields", None) or {"msg": record.getMessage()})
        line = format_fields(fields)
        if record.exc_info:
            line += " error=" + _quote(self.formatException(record.exc_info).splitlines()[-1])
        return line


class EventLogger:
    """Logs events as `event=<name>` plus keyword fields; never formats strings at call sites."""

    def __init__(self, logger: logging.Logger, **context: Any):
        self._logger, self._context = logger, context

    def bind(self, **context: Any) -> "EventLogger":
        return EventLogger(self._logger, **{**self._context, **context})

    def _log(self, level: int, event: str, exc_info: bool, fields: dict[str, Any]) -> None:
        if self._logger.isEnabledFor(level):
            self._logger.log(level, event, exc_info=exc_info,
                             extra={"gpulens_fields": {"event": event, **self._context, **fields}})

    def debug(self, event: str, **fields: Any) -> None:
        self._log(logging.DEBUG, event, False, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._log(logging.INFO, event, False, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._log(logging.WARNING, event, False, fields)

    def error(self, event: str, exc_info: bool = False, **fields: Any) -> None:
        self._log(logging.ERROR, event, exc_info, fields)


def get_logger(component: str, **context: Any) -> EventLogger:
    return EventLogger(logging.getLogger(f"gpulens.{component}"), **context)


def setup_logging(level: str = "info", stream=None) -> None:
    """Configure the `gpulens` logger tree once per process (called from the CLI only)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(_LogfmtFormatter())
    root = logging.getLogger("gpulens")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
