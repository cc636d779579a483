"""Stragglers across ranks: which ranks hold the others back, by how much, how often, and what
differs in their evidence. Works on CPU-only traces (HTA's straggler metric needs NCCL kernels).

In a synchronous data-parallel job every rank's step takes about as long as the slowest rank's:
the fast ranks wait for it inside the collectives. So a rank's step time alone does not name the
straggler; its own work does: step time minus the time it spent inside collectives (the union of
the process group's `gloo:*` / `nccl:*` / ... spans on the CPU and NCCL kernels on the GPU, clipped
to the step). Without collectives (no synchronisation) that is simply the step time.

Map side (`rank_steps`, one rank's HTA frame, on its worker): per step (capture/analysis/step_windows.py:
`ProfilerStep#N` markers, else the spans between optimizer steps, which a plain loop's trace has), the
step time, the collective time and when the step ended. Steps numbered relatively (a wall-clock
capture of a loop without markers) are lined up across ranks by their end times, which a
synchronous job's collectives keep together. Reduce side (`stragglers`, JSON only): per iteration, each rank's own work
against the median of the other ranks'; a rank is slow in an iteration when it does more than
`SLOW_SHARE` of a step more; named when slow in at least one iteration, `consistent` when slow in
at least `CONSISTENT_SHARE` of them; then its evidence against the others' medians.
"""

from __future__ import annotations

import re
import statistics
from typing import TYPE_CHECKING, Any

from .analyses.base import num
from .step_windows import OPTIMIZER, PROFILER, RELATIVE, step_windows

if TYPE_CHECKING:
    from hta.common.trace import Trace

__all__ = ["rank_steps", "stragglers", "COLLECTIVE", "SLOW_SHARE", "CONSISTENT_SHARE", "TOP_RANKS"]

#: the record_function names ProcessGroup backends give their collectives (gloo:all_reduce, nccl:broadcast, ...)
COLLECTIVE = re.compile(r"^(gloo|nccl|mpi|ucc|xccl|hccl):")
_COMM_KERNEL = re.compile(r"^nccl.*Kernel")
#: how far (in steps) relative numbering may be shifted to line a rank up with the first one
MAX_SHIFT = 8
SLOW_SHARE = 0.10          # own work longer than the others' median by this share of a step: slow
CONSISTENT_SHARE = 0.75    # slow in at least this share of the iterations: consistently
TOP_RANKS = 5
TOP_DIFFERENCES = 3


def rank_steps(trace: "Trace", first_optimizer_step: int | None = None) -> list[dict[str, Any]]:
    """[{"step", "numbering", "dur_us", "collective_us", "end_us"}] of the one rank in `trace`;
    `end_us` on the trace's own clock (HTA's aligned time plus its `min_ts`)."""
    rank = trace.get_ranks()[0]
    df = trace.get_trace(rank)
    names = trace.symbol_table.get_sym_table()
    coll_ids = [i for i, n in enumerate(names) if COLLECTIVE.match(n)]
    comm_ids = [i for i, n in enumerate(names) if _COMM_KERNEL.match(n)]
    steps = step_windows(df[df["stream"] < 0], names, first_optimizer_step)
    spans = df[(df["name"].isin(coll_ids) & (df["stream"] < 0)) | (df["name"].isin(comm_ids) & (df["stream"] >= 0))]
    pairs = sorted(zip(spans["ts"].tolist(), (spans["ts"] + spans["dur"]).tolist()))
    base = float(getattr(trace, "min_ts", 0) or 0)
    return [{"step": n, "numbering": steps.numbering, "dur_us": num(end - start),
             "collective_us": num(_union_within(pairs, start, end)), "end_us": num(base + end)}
            for n, start, end in steps.steps]


def _union_within(pairs: list[tuple[float, float]], start: float, end: float) -> float:
    total, cur_s, cur_e = 0.0, None, None
    for s, e in pairs:
        s, e = max(s, start), min(e, end)
        if e <= s:
            continue
        if cur_e is None or s > cur_e:
            total += 0.0 if cur_e is None else cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (0.0 if cur_e is None else cur_e - cur_s)


