"""Load the verified rank files into one HTA `Trace`, with bounded parallelism and quiet logs.

HTA's own `TraceAnalysis(...)` constructor parses with a fork pool as wide as the CPU count (and,
past 8 ranks, sized from 80% of free RAM), logs to stdout, and discovers ranks by regex when not
handed a dict. Here the rank -> file map is always explicit, and ranks are parsed `jobs` at a time
(`Trace.parse_multiple_ranks` per chunk), so the transient memory of parsing is bounded by `jobs`
files while the parsed DataFrames accumulate in this process. Then HTA's own alignment and
last-step filter run unchanged. This mirrors `Trace.load_traces` of HTA 0.5.0 (the pinned version).
"""

from __future__ import annotations

import logging
import time
import warnings
from typing import TYPE_CHECKING

from gpulens.logs import EventLogger

if TYPE_CHECKING:
    from hta.common.trace import Trace
    from hta.trace_analysis import TraceAnalysis

__all__ = ["load_trace", "facade", "quiet_hta", "hta_version"]


class _ToEventLog(logging.Handler):
    """Forwards HTA's error records into our logfmt stream (HTA's own handler writes to stdout)."""

    def __init__(self, log: EventLogger):
        super().__init__(logging.ERROR)
        self._log = log

    def emit(self, record: logging.LogRecord) -> None:
        self._log.warning("hta.error", message=record.getMessage()[:500])


def quiet_hta(log: EventLogger) -> None:
    """Keep stdout for the report URI: HTA logs INFO/WARNING chatter there unless told otherwise."""
    hta_logger = logging.getLogger("hta")
    hta_logger.handlers[:] = [_ToEventLog(log)]
    hta_logger.setLevel(logging.ERROR)
    hta_logger.propagate = False


def hta_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("HolisticTraceAnalysis")
    except PackageNotFoundError:  # pragma: no cover - the dependency is pinned
        return "unknown"


def load_trace(files: dict[int, str], trace_dir: str, jobs: int, log: EventLogger) -> "Trace":
    quiet_hta(log)
    from hta.common.trace import Trace

    ranks = sorted(files)
    jobs = max(1, min(jobs, 8))  # HTA sizes its pool from free RAM past 8 ranks: never let it
    t0 = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trace = Trace(trace_files=dict(files), trace_dir=trace_dir)
        done = 0
        for i in range(0, len(ranks), jobs):
            chunk = ranks[i:i + jobs]
            trace.parse_multiple_ranks(chunk, use_multiprocessing=len(chunk) > 1, use_memory_profiling=False)
            done += len(chunk)
            log.info("traces.parsed", progress=f"{done}/{len(ranks)}", ranks=",".join(map(str, chunk)),
                     workers=len(chunk))
        trace.is_parsed = True
        trace.align_and_filter_trace(include_last_profiler_step=False)
        for rank, df in trace.traces.items():
            df = df.set_index("index", drop=False)
            df.index.names = [None]
            trace.traces[rank] = df
    log.info("traces.loaded", ranks=len(ranks), seconds=round(time.monotonic() - t0, 3))
    return trace


def facade(trace: "Trace") -> "TraceAnalysis":
    """HTA's documented façade over an already loaded Trace (its constructor would parse again)."""
    from hta.trace_analysis import TraceAnalysis
    ta = TraceAnalysis.__new__(TraceAnalysis)
    ta.t = trace
    return ta
