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


def run(ta, contents):
    from hta.analyzers.straggler import find_stragglers_with_late_start_comm_kernels

    counts = {}

    def impl(df, symbol_table, n, visualize):
        table = symbol_table if contents.legacy_nccl_names else _NcclNameCompat(symbol_table)
        series = find_stragglers_with_late_start_comm_kernels(df, table, n, False)
        counts.update({int(r): int(v) for r, v in series.items()})
        return series

    wanted = candidates_wanted(len(contents.ranks))
    found = ta.get_potential_stragglers(num_candidates=wanted, visualize=False, straggler_identification_impl=impl)
    return {"candidates": [int(r) for r in found], "num_candidates": wanted,
            "profiler_steps": list(contents.profiler_steps),
            "late_start_counts": [{"rank": r, "count": c} for r, c in sorted(counts.items())],
            "nccl_naming": "ncclKernel" if contents.legacy_nccl_names else "ncclDevKernel"}


ANALYSIS = Analysis("stragglers", "Straggler detection", applies, run)
