"""Idle time: per rank and stream, GPU idle time split into host wait, kernel wait and other."""

from __future__ import annotations

from .base import Analysis, needs_gpu, num

_CATEGORIES = ("host_wait", "kernel_wait", "other")


def run(ta, contents):
    df, _ = ta.get_idle_time_breakdown(ranks=list(contents.gpu_ranks), visualize=False,
                                       show_idle_interval_stats=False)
    rows: dict[tuple[int, int], dict] = {}
    for _, r in df.iterrows():
        key = (int(r["rank"]), int(r["stream"]))
        row = rows.setdefault(key, {"rank": key[0], "stream": key[1], **{f"{c}_us": 0.0 for c in _CATEGORIES}})
        if r["idle_category"] in _CATEGORIES:
            row[f"{r['idle_category']}_us"] = num(r["idle_time"]) or 0.0
    out = sorted(rows.values(), key=lambda x: (x["rank"], x["stream"]))
    for row in out:
        row["idle_us"] = num(sum(row[f"{c}_us"] for c in _CATEGORIES))
    return {"per_stream": out}


ANALYSIS = Analysis("idle_time", "GPU idle time by stream", needs_gpu, run)
