"""Load one verified rank file into an HTA `Trace`, in this process, with quiet logs.

HTA's own `TraceAnalysis(...)` constructor parses with a fork pool as wide as the CPU count (and,
past 8 ranks, sized from 80% of free RAM), logs to stdout, and discovers ranks by regex when not
handed a dict. Here every rank is loaded on its own on a Dask worker (the unit of memory and of
failure: a parser killed for memory costs that worker's rank, retried by Dask), with an explicit
{rank: file} map, HTA's own `parse_trace_file`, the symbol-table steps of
`Trace.parse_multiple_ranks`, and HTA's own alignment and last-step filter, unchanged. This mirrors `Trace.load_traces` of HTA
0.6.1 (PyPI `traceinsight`), the pinned version, which is 0.5.0's here plus guards for ranks
without events (its JSON parser still raises on those, and the inspection rejects them first).
"""

from __future__ import annotations

import logging
import time
import warnings
from typing import TYPE_CHECKING

from gpulens.ground.logs import EventLogger

if TYPE_CHECKING:
    from hta.common.trace import Trace
    from hta.trace_analysis import TraceAnalysis

__all__ = ["load_rank", "facade", "quiet_hta", "hta_version"]


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
    """The version of the `hta` package actually imported (PyPI name `traceinsight` since 0.6.0,
    `HolisticTraceAnalysis` before: asking either distribution could name one that is not loaded)."""
    import hta
    return str(hta.__version__)


def _parse(path: str, cfg):
    from hta.common.trace import parse_trace_file
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return parse_trace_file(path, cfg)


def _assemble(trace: "Trace", parsed: dict, files: dict[int, str]) -> None:
    """Merge parsed ranks into `trace` as `Trace.parse_multiple_ranks` does, then align and filter."""
    local_tables = {}
    for rank in sorted(parsed):  # rank order, not completion order: HTA's per-rank tables follow it
        trace.meta_data[rank], trace.traces[rank], local_tables[rank] = parsed.pop(rank)
        trace.symbol_table.add_symbols(local_tables[rank].get_sym_table())
    # re-encode every rank's symbol ids against the merged table (Trace.parse_multiple_ranks)
    global_map = trace.symbol_table.get_sym_id_map()
    for rank, local in local_tables.items():
        table = local.get_sym_table()
        for col in ("cat", "name"):
            trace.traces[rank][col] = trace.traces[rank][col].apply(lambda idx, t=table: global_map[t[idx]])
    trace.trace_files = {r: files[r] for r in local_tables}
    trace.is_parsed = True
    trace.align_and_filter_trace(include_last_profiler_step=False)
    for rank, df in trace.traces.items():
        df = df.set_index("index", drop=False)
        df.index.names = [None]
        trace.traces[rank] = df


def load_rank(rank: int, path: str, trace_dir: str, log: EventLogger) -> "Trace":
    """One rank, parsed in this process (a Dask worker is the unit of memory and of failure; it
    may not fork). HTA aligns it to its own first event: `trace.min_ts` is that event's raw ts, which
    the cross-rank reduce uses to put ranks back on one time axis. Raises what HTA's parser raises."""
    quiet_hta(log)
    from hta.common.trace import Trace

    t0 = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trace = Trace(trace_files={rank: path}, trace_dir=trace_dir)
        _assemble(trace, {rank: _parse(path, trace.parser_config)}, {rank: path})
    log.info("trace.loaded", rank=rank, seconds=round(time.monotonic() - t0, 3))
    return trace


def facade(trace: "Trace") -> "TraceAnalysis":
    """HTA's documented façade over an already loaded Trace (its constructor would parse again)."""
    from hta.trace_analysis import TraceAnalysis
    ta = TraceAnalysis.__new__(TraceAnalysis)
    ta.t = trace
    return ta
