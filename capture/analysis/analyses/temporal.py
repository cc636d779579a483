"""Temporal breakdown: per rank, how the GPU's busy span splits into idle, compute and non-compute time."""

from __future__ import annotations

from .base import NO_GPU, Analysis, num


def applies(contents):
    if not contents.gpu_ranks:
        return NO_GPU
    if contents.cpu_only_ranks:  # HTA's breakdown covers all ranks and raises on a rank without kernels
        return (f"ranks {list(contents.cpu_only_ranks)} have no GPU activity; HTA's temporal breakdown needs "
                "kernels on every rank")
    return None


def run(ta, contents):
    df = ta.get_temporal_breakdown(visualize=False)
    return {"per_rank": [{
        "rank": int(r["rank"]), "idle_us": num(r["idle_time(us)"]), "compute_us": num(r["compute_time(us)"]),
        "non_compute_us": num(r["non_compute_time(us)"]), "kernel_us": num(r["kernel_time(us)"]),
        "idle_pct": num(r["idle_time_pctg"]), "compute_pct": num(r["compute_time_pctg"]),
        "non_compute_pct": num(r["non_compute_time_pctg"]),
    } for _, r in df.iterrows()]}


ANALYSIS = Analysis("temporal_breakdown", "Temporal breakdown (GPU idle / compute / non-compute)", applies, run)
