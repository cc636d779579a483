"""The shape every analysis has: a name, a test of applicability, and a pure run over HTA.

An analysis never plots and never writes files: `run` returns plain JSON-able data (it becomes
part of summary.json, and the report is rendered from that alone). `applies` returns None when
the analysis makes sense for these traces, or the reason it does not; the runner records that
reason instead of letting HTA raise a bare IndexError on, say, a CPU-only trace.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from ..contents import TraceContents

if TYPE_CHECKING:
    import pandas as pd
    from hta.trace_analysis import TraceAnalysis

__all__ = ["Analysis", "NO_GPU", "num", "stats", "needs_gpu"]

NO_GPU = ("no GPU activity in the analysed traces (CPU-only capture: no event has a CUDA stream and "
          "correlation id)")


@dataclass(frozen=True)
class Analysis:
    name: str
    title: str
    applies: Callable[[TraceContents], str | None]
    run: Callable[["TraceAnalysis", TraceContents], dict[str, Any]]


def needs_gpu(contents: TraceContents) -> str | None:
    return None if contents.gpu_ranks else NO_GPU


def num(value: Any, digits: int = 3) -> float | None:
    """A JSON-safe number: numpy scalars become floats, NaN and infinities become None."""
    if value is None:
        return None
    f = float(value)
    return None if math.isnan(f) or math.isinf(f) else round(f, digits)


def stats(series: "pd.Series") -> dict[str, float | None]:
    if len(series) == 0:
        return {"mean": None, "median": None, "p95": None, "max": None}
    return {"mean": num(series.mean()), "median": num(series.median()), "p95": num(series.quantile(0.95)),
            "max": num(series.max())}
