"""Measure, per rank, what each diagnosis would leave in a trace: the numbers the verdicts judge.

Pure over HTA's parsed frames (no files, no plots), like an analysis, but its result feeds the
verdict section rather than a table of its own:

- host-blocking work: `aten::item` / `aten::_local_scalar_dense` (a tensor value read on the host
  waits for the device), on GPU traces the CUDA synchronising calls and device-to-host memcpy
  calls, on CPU-only traces `aten::_to_copy` / `aten::copy_` (every tensor lives on the host there,
  so a copy is a copy to the host) made by the program itself: a copy inside another operator
  (`aten::addmm`'s internal `copy_`, a dtype promotion's `aten::to` inside `aten::div_`) is that
  operator's work, not a transfer, and is left out. Nested matches count once (outermost), so
  `_to_copy` and its `copy_` are not added twice;
- data-loader wait: DataLoader `__next__` spans (PyTorch names them
  `enumerate(DataLoader)#<Iter>.__next__`);
- GPU kernel time and GPU-idle time inside steps (GPU traces only: None on CPU-only ranks, never 0);
- an operator/kernel profile per step, which a later capture compares against (baseline diff).

Per step means inside the rank's step windows (capture/analysis/step_windows.py: `ProfilerStep#N`
markers when the trace has them, else the spans between its optimizer steps, which every loop's
trace has); a trace with neither is measured over its whole window (`steps` is then 0).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .analyses.base import num
from .step_windows import PROFILER_STEP, step_windows

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["measure", "HOST_READ_OPS", "HOST_COPY_OPS", "SYNC_CALLS", "PROFILE_LIMIT"]

HOST_READ_OPS = ("aten::item", "aten::_local_scalar_dense")
HOST_COPY_OPS = ("aten::_to_copy", "aten::copy_")
#: operators a program-level copy runs inside (`t.to(...)` -> aten::to -> aten::_to_copy -> aten::copy_)
_COPY_ENTRY_OPS = ("aten::to", *HOST_COPY_OPS)
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
_MEMCPY_CALLS = ("cudaMemcpy", "cudaMemcpyAsync", "cudaMemcpy2D", "cudaMemcpy2DAsync")
_DATALOADER = re.compile(r"^enumerate\(DataLoader\)#.*\.__next__$")
_STEP_SITE = re.compile(r"#\d+$")
PROFILE_LIMIT = 200       # profile rows kept per rank (largest first): bounds summary.json
_TOP_SITES = 5
_SITE_SAMPLE = 2000       # host-blocking events attributed to a call site (the rest are still timed)


@dataclass(frozen=True)
class _Cats:
    cpu_op: int | None
    annotation: int | None
    runtime: int | None
    memcpy: int | None
    kernel: int | None
    python: int | None


def measure(trace: Any, gpu_ranks: tuple[int, ...], first_steps: dict[int, int | None] | None = None) -> dict[str, Any]:
    """{"per_rank": [...]} for every rank of an HTA `Trace` (`ta.t`); `first_steps`: per rank, the
    manifest's first optimizer step of the trace, where the capture has one (numbers the steps)."""
    names = trace.symbol_table.get_sym_table()
    ids = trace.symbol_table.get_sym_id_map()
    cats = _Cats(ids.get("cpu_op"), ids.get("user_annotation"), ids.get("cuda_runtime"), ids.get("gpu_memcpy"),
                 ids.get("kernel"), ids.get("python_function"))
    return {"per_rank": [_rank(int(r), trace.get_trace(r), names, ids, cats, int(r) in gpu_ranks,
                               (first_steps or {}).get(int(r)))
                         for r in sorted(trace.get_ranks())]}


def _ids(ids: dict[str, int], wanted) -> list[int]:
    return [ids[n] for n in wanted if n in ids]


