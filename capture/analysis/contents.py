"""What the loaded traces contain, after HTA's filtering: the basis for choosing analyses.

Computed from HTA's own parsed frames (not from the raw files) so that the decision matches what
the analyses will see: HTA counts a row as GPU activity when `stream >= 0 and correlation >= 0`,
and as communication when the kernel name matches `^nccl.*Kernel`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hta.common.trace import Trace

__all__ = ["TraceContents", "describe", "combine_contents"]

_COMM = re.compile(r"^nccl.*Kernel")


@dataclass(frozen=True)
class TraceContents:
    ranks: tuple[int, ...]
    gpu_ranks: tuple[int, ...]           # ranks with GPU rows
    comm_ranks: tuple[int, ...]          # ranks with NCCL communication kernels
    legacy_nccl_names: bool              # some NCCL kernel is named ncclKernel* (HTA's stragglers need that, 0.6.1 too)
    profiler_steps: tuple[int, ...]      # ProfilerStep#N numbers left after HTA's last-step filter
    cpu_op_ranks: tuple[int, ...]
    annotation_ranks: tuple[int, ...]    # ranks with CPU user annotations (record_function ranges)

    @property
    def kind(self) -> str:
        return "gpu" if self.gpu_ranks else "cpu_only"

    @property
    def cpu_only_ranks(self) -> tuple[int, ...]:
        return tuple(r for r in self.ranks if r not in self.gpu_ranks)

    def to_dict(self) -> dict:
        return {"ranks": list(self.ranks), "gpu_ranks": list(self.gpu_ranks), "comm_ranks": list(self.comm_ranks),
                "legacy_nccl_names": self.legacy_nccl_names, "profiler_steps": list(self.profiler_steps),
                "cpu_op_ranks": list(self.cpu_op_ranks), "annotation_ranks": list(self.annotation_ranks)}

    @classmethod
    def from_dict(cls, d: dict) -> "TraceContents":
        return cls(**{k: (v if k == "legacy_nccl_names" else tuple(v)) for k, v in d.items()})


def combine_contents(parts: list[TraceContents]) -> TraceContents:
    """What all these ranks hold together: as `describe` says of one HTA trace loaded with all of
    them (profiler steps: the union, as HTA's `get_profiler_steps` takes unique steps over ranks)."""
    def ranks(attr: str) -> tuple[int, ...]:
        return tuple(sorted(r for p in parts for r in getattr(p, attr)))
    return TraceContents(ranks=ranks("ranks"), gpu_ranks=ranks("gpu_ranks"), comm_ranks=ranks("comm_ranks"),
                         legacy_nccl_names=any(p.legacy_nccl_names for p in parts),
                         profiler_steps=tuple(sorted({s for p in parts for s in p.profiler_steps})),
                         cpu_op_ranks=ranks("cpu_op_ranks"), annotation_ranks=ranks("annotation_ranks"))


def describe(trace: "Trace") -> TraceContents:
    from hta.analyzers.straggler_analysis import StragglerAnalysis

    names = trace.symbol_table.get_sym_table()
    ids = trace.symbol_table.get_sym_id_map()
    comm_ids = [i for i, n in enumerate(names) if _COMM.match(n)]
    legacy_ids = {i for i in comm_ids if names[i].startswith("ncclKernel")}
    cpu_op, annotation = ids.get("cpu_op"), ids.get("user_annotation")
    gpu, comm, cpu, ann, legacy = [], [], [], [], False
    for rank in trace.get_ranks():
        df = trace.get_trace(rank)
        gpu_rows = df[(df["stream"] >= 0) & (df["correlation"] >= 0)]
        if len(gpu_rows):
            gpu.append(rank)
            comm_rows = gpu_rows[gpu_rows["name"].isin(comm_ids)]
            if len(comm_rows):
                comm.append(rank)
                legacy = legacy or bool(comm_rows["name"].isin(legacy_ids).any())
        if cpu_op is not None and (df["cat"] == cpu_op).any():
            cpu.append(rank)
        if annotation is not None and (df["cat"] == annotation).any():
            ann.append(rank)
    try:
        steps = tuple(int(s) for s in StragglerAnalysis.get_profiler_steps(trace))
    except (KeyError, ValueError):  # no ProfilerStep annotations at all
        steps = ()
    return TraceContents(ranks=tuple(trace.get_ranks()), gpu_ranks=tuple(gpu), comm_ranks=tuple(comm),
                         legacy_nccl_names=legacy, profiler_steps=steps, cpu_op_ranks=tuple(cpu),
                         annotation_ranks=tuple(ann))
