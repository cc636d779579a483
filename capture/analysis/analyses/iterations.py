"""Iteration times: ProfilerStep#N durations per rank (works on CPU-only traces too)."""

from __future__ import annotations

from .base import Analysis, num, stats


def applies(contents):
    return None if contents.profiler_steps else (
        "no ProfilerStep#N annotations survive HTA's last-step filter (on-demand captures without "
        "torch.profiler steps have none)")


def run(ta, contents):
    from hta.analyzers.straggler import extract_iteration_info

    df = extract_iteration_info(ta.t)
    df = df[df["iter"] >= 0]
    steps = [{"rank": int(r["rank"]), "step": int(r["iter"]), "dur_us": num(r["dur"])}
             for _, r in df.sort_values(["rank", "iter"]).iterrows()]
    per_rank = []
    for rank, group in df.groupby("rank"):
        s = stats(group["dur"])
        per_rank.append({"rank": int(rank), "steps": int(len(group)), "mean_us": s["mean"],
                         "median_us": s["median"], "max_us": s["max"], "min_us": num(group["dur"].min())})
    slowest = max(per_rank, key=lambda r: r["mean_us"] or 0)["rank"] if per_rank else None
    return {"per_rank": per_rank, "steps": steps, "slowest_rank": slowest}


def merge(results, contents):
    per_rank = [r for res in results for r in res["per_rank"]]
    slowest = max(per_rank, key=lambda r: r["mean_us"] or 0)["rank"] if per_rank else None
    return {"per_rank": per_rank, "steps": [s for res in results for s in res["steps"]], "slowest_rank": slowest}


ANALYSIS = Analysis("iteration_times", "Iteration (ProfilerStep) times", applies, run, merge)