def _rank(rank: int, df: "pd.DataFrame", names: list[str], ids: dict[str, int], cats: _Cats, gpu: bool,
          first_step: int | None = None) -> dict:
    import pandas as pd

    df = df[df["dur"] >= 0].copy()
    df["end"] = df["ts"] + df["dur"]   # HTA's alignment shifts ts but leaves its own "end" column behind
    cpu = df[(df["stream"] < 0)]
    steps = step_windows(cpu, names, first_step)
    if len(steps):
        windows = steps.windows
        step_total = float(sum(e - s for s, e in windows))
    else:
        start, end = float(df["ts"].min()), float(df["end"].max())
        windows, step_total = [(start, end)], end - start
    n_steps = len(steps)

    read_ops = cpu[(cpu["cat"] == cats.cpu_op) & cpu["name"].isin(_ids(ids, HOST_READ_OPS))]
    blocking = [read_ops]
    if gpu:
        blocking.append(cpu[(cpu["cat"] == cats.runtime) & cpu["name"].isin(_ids(ids, SYNC_CALLS))])
        blocking.append(_dtoh_calls(df, names, ids, cats))
    else:
        blocking.append(_program_copies(cpu[cpu["cat"] == cats.cpu_op], ids))
    hb = _outermost(pd.concat(blocking))
    hb = _inside(hb, windows)
    loader_ids = [i for i, n in enumerate(names) if _DATALOADER.match(n)]
    loader = _inside(_outermost(cpu[cpu["name"].isin(loader_ids)]), windows)

    out: dict[str, Any] = {
        "rank": rank, "gpu": gpu, "steps": n_steps, "step_numbering": steps.numbering, "step_us": num(step_total),
        "step_mean_us": num(step_total / n_steps) if n_steps else None,
        "host_blocking": _amount(hb, step_total, n_steps) | {
            "by_name": _by_name(hb, names), "call_sites": _call_sites(hb, cpu, names, cats)},
        "input_wait": _amount(loader, step_total, n_steps),
        "kernel_us": None, "kernel_per_step_us": None, "gpu_idle_in_steps_pct": None,
        "profile_unit": "step" if n_steps else "second",
        "profile": _profile(cpu, df, names, cats, windows, n_steps if n_steps else step_total / 1e6, gpu),
    }
    if gpu:
        kernels = df[(df["stream"] >= 0) & (df["cat"] == cats.kernel)] if cats.kernel is not None else df.iloc[:0]
        k_in = _inside(kernels, windows)
        k_total = float(k_in["dur"].sum())
        out["kernel_us"] = num(k_total)
        out["kernel_per_step_us"] = num(k_total / n_steps) if n_steps else None
        busy = _union_clipped(df[(df["stream"] >= 0)], windows)
        out["gpu_idle_in_steps_pct"] = num(100.0 * (1 - busy / step_total)) if step_total > 0 else None
    return out


def _dtoh_calls(df: "pd.DataFrame", names: list[str], ids: dict[str, int], cats: _Cats) -> "pd.DataFrame":
    if cats.runtime is None or cats.memcpy is None:
        return df.iloc[:0]
    dtoh = {i for i, n in enumerate(names) if "DtoH" in n or "Device -> Pageable" in n or "Device -> Pinned" in n}
    copies = df[(df["cat"] == cats.memcpy) & df["name"].isin(dtoh) & (df["correlation"] >= 0)]
    calls = df[(df["cat"] == cats.runtime) & df["name"].isin(_ids(ids, _MEMCPY_CALLS))]
    return calls[calls["correlation"].isin(set(copies["correlation"].tolist()))]


def _program_copies(ops: "pd.DataFrame", ids: dict[str, int]) -> "pd.DataFrame":
    """The copy operators the program called itself: those not running inside another operator
    (only inside `aten::to` or another copy), found with one sweep per thread over a stack of open ops."""
    copy_ids, entry_ids = set(_ids(ids, HOST_COPY_OPS)), set(_ids(ids, _COPY_ENTRY_OPS))
    if not copy_ids or ops.empty:
        return ops.iloc[:0]
    ops = ops.sort_values(["tid", "ts", "dur"], ascending=[True, True, False])
    keep: list[bool] = []
    last_tid, stack = None, []            # stack: (end, is an entry op) of the ops still open
    for tid, ts, end, name in zip(ops["tid"].tolist(), ops["ts"].tolist(), ops["end"].tolist(),
                                  ops["name"].tolist()):
        if tid != last_tid:
            last_tid, stack = tid, []
        while stack and stack[-1][0] <= ts:
            stack.pop()
        keep.append(name in copy_ids and all(entry for _, entry in stack))
        stack.append((end, name in entry_ids))
    return ops[keep]


def _outermost(ev: "pd.DataFrame") -> "pd.DataFrame":
    """Drop matches nested inside another match on the same thread (they would count twice)."""
    if ev.empty:
        return ev
    ev = ev.sort_values(["tid", "ts", "dur"], ascending=[True, True, False])
    keep, last_tid, last_end = [], None, -1.0
    for tid, ts, end in zip(ev["tid"].tolist(), ev["ts"].tolist(), ev["end"].tolist()):
        if tid != last_tid:
            last_tid, last_end = tid, -1.0
        if ts >= last_end:
            keep.append(True)
            last_end = end
        else:
            keep.append(False)
    return ev[keep]


