"""Run the chosen analyses one by one; one failing analysis never sinks the report.

HTA signals trouble with bare AssertionError / IndexError / ValueError / KeyError from deep inside
pandas code, so every analysis runs inside its own try: a failure is recorded with the exception
type and message, and the next analysis runs.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any, Iterable

from gpulens.ground.logs import EventLogger

from .analyses.base import Analysis
from .contents import TraceContents

__all__ = ["AnalysisResult", "run_analyses"]

OK, NOT_APPLICABLE, FAILED = "ok", "not_applicable", "failed"


@dataclass(frozen=True)
class AnalysisResult:
    name: str
    title: str
    status: str                    # "ok" | "not_applicable" | "failed"
    reason: str | None = None      # why not applicable, or the error
    seconds: float = 0.0
    result: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"title": self.title, "status": self.status, "reason": self.reason,
                "seconds": round(self.seconds, 3), "result": self.result}


def run_analyses(ta: Any, contents: TraceContents, analyses: Iterable[Analysis], log: EventLogger) -> list[AnalysisResult]:
    analyses = list(analyses)
    out = []
    for i, analysis in enumerate(analyses, 1):
        progress = f"{i}/{len(analyses)}"
        reason = analysis.applies_to_rank(contents)
        if reason is not None:
            log.info("analysis.not_applicable", analysis=analysis.name, progress=progress, reason=reason)
            out.append(AnalysisResult(analysis.name, analysis.title, NOT_APPLICABLE, reason))
            continue
        log.info("analysis.started", analysis=analysis.name, progress=progress)
        t0 = time.monotonic()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # pandas FutureWarnings from inside HTA, on every call
                result = analysis.run(ta, contents)
        except Exception as exc:  # noqa: BLE001 - HTA raises bare builtins; record and go on
            seconds = time.monotonic() - t0
            error = f"{type(exc).__name__}: {exc}"[:500]
            log.warning("analysis.failed", analysis=analysis.name, progress=progress, error=error,
                        seconds=round(seconds, 3))
            out.append(AnalysisResult(analysis.name, analysis.title, FAILED, error, seconds))
            continue
        seconds = time.monotonic() - t0
        log.info("analysis.finished", analysis=analysis.name, progress=progress, seconds=round(seconds, 3))
        out.append(AnalysisResult(analysis.name, analysis.title, OK, None, seconds, result))
    return out
