"""Load the verified rank files into one HTA `Trace`, with bounded parallelism and quiet logs.

HTA's own `TraceAnalysis(...)` constructor parses with a fork pool as wide as the CPU count (and,
past 8 ranks, sized from 80% of free RAM), logs to stdout, and discovers ranks by regex when not
handed a dict; a parser killed by the OOM killer leaves its `multiprocessing.Pool` waiting forever.
Here the rank -> file map is always explicit and ranks are parsed by at most `jobs` forked workers
(HTA's own `parse_trace_file`, one file per task); a rank whose parser fails or dies is reported
and left out (it is retried alone once, since a dying worker breaks every task it shared a pool
with). The per-rank symbol tables are merged exactly as `Trace.parse_multiple_ranks` does, then
HTA's own alignment and last-step filter run unchanged. This mirrors `Trace.load_traces` of HTA
0.6.1 (PyPI `traceinsight`), the pinned version, which is 0.5.0's here plus guards for ranks
without events (its JSON parser still raises on those, and the inspection rejects them first).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import time
import warnings
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpulens.logs import EventLogger

if TYPE_CHECKING:
    from hta.common.trace import Trace
    from hta.trace_analysis import TraceAnalysis

__all__ = ["LoadedTrace", "load_trace", "facade", "quiet_hta", "hta_version", "MAX_JOBS"]

MAX_JOBS = 8


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


@dataclass
class LoadedTrace:
    trace: "Trace | None"           # None when no rank could be parsed
    failed: dict[int, str]          # rank -> why HTA could not parse it


def _parse(path: str, cfg):
    from hta.common.trace import parse_trace_file
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return parse_trace_file(path, cfg)


def _parse_all(files: dict[int, str], cfg, jobs: int):
    """Yield (rank, result or None, error); at most `jobs` parsers alive at any moment."""
    broken: list[int] = []
    ctx = mp.get_context("fork")  # the parent's imports are inherited: no re-import of pandas per worker
    with ProcessPoolExecutor(max(1, min(jobs, len(files))), mp_context=ctx) as pool:
        futures = {pool.submit(_parse, files[r], cfg): r for r in sorted(files)}
        for fut in as_completed(futures):
            rank = futures[fut]
            try:
                yield rank, fut.result(), ""
            except BrokenProcessPool:
                broken.append(rank)
            except Exception as exc:  # noqa: BLE001 - HTA's parser raises bare builtins
                yield rank, None, f"HTA could not parse it: {type(exc).__name__}: {exc}"[:500]
    for rank in sorted(broken):
        with ProcessPoolExecutor(1, mp_context=ctx) as pool:
            try:
                yield rank, pool.submit(_parse, files[rank], cfg).result(), ""
            except BrokenProcessPool:
                yield rank, None, "the HTA parser for this trace died (killed, e.g. out of memory)"
            except Exception as exc:  # noqa: BLE001
                yield rank, None, f"HTA could not parse it: {type(exc).__name__}: {exc}"[:500]


def load_trace(files: dict[int, str], trace_dir: str, jobs: int, log: EventLogger) -> LoadedTrace:
    quiet_hta(log)
    from hta.common.trace import Trace

    jobs = max(1, min(jobs, MAX_JOBS))
    t0 = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trace = Trace(trace_files=dict(files), trace_dir=trace_dir)
        parsed, local_tables, failed, done = {}, {}, {}, 0
        for rank, result, error in _parse_all(files, trace.parser_config, jobs):
            done += 1
            if result is None:
                failed[rank] = error
                log.warning("traces.parse_failed", rank=rank, progress=f"{done}/{len(files)}", error=error)
                continue
            parsed[rank] = result
            log.info("traces.parsed", rank=rank, progress=f"{done}/{len(files)}", workers=min(jobs, len(files)))
        if not parsed:
            return LoadedTrace(None, failed)
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
    log.info("traces.loaded", ranks=len(local_tables), failed=len(failed), seconds=round(time.monotonic() - t0, 3))
    return LoadedTrace(trace, failed)


def facade(trace: "Trace") -> "TraceAnalysis":
    """HTA's documented façade over an already loaded Trace (its constructor would parse again)."""
    from hta.trace_analysis import TraceAnalysis
    ta = TraceAnalysis.__new__(TraceAnalysis)
    ta.t = trace
    return ta
