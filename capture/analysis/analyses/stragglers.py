"""Straggler detection: ranks whose dominant NCCL kernel starts late, iteration after iteration (HTA's metric).

HTA (0.5.0, still in 0.6.1) recognises communication kernels here only by the old `ncclKernel*` naming; NCCL >= 2.19
names them `ncclDevKernel_*` and HTA then fails with "argmax of an empty sequence". The symbol
table handed to HTA's straggler code presents the new names under the old prefix, so both work.
"""

from __future__ import annotations

from .base import NO_GPU, Analysis


def applies(contents):
    if not contents.gpu_ranks:
        return NO_GPU
    if len(contents.ranks) < 2:
        return "needs two or more analysed ranks to compare"
    if len(contents.comm_ranks) < 2:
        return "needs NCCL communication kernels on two or more ranks"
    if not contents.profiler_steps:
        return "needs ProfilerStep#N annotations (iterations) that survive HTA's last-step filter"
    return None


class _NcclNameCompat:
    """Read-only view of a TraceSymbolTable where ncclDevKernel* reads as ncclKernel_Dev* (ids unchanged)."""

    def __init__(self, table):
        self._names = [f"ncclKernel_Dev{n[len('ncclDevKernel'):]}" if n.startswith("ncclDevKernel") else n
                       for n in table.get_sym_table()]

    def get_sym_table(self):
        return self._names

    def get_sym_id_map(self):
        return {n: i for i, n in enumerate(self._names)}


def candidates_wanted(n_ranks: int) -> int:
    """HTA always returns its top-k; ask for one candidate among few ranks, two from eight on."""
    return 1 if n_ranks < 8 else 2


def rank_applies(contents):
    if not contents.gpu_ranks:
        return NO_GPU
    if not contents.comm_ranks:
        return "no NCCL communication kernels on this rank"
    if not contents.profiler_steps:
        return "no ProfilerStep#N annotations on this rank"
    return None


def run(ta, contents):
    """Map, one rank: what HTA's metric reads of it. Its communication kernels on a stream (name,
    stream, iteration, ts, dur, in HTA's row order), each iteration's first start and last end (HTA
    normalises by the whole selection's span), and the rank's raw first timestamp (HTA aligns all
    ranks to the earliest one; each rank here was aligned to its own)."""
    t = ta.t
    rank = contents.ranks[0]
    df = t.get_trace(rank)
    names = t.symbol_table.get_sym_table()
    comm_ids = [i for i, n in enumerate(names) if n.startswith(("ncclKernel", "ncclDevKernel"))]
    rows = df[df["iteration"] != -1]
    ends = rows["ts"] + rows["dur"]
    bounds = rows.assign(end=ends).groupby("iteration").agg(ts=("ts", "min"), end=("end", "max"))
    comm = rows[(rows["stream"] > 0) & (rows["iteration"] > 0) & rows["name"].isin(comm_ids)]
    return {"rank": int(rank), "min_ts": int(t.min_ts),
            "bounds": [[int(i), int(b.ts), int(b.end)] for i, b in bounds.iterrows()],
            "kernels": [[int(st), int(it), names[int(n)], int(ts), int(d)] for st, it, n, ts, d in
                        zip(comm["stream"], comm["iteration"], comm["name"], comm["ts"], comm["dur"])]}


class _Names:
    """The smallest TraceSymbolTable HTA's straggler metric reads: the names, and name -> id."""

    def __init__(self, names: list[str]):
        self._names = names

    def get_sym_table(self):
        return self._names

    def get_sym_id_map(self):
        return {n: i for i, n in enumerate(self._names)}


def merge(results, contents):
    """Reduce: HTA's own metric and top-k over a frame rebuilt from every rank's extract, on HTA's
    common time axis (each rank shifted back by its first timestamp minus the earliest rank's)."""
    import pandas as pd
    from hta.analyzers.straggler import find_stragglers_with_late_start_comm_kernels

    steps = set(contents.profiler_steps)
    names = sorted({k[2] for r in results for k in r["kernels"]})
    ids = {n: i for i, n in enumerate(names)}
    names.append("gpulens:iteration span")  # rows that only carry an iteration's first start and last end
    base = min(r["min_ts"] for r in results)
    rows = []
    for r in sorted(results, key=lambda r: r["rank"]):
        shift = r["min_ts"] - base
        rows += [(r["rank"], -1, it, len(names) - 1, ts + shift, end - ts) for it, ts, end in r["bounds"] if it in steps]
        rows += [(r["rank"], st, it, ids[n], ts + shift, d) for st, it, n, ts, d in r["kernels"] if it in steps]
    df = pd.DataFrame(rows, columns=["rank", "stream", "iteration", "name", "ts", "dur"])
    table = _Names(names) if contents.legacy_nccl_names else _NcclNameCompat(_Names(names))
    wanted = candidates_wanted(len(contents.ranks))
    series = find_stragglers_with_late_start_comm_kernels(df, table, wanted, False)
    counts = {int(r): int(v) for r, v in series.items()}
    found = series.sort_values(ascending=False)[:wanted].index.tolist()
    return {"candidates": [int(r) for r in found], "num_candidates": wanted,
            "profiler_steps": list(contents.profiler_steps),
            "late_start_counts": [{"rank": r, "count": c} for r, c in sorted(counts.items())],
            "nccl_naming": "ncclKernel" if contents.legacy_nccl_names else "ncclDevKernel"}


ANALYSIS = Analysis("stragglers", "Straggler detection", applies, run, merge, rank_applies)
