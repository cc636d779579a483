"""Plotly figures for report.html, built from summary.json data only (no HTA, no trace access).

One builder per analysis name; each returns a list of figures. Per-rank charts put every rank of
the capture on the axis, so a missing or excluded rank is a visible gap with its label, not a
silently shorter chart.
"""

from __future__ import annotations

from typing import Any, Callable

import plotly.graph_objects as go

__all__ = ["figures_for", "rank_labels"]

_H = 360
_COLORS = {"idle": "#bbbbbb", "compute": "#1f77b4", "non_compute": "#ff7f0e",
           "host_wait": "#d62728", "kernel_wait": "#9467bd", "other": "#8c8c8c"}


def rank_labels(summary: dict[str, Any]) -> dict[int, str]:
    """rank -> axis label for every rank the capture knows, with its status when not analysed."""
    labels: dict[int, str] = {}
    for r in summary["ranks"]:
        if r["rank"] is None:
            continue
        if r["status"] == "analysed" or r["rank"] not in labels:
            labels[r["rank"]] = f"rank {r['rank']}" + ("" if r["status"] == "analysed" else f" ({r['status']})")
    return dict(sorted(labels.items()))


def _layout(fig: go.Figure, title: str, height: int = _H, **kw) -> go.Figure:
    fig.update_layout(title=title, template="plotly_white", height=height, margin=dict(l=60, r=20, t=50, b=60),
                      legend=dict(orientation="h", y=-0.2), **kw)
    return fig


def _rank_axis(fig: go.Figure, labels: dict[int, str]) -> None:
    fig.update_xaxes(type="category", categoryorder="array", categoryarray=list(labels.values()))


def _by_rank(rows: list[dict], labels: dict[int, str], value) -> tuple[list[str], list]:
    """x over every rank of the capture; y is None (a visible gap) where a rank has no row."""
    found = {r["rank"]: value(r) for r in rows}
    ranks = sorted(set(labels) | set(found))
    return [labels.get(r, f"rank {r}") for r in ranks], [found.get(r) for r in ranks]


def _short(name: str, n: int = 60) -> str:
    return name if len(name) <= n else name[: n - 1] + "…"


def _temporal(res, labels):
    rows = res["per_rank"]
    fig = go.Figure()
    for key, title in (("idle", "idle"), ("compute", "compute"), ("non_compute", "non-compute")):
        x, y = _by_rank(rows, labels, lambda r, k=key: r[f"{k}_pct"])
        fig.add_bar(name=title, x=x, y=y, marker_color=_COLORS[key])
    _rank_axis(fig, labels)
    return [_layout(fig, "GPU time by category (% of kernel span)", barmode="stack", yaxis_title="%")]


def _kernels(res, labels):
    by_type = res["by_type"]
    pie = go.Figure(go.Pie(labels=[t["kernel_type"] for t in by_type], values=[t["total_us"] for t in by_type],
                           hole=0.4, sort=False))
    top = go.Figure()
    for rank in sorted({k["rank"] for k in res["top_kernels"]}):
        ks = [k for k in res["top_kernels"] if k["rank"] == rank]
        top.add_bar(name=labels.get(rank, f"rank {rank}"), orientation="h", y=[_short(k["name"]) for k in ks],
                    x=[k["total_us"] for k in ks], hovertext=[k["name"] for k in ks])
    top.update_yaxes(autorange="reversed")
    return [_layout(pie, "GPU kernel time by type (all ranks)"),
            _layout(top, "Top kernels by total time (µs)", barmode="group", height=max(_H, 22 * len(res["top_kernels"])))]


def _overlap(res, labels):
    x, y = _by_rank(res["per_rank"], labels, lambda r: r["overlap_pct"])
    fig = go.Figure(go.Bar(x=x, y=y, marker_color="#2ca02c"))
    _rank_axis(fig, labels)
    return [_layout(fig, "Communication time overlapped by computation (%)", yaxis_title="%")]


def _idle(res, labels):
    rows = res["per_stream"]
    x = [f"{labels.get(r['rank'], r['rank'])} · stream {r['stream']}" for r in rows]
    fig = go.Figure()
    for cat in ("host_wait", "kernel_wait", "other"):
        fig.add_bar(name=cat.replace("_", " "), x=x, y=[r[f"{cat}_us"] for r in rows], marker_color=_COLORS[cat])
    return [_layout(fig, "GPU idle time by stream (µs)", barmode="stack", yaxis_title="µs")]


def _launches(res, labels):
    rows = res["per_rank"]
    fig = go.Figure()
    for key, name in (("cpu_duration_us", "launch call (CPU)"), ("gpu_duration_us", "kernel (GPU)"),
                      ("launch_delay_us", "launch delay")):
        for stat in ("median", "p95"):
            x, y = _by_rank(rows, labels, lambda r, k=key, s=stat: r[k][s])
            fig.add_bar(name=f"{name} {stat}", x=x, y=y)
    _rank_axis(fig, labels)
    return [_layout(fig, "Kernel launches: median and p95 (µs)", barmode="group", yaxis_title="µs", yaxis_type="log")]


def _stragglers(res, labels):
    cands = set(res["candidates"])
    x, y = _by_rank(res["late_start_counts"], labels, lambda c: c["count"])
    colors = ["#d62728" if r in cands else "#1f77b4" for r in sorted(set(labels) | {c["rank"] for c in res["late_start_counts"]})]
    fig = go.Figure(go.Bar(x=x, y=y, marker_color=colors))
    _rank_axis(fig, labels)
    return [_layout(fig, "Iterations in which each rank started its dominant NCCL kernel late (red: candidates)",
                    yaxis_title="iterations")]


def _iterations(res, labels):
    fig = go.Figure()
    for rank in sorted({s["rank"] for s in res["steps"]}):
        steps = [s for s in res["steps"] if s["rank"] == rank]
        fig.add_scatter(name=labels.get(rank, f"rank {rank}"), mode="lines+markers",
                        x=[s["step"] for s in steps], y=[s["dur_us"] for s in steps])
    return [_layout(fig, "ProfilerStep duration per rank (µs)", xaxis_title="step", yaxis_title="µs")]


def _top_named(rows, title):
    totals: dict[str, float] = {}
    for r in rows:
        totals[r["name"]] = totals.get(r["name"], 0.0) + (r["total_us"] or 0.0)
    top = sorted(totals.items(), key=lambda kv: -kv[1])[:15]
    fig = go.Figure(go.Bar(orientation="h", y=[_short(n) for n, _ in top], x=[v for _, v in top],
                           hovertext=[n for n, _ in top], marker_color="#17becf"))
    fig.update_yaxes(autorange="reversed")
    return [_layout(fig, title, height=max(_H, 24 * len(top)))]


_BUILDERS: dict[str, Callable[[dict, dict], list[go.Figure]]] = {
    "temporal_breakdown": _temporal, "kernel_breakdown": _kernels, "comm_comp_overlap": _overlap,
    "idle_time": _idle, "kernel_launch_stats": _launches, "stragglers": _stragglers,
    "iteration_times": _iterations,
    "cpu_op_breakdown": lambda res, labels: _top_named(res["top_ops"], "CPU ops by inclusive time, all ranks (µs)"),
    "user_annotation_breakdown": lambda res, labels: _top_named(res["top"], "User annotations by CPU time, all ranks (µs)"),
}


def figures_for(name: str, result: dict[str, Any], summary: dict[str, Any]) -> list[go.Figure]:
    builder = _BUILDERS.get(name)
    return builder(result, rank_labels(summary)) if builder else []
