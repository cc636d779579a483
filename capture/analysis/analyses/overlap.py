"""Communication/computation overlap: the share of NCCL kernel time hidden under compute kernels."""

from __future__ import annotations

from .base import NO_GPU, Analysis, num


def applies(contents):
    if not contents.gpu_ranks:
        return NO_GPU
    if not contents.comm_ranks:
        return "no communication kernels (no kernel named nccl*Kernel): nothing to overlap"
    return None


def run(ta, contents):
    df = ta.get_comm_comp_overlap(visualize=False)
    return {"per_rank": [{"rank": int(r["rank"]), "overlap_pct": num(r["comp_comm_overlap_pctg"])}
                         for _, r in df.iterrows()]}


ANALYSIS = Analysis("comm_comp_overlap", "Communication / computation overlap", applies, run)
