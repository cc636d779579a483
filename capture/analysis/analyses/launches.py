"""CUDA kernel launch statistics: CPU launch cost, GPU kernel duration and launch delay per rank."""

from __future__ import annotations

from .base import Analysis, needs_gpu, stats

RUNTIME_CUTOFF_US = 50       # HTA's defaults: a CUDA runtime call longer than this is an outlier
LAUNCH_DELAY_CUTOFF_US = 100  # and so is a launch that waited longer than this to start on the GPU


def run(ta, contents):
    per_rank = ta.get_cuda_kernel_launch_stats(ranks=list(contents.gpu_ranks), runtime_cutoff=RUNTIME_CUTOFF_US,
                                               launch_delay_cutoff=LAUNCH_DELAY_CUTOFF_US, visualize=False)
    out = []
    for rank in sorted(per_rank):
        df = per_rank[rank]
        out.append({
            "rank": int(rank), "launches": int(len(df)),
            "cpu_duration_us": stats(df["cpu_duration"]), "gpu_duration_us": stats(df["gpu_duration"]),
            "launch_delay_us": stats(df["launch_delay"]),
            "long_runtime_calls": int((df["cpu_duration"] > RUNTIME_CUTOFF_US).sum()),
            "long_launch_delays": int((df["launch_delay"] > LAUNCH_DELAY_CUTOFF_US).sum()),
            "gpu_shorter_than_launch": int((df["gpu_duration"] < df["cpu_duration"]).sum()),
        })
    return {"runtime_cutoff_us": RUNTIME_CUTOFF_US, "launch_delay_cutoff_us": LAUNCH_DELAY_CUTOFF_US,
            "per_rank": out}


ANALYSIS = Analysis("kernel_launch_stats", "CUDA kernel launch statistics", needs_gpu, run)
