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


def merge(results, contents):
    """HTA's type totals are sums over ranks with a percentage of the whole: recomputed from the ranks'."""
    totals: dict[str, float] = {}
    for r in results:
        for t in r["by_type"]:
            totals[t["kernel_type"]] = totals.get(t["kernel_type"], 0.0) + (t["total_us"] or 0.0)
    whole = sum(totals.values())
    by_type = [{"kernel_type": k, "total_us": num(v), "pct": num(round(100.0 * v / whole, 1)) if whole else None}
               for k, v in sorted(totals.items(), key=lambda kv: -kv[1])]
    return {"by_type": by_type, "top_kernels": [k for r in results for k in r["top_kernels"]]}


ANALYSIS = Analysis("kernel_breakdown", "GPU kernel breakdown", needs_gpu, run, merge)
