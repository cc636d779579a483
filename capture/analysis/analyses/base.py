"""The shape every analysis has: a name, a test of applicability, and a pure run over HTA.

An analysis never plots and never writes files: `run` returns plain JSON-able data (it becomes
part of summary.json, and the report is rendered from that alone). `applies` returns None when
the analysis makes sense for these traces, or the reason it does not; the runner records that
reason instead of letting HTA raise a bare IndexError on, say, a CPU-only trace.

Analyses run per rank (map: `run` over a one-rank HTA trace on a worker, where `rank_applies`,
by default `applies`, judges that rank alone) and are combined across ranks by `merge` (reduce:
over the per-rank results only, in rank order, with `applies` judging all analysed ranks). The
default merge concatenates the per-rank lists, which is right for every analysis whose rows carry
their rank; an analysis that compares ranks merges itself (stragglers, kernel type totals).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from ..contents import TraceContents

if TYPE_CHECKING:
    import pandas as pd
    from hta.trace_analysis import TraceAnalysis

__all__ = ["Analysis", "NO_GPU", "num", "stats", "needs_gpu", "concat_by_rank"]

NO_GPU = ("no GPU activity in the analysed traces (CPU-only capture: no event has a CUDA stream and "
          "correlation id)")


@dataclass(frozen=True)
class Analysis:
    name: str
    title: str
    applies: Callable[[TraceContents], str | None]
    run: Callable[["TraceAnalysis", TraceContents], dict[str, Any]]
    merge: Callable[[list[dict[str, Any]], TraceContents], dict[str, Any]] | None = None
    rank_applies: Callable[[TraceContents], str | None] | None = None

    def applies_to_rank(self, contents: TraceContents) -> str | None:
        return (self.rank_applies or self.applies)(contents)

    def combine(self, results: list[dict[str, Any]], contents: TraceContents) -> dict[str, Any]:
        return (self.merge or concat_by_rank)(results, contents)


def concat_by_rank(results: list[dict[str, Any]], contents: TraceContents | None = None) -> dict[str, Any]:
    """Per-rank results (rank order) as one: lists are concatenated, equal scalars kept; a scalar
    that differs between ranks becomes the list of every rank's value."""
    out: dict[str, Any] = {}
    for key in dict.fromkeys(k for r in results for k in r):
        values = [r[key] for r in results if key in r]
        if all(isinstance(v, list) for v in values):
            out[key] = [x for v in values for x in v]
        elif all(v == values[0] for v in values):
            out[key] = values[0]
        else:
            out[key] = values
    return out


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