def stragglers(steps: dict[int, list[dict]], evidence: list[dict] | None) -> dict[str, Any]:
    """The summary's `cross_rank` section from each analysed rank's steps and evidence."""
    ranks = sorted(r for r, s in steps.items() if s)
    if len(ranks) < 2:
        return {"status": "not_applicable", "why": ("needs whole steps (ProfilerStep#N markers, or two optimizer "
                                                    f"steps) on two or more analysed ranks; {len(ranks)} rank(s) have them"),
                "iterations": [], "per_rank": [], "stragglers": []}
    steps, numbering = _numbered_alike({r: steps[r] for r in ranks})
    ranks = sorted(steps)       # a rank whose steps line up with no other's is left out
    if len(ranks) < 2:
        return {"status": "not_applicable", "why": "the analysed ranks' steps do not line up in time", "numbering": numbering,
                "iterations": [], "per_rank": [], "stragglers": []}
    own = {r: {s["step"]: ((s["dur_us"] or 0.0) - (s["collective_us"] or 0.0), s["dur_us"] or 0.0,
                           s["collective_us"] or 0.0) for s in steps[r]} for r in ranks}
    iterations = sorted(set.intersection(*(set(o) for o in own.values())))
    if not iterations:
        return {"status": "not_applicable", "why": "the analysed ranks share no iteration", "numbering": numbering,
                "iterations": [], "per_rank": [], "stragglers": []}
    ahead: dict[int, list[float]] = {r: [] for r in ranks}   # own work minus the others' median, per iteration
    slow_in: dict[int, list[int]] = {r: [] for r in ranks}
    for it in iterations:
        step_median = statistics.median(own[r][it][1] for r in ranks)
        for r in ranks:
            others = statistics.median(own[o][it][0] for o in ranks if o != r)
            delta = own[r][it][0] - others
            ahead[r].append(delta)
            if step_median > 0 and delta > SLOW_SHARE * step_median:
                slow_in[r].append(it)
    step_median = statistics.median(own[r][it][1] for r in ranks for it in iterations)
    per_rank = [{"rank": r, "step_median_us": num(statistics.median(own[r][it][1] for it in iterations)),
                 "own_work_median_us": num(statistics.median(own[r][it][0] for it in iterations)),
                 "collective_median_us": num(statistics.median(own[r][it][2] for it in iterations)),
                 "more_than_others_us": num(statistics.median(ahead[r])), "slow_iterations": slow_in[r]}
                for r in ranks]
    named = sorted((r for r in ranks if slow_in[r]), key=lambda r: -statistics.median(ahead[r]))[:TOP_RANKS]
    ev = {e["rank"]: e for e in (evidence or [])}
    found = []
    for r in named:
        extra = statistics.median(ahead[r])
        found.append({"rank": r, "more_us_per_step": num(extra),
                      "more_pct_of_step": num(100.0 * extra / step_median) if step_median > 0 else None,
                      "slow_iterations": len(slow_in[r]), "of_iterations": len(iterations),
                      "consistent": len(slow_in[r]) >= CONSISTENT_SHARE * len(iterations),
                      "differs": _differences(r, [o for o in ranks if o != r], ev)})
    if found:
        top = found[0]
        why = (f"rank {top['rank']} does {_ms(top['more_us_per_step'])} more work per step than the median of the "
               f"other ranks ({top['more_pct_of_step']:.0f} % of a step), in {top['slow_iterations']} of "
               f"{top['of_iterations']} iterations" + (" (consistently)" if top["consistent"] else "")
               + (f"; most different: {top['differs'][0]['what']}" if top["differs"] else ""))
    else:
        why = (f"no rank does more than {SLOW_SHARE:.0%} of a step more work than the others in any of "
               f"{len(iterations)} iterations")
    return {"status": "ok", "why": why, "numbering": numbering, "iterations": iterations, "per_rank": per_rank,
            "stragglers": found, "slow_share": SLOW_SHARE, "consistent_share": CONSISTENT_SHARE}