def _inside(ev: "pd.DataFrame", windows: list[tuple[float, float]]) -> "pd.DataFrame":
    if ev.empty:
        return ev
    mask = None
    for start, end in windows:
        m = (ev["ts"] >= start) & (ev["ts"] < end)
        mask = m if mask is None else (mask | m)
    return ev[mask]


def _union_clipped(ev: "pd.DataFrame", windows: list[tuple[float, float]]) -> float:
    total = 0.0
    for start, end in windows:
        spans = sorted((max(s, start), min(e, end)) for s, e in zip(ev["ts"].tolist(), ev["end"].tolist())
                       if e > start and s < end)
        cur_s = cur_e = None
        for s, e in spans:
            if cur_e is None or s > cur_e:
                if cur_e is not None:
                    total += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        if cur_e is not None:
            total += cur_e - cur_s
    return total


def _amount(ev: "pd.DataFrame", step_total: float, n_steps: int) -> dict[str, Any]:
    total = float(ev["dur"].sum()) if len(ev) else 0.0
    return {"events": int(len(ev)), "total_us": num(total),
            "per_step_us": num(total / n_steps) if n_steps else None,
            "share_pct": num(100.0 * total / step_total) if step_total > 0 else None}


def _by_name(ev: "pd.DataFrame", names: list[str]) -> list[dict[str, Any]]:
    if ev.empty:
        return []
    g = ev.groupby("name")["dur"].agg(["count", "sum"]).sort_values("sum", ascending=False)
    return [{"name": names[int(i)], "count": int(r["count"]), "total_us": num(r["sum"])} for i, r in g.iterrows()]


def _call_sites(ev: "pd.DataFrame", cpu: "pd.DataFrame", names: list[str], cats: _Cats) -> list[dict[str, Any]]:
    """Group matches by their enclosing frames, innermost first: Python frames when the capture
    recorded stacks (`python_function`), else the enclosing operators and annotations."""
    if ev.empty:
        return []
    sites: dict[str, list[float]] = {}
    frames = cpu[cpu["cat"].isin([c for c in (cats.cpu_op, cats.annotation, cats.python) if c is not None])]
    by_tid = {tid: g for tid, g in frames.groupby("tid")}
    for row in ev.head(_SITE_SAMPLE).itertuples(index=False):
        g = by_tid.get(row.tid)
        chain: list[str] = []
        if g is not None:
            outer = g[(g["ts"] <= row.ts) & (g["end"] >= row.end) & (g["dur"] > row.dur)]
            if len(outer):
                inner_first = outer.sort_values("dur")
                py = inner_first[inner_first["cat"] == cats.python] if cats.python is not None else inner_first.iloc[:0]
                pick = py if len(py) else inner_first
                chain = [_STEP_SITE.sub("", names[int(n)]) for n in pick["name"].head(3).tolist()]
        key = " ← ".join([names[int(row.name)]] + chain)
        s = sites.setdefault(key, [0, 0.0])
        s[0] += 1
        s[1] += float(row.dur)
    top = sorted(sites.items(), key=lambda kv: -kv[1][1])[:_TOP_SITES]
    return [{"site": k, "count": int(v[0]), "total_us": num(v[1])} for k, v in top]


def _profile(cpu: "pd.DataFrame", df: "pd.DataFrame", names: list[str], cats: _Cats,
             windows: list[tuple[float, float]], units: float, gpu: bool) -> list[dict]:
    """Time and calls per unit (step, or second of trace window) for every operator, annotation and
    kernel inside the windows: what a later capture of the same job is compared with."""
    rows: list[dict] = []
    if units <= 0:
        return rows
    parts = [("cpu_op", cpu[cpu["cat"] == cats.cpu_op]), ("user_annotation", cpu[cpu["cat"] == cats.annotation])]
    if gpu and cats.kernel is not None:
        parts.append(("kernel", df[(df["stream"] >= 0) & (df["cat"] == cats.kernel)]))
    for kind, part in parts:
        part = _inside(part, windows)
        if part.empty:
            continue
        g = part.groupby("name")["dur"].agg(["count", "sum"])
        for i, r in g.iterrows():
            name = names[int(i)]
            if kind == "user_annotation" and PROFILER_STEP.match(name):
                continue
            rows.append({"kind": kind, "name": name, "calls": num(r["count"] / units),
                         "us": num(r["sum"] / units)})
    rows.sort(key=lambda r: (-(r["us"] or 0), r["kind"], r["name"]))  # ties: one order whatever the symbol ids
    return rows[:PROFILE_LIMIT]
