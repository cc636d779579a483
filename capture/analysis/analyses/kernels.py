"""Kernel breakdown: GPU time by kernel type (communication, computation, memory) and the top kernels."""

from __future__ import annotations

from .base import Analysis, needs_gpu, num

TOP_KERNELS = 10


def run(ta, contents):
    by_type, kernels = ta.get_gpu_kernel_breakdown(visualize=False, num_kernels=TOP_KERNELS)
    return {
        "by_type": [{"kernel_type": str(r["kernel_type"]), "total_us": num(r["sum"]), "pct": num(r["percentage"])}
                    for _, r in by_type.iterrows()],
        "top_kernels": [{
            "rank": int(r["rank"]), "name": str(r["name"]), "kernel_type": str(r["kernel_type"]),
            "total_us": num(r["sum (us)"]), "mean_us": num(r["mean (us)"]), "max_us": num(r["max (us)"]),
            "min_us": num(r["min (us)"]), "stddev_us": num(r["stddev"]),
        } for _, r in kernels.sort_values(["rank", "sum (us)"], ascending=[True, False]).iterrows()],
    }


ANALYSIS = Analysis("kernel_breakdown", "GPU kernel breakdown", needs_gpu, run)