def _numbered_alike(steps: dict[int, list[dict]]) -> tuple[dict[int, list[dict]], str]:
    """Every rank's steps under one numbering. Ranks that all carry absolute numbers of one kind
    (ProfilerStep#N, or the capture's optimizer steps) keep them; otherwise each rank is numbered
    relatively and shifted onto the first rank's numbers where their step ends match best (the
    median distance between paired ends, over shifts of up to MAX_SHIFT steps): the collective at
    the end of every step of a synchronous job ends on all ranks at about the same time."""
    kinds = {s[0].get("numbering", PROFILER) for s in steps.values()}
    if len(kinds) == 1 and kinds <= {PROFILER, OPTIMIZER}:
        return steps, kinds.pop()
    ranks = sorted(steps)
    relative = {r: [dict(s, step=k) for k, s in enumerate(steps[r], start=1)] for r in ranks}
    ref = {s["step"]: s.get("end_us") for s in relative[ranks[0]]}
    out = {ranks[0]: relative[ranks[0]]}
    for r in ranks[1:]:
        best = None
        for shift in range(-MAX_SHIFT, MAX_SHIFT + 1):
            gaps = [abs(ref[s["step"] + shift] - s.get("end_us")) for s in relative[r]
                    if s["step"] + shift in ref and s.get("end_us") is not None and ref[s["step"] + shift] is not None]
            if gaps and (best is None or statistics.median(gaps) < best[0]):
                best = (statistics.median(gaps), shift)
        if best is not None:
            out[r] = [dict(s, step=s["step"] + best[1]) for s in relative[r]]
    return out, RELATIVE


def _ms(us: float | None) -> str:
    return "—" if us is None else f"{us / 1000:.2f} ms"


def _differences(rank: int, others: list[int], ev: dict[int, dict]) -> list[dict[str, Any]]:
    """This rank's evidence per step against the other ranks' median, largest increase first."""
    mine = ev.get(rank)
    if mine is None or not mine.get("steps"):
        return []
    rows = []
    measures = [("data-loader wait", lambda e: e["input_wait"]["per_step_us"]),
                ("host-blocking calls", lambda e: e["host_blocking"]["per_step_us"]),
                ("GPU kernel time", lambda e: e["kernel_per_step_us"])]
    for what, get in measures:
        values = [get(ev[o]) for o in others if o in ev and ev[o].get("steps") and get(ev[o]) is not None]
        if get(mine) is None or not values:
            continue
        rows.append({"what": what, "us_per_step": get(mine), "others_median_us": num(statistics.median(values)),
                     "delta_us": num(get(mine) - statistics.median(values))})
    if mine.get("profile_unit") == "step":
        theirs: dict[tuple[str, str], list[float]] = {}
        for o in others:
            if o in ev and ev[o].get("profile_unit") == "step":
                for p in ev[o]["profile"]:
                    theirs.setdefault((p["kind"], p["name"]), []).append(p["us"] or 0.0)
        n = sum(1 for o in others if o in ev and ev[o].get("profile_unit") == "step")
        for p in mine["profile"]:
            if COLLECTIVE.match(p["name"]):
                continue  # waiting for the others, not this rank's own work
            vals = theirs.get((p["kind"], p["name"]), []) + [0.0] * (n - len(theirs.get((p["kind"], p["name"]), [])))
            base = statistics.median(vals) if vals else 0.0
            rows.append({"what": f"{p['kind']} {p['name']}", "us_per_step": p["us"], "others_median_us": num(base),
                         "delta_us": num((p["us"] or 0.0) - base)})
    rows = [r for r in rows if (r["delta_us"] or 0) > 0]
    rows.sort(key=lambda r: -r["delta_us"])
    return rows[:TOP_DIFFERENCES]
