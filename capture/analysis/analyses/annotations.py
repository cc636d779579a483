"""User annotation breakdown: time in record_function ranges on the CPU (HTA, CPU side), per rank.

ProfilerStep#N ranges are left out: iteration_times covers them.
"""

from __future__ import annotations

from .base import Analysis, num

TOP_ANNOTATIONS = 20


def applies(contents):
    return None if contents.annotation_ranks else "no user annotations (record_function ranges) in the traces"


def run(ta, contents):
    df = ta.get_gpu_user_annotation_breakdown(use_gpu_annotation=False, visualize=False,
                                              num_kernels=TOP_ANNOTATIONS)
    rows = []
    if df is not None:
        df = df[~df["name"].astype(str).str.startswith("ProfilerStep#")]
        for _, r in df.sort_values(["rank", "sum (us)"], ascending=[True, False]).iterrows():
            rows.append({"rank": int(r["rank"]), "name": str(r["name"]), "total_us": num(r["sum (us)"]),
                         "mean_us": num(r["mean (us)"]), "max_us": num(r["max (us)"]), "min_us": num(r["min (us)"])})
    return {"top": rows}


ANALYSIS = Analysis("user_annotation_breakdown", "User annotation breakdown (CPU)", applies, run)
