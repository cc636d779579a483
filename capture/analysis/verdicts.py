"""Judge the alert's diagnosis against the trace: supported, not supported, or inconclusive, and why.

Input is only JSON already in summary.json (the capture's reason, the per-rank evidence from
`evidence.measure`, and optionally the job's baseline evidence), so the judgement is reproducible
from the summary alone. Every diagnosis is checked on every capture (the report leads with the one
the alert named): that is also what makes a control possible, e.g. the host_sync check on an
input_starvation capture. Thresholds are module constants, documented in docs/analysis.md.

Evidence that cannot exist in the trace (GPU events on a CPU-only capture) is listed under
`cannot_see` and never reported as a zero.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SUPPORTED", "NOT_SUPPORTED", "INCONCLUSIVE", "DIAGNOSES", "judge", "regressions"]

SUPPORTED, NOT_SUPPORTED, INCONCLUSIVE = "supported", "not_supported", "inconclusive"
DIAGNOSES = ("host_sync", "input_starvation", "noisy_neighbor", "device_slowdown", "unclassified")

HOST_SYNC_SUPPORTED_PCT = 5.0      # host-blocking share of step time at or above: supported
HOST_SYNC_ABSENT_PCT = 1.0         # below: not supported
INPUT_SUPPORTED_PCT = 50.0         # data-loader wait share without a baseline
INPUT_ABSENT_PCT = 10.0
INPUT_GROWTH = 1.5                 # with a baseline: wait per step grew at least this much ...
INPUT_MIN_PCT = 20.0               # ... and is at least this share of the step
NO_GROWTH = 1.2                    # below this ratio to the baseline: nothing changed
KERNEL_GROWTH = 1.2                # kernel time per step vs baseline: supported at or above
KERNEL_SAME = 1.05                 # below: not supported
TOP_REGRESSIONS = 10

_GPU_ONLY_SYNC = ["CUDA synchronising calls (cudaStreamSynchronize, cudaDeviceSynchronize, cudaEventSynchronize)",
                  "device-to-host cudaMemcpy calls"]
_GPU_IDLE = ["GPU idle time between steps"]
_KERNELS = ["GPU kernel time per step"]


def _rank_with_max(evidence: list[dict], key) -> dict | None:
    rows = [r for r in evidence if key(r) is not None]
    return max(rows, key=key) if rows else None


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{v:.1f} %"


def _ms(us: float | None) -> str:
    return "—" if us is None else f"{us / 1000:.2f} ms"


def _unit(r: dict) -> str:
    return "per step" if r["steps"] else "of the trace window (no ProfilerStep#N markers, fewer than two optimizer steps)"


def _base_rank(baseline: list[dict] | None, rank: int) -> dict | None:
    if not baseline:
        return None
    return next((b for b in baseline if b["rank"] == rank), None)


def _ratio(cur: float | None, base: float | None) -> float | None:
    if cur is None or base is None or base <= 0:
        return None
    return round(cur / base, 3)


def _check(verdict: str, why: str, numbers: dict, cannot_see: list[str], rank: int | None) -> dict[str, Any]:
    return {"verdict": verdict, "why": why, "rank": rank, "numbers": numbers, "cannot_see": cannot_see}


def _host_sync(ev: list[dict], baseline: list[dict] | None, cpu_only: bool) -> dict[str, Any]:
    cannot = list(_GPU_ONLY_SYNC) if cpu_only else []
    r = _rank_with_max(ev, lambda x: x["host_blocking"]["share_pct"])
    if r is None:
        return _check(INCONCLUSIVE, "no rank has a time window to measure host-blocking work in", {}, cannot, None)
    hb = r["host_blocking"]
    b = _base_rank(baseline, r["rank"])
    numbers = {"share_pct": hb["share_pct"], "per_step_us": hb["per_step_us"], "total_us": hb["total_us"],
               "events": hb["events"], "steps": r["steps"], "step_mean_us": r["step_mean_us"],
               "by_name": hb["by_name"][:5], "call_sites": hb["call_sites"],
               "baseline_per_step_us": b["host_blocking"]["per_step_us"] if b else None,
               "baseline_share_pct": b["host_blocking"]["share_pct"] if b else None}
    seen = "host reads (aten::item, aten::_local_scalar_dense) and copies" + (
        " (CPU-only trace: every copy is to the host)" if cpu_only else
        ", CUDA synchronising calls and device-to-host memcpy calls")
    where = f"rank {r['rank']}: {_pct(hb['share_pct'])} of step time ({_ms(hb['per_step_us'])} {_unit(r)}) " \
            f"in {hb['events']} host-blocking calls"
    share = hb["share_pct"]
    if share >= HOST_SYNC_SUPPORTED_PCT:
        top = hb["call_sites"][0]["site"] if hb["call_sites"] else hb["by_name"][0]["name"]
        return _check(SUPPORTED, f"{where}, at least {HOST_SYNC_SUPPORTED_PCT:g} %; largest: {top}", numbers, cannot,
                      r["rank"])
    if share < HOST_SYNC_ABSENT_PCT:
        return _check(NOT_SUPPORTED, f"{where}, under {HOST_SYNC_ABSENT_PCT:g} % (counted: {seen})", numbers, cannot,
                      r["rank"])
    return _check(INCONCLUSIVE, f"{where}: between {HOST_SYNC_ABSENT_PCT:g} % and {HOST_SYNC_SUPPORTED_PCT:g} %",
                  numbers, cannot, r["rank"])


def _input(ev: list[dict], baseline: list[dict] | None, cpu_only: bool) -> dict[str, Any]:
    cannot = list(_GPU_IDLE) if cpu_only else []
    r = _rank_with_max(ev, lambda x: x["input_wait"]["share_pct"] if x["input_wait"]["events"] else None)
    if r is None:
        return _check(INCONCLUSIVE, "no DataLoader __next__ spans in the trace: the job does not load data through "
                                    "torch.utils.data.DataLoader, or user_annotation events were not captured",
                      {}, cannot, None)
    w = r["input_wait"]
    b = _base_rank(baseline, r["rank"])
    b_wait = b["input_wait"]["per_step_us"] if b and b["input_wait"]["events"] else None
    growth = _ratio(w["per_step_us"], b_wait)
    idle = [x["gpu_idle_in_steps_pct"] for x in ev if x["gpu_idle_in_steps_pct"] is not None]
    numbers = {"share_pct": w["share_pct"], "per_step_us": w["per_step_us"], "spans": w["events"],
               "steps": r["steps"], "step_mean_us": r["step_mean_us"], "baseline_per_step_us": b_wait,
               "growth": growth, "gpu_idle_in_steps_pct": max(idle) if idle else None}
    where = f"rank {r['rank']}: {_pct(w['share_pct'])} of step time waiting for the data loader " \
            f"({_ms(w['per_step_us'])} {_unit(r)})"
    share = w["share_pct"]
    if growth is not None:
        where += f", {growth:.2f}x the baseline's {_ms(b_wait)}"
        if growth >= INPUT_GROWTH and share >= INPUT_MIN_PCT:
            return _check(SUPPORTED, where, numbers, cannot, r["rank"])
        if growth < NO_GROWTH or share < INPUT_ABSENT_PCT:
            return _check(NOT_SUPPORTED, where + ": no more waiting than when healthy", numbers, cannot, r["rank"])
        return _check(INCONCLUSIVE, where, numbers, cannot, r["rank"])
    if share >= INPUT_SUPPORTED_PCT:
        return _check(SUPPORTED, f"{where}, at least {INPUT_SUPPORTED_PCT:g} % (no baseline to compare)", numbers,
                      cannot, r["rank"])
    if share < INPUT_ABSENT_PCT:
        return _check(NOT_SUPPORTED, f"{where}, under {INPUT_ABSENT_PCT:g} %", numbers, cannot, r["rank"])
    return _check(INCONCLUSIVE, f"{where}; without a baseline this share alone does not decide", numbers, cannot,
                  r["rank"])


def _kernels(ev: list[dict], baseline: list[dict] | None, cpu_only: bool, what: str) -> dict[str, Any]:
    if cpu_only:
        return _check(INCONCLUSIVE, f"CPU-only trace: kernel time, the evidence for {what}, cannot exist without "
                                    "GPU events", {}, list(_KERNELS), None)
    if not baseline:
        return _check(INCONCLUSIVE, f"no baseline capture of this job: {what} shows as kernel time per step "
                                    "against a healthy capture", {}, [], None)
    best = None
    for r in ev:
        b = _base_rank(baseline, r["rank"])
        g = _ratio(r["kernel_per_step_us"], b["kernel_per_step_us"] if b else None)
        if g is not None and (best is None or g > best[0]):
            best = (g, r, b)
    if best is None:
        return _check(INCONCLUSIVE, "kernel time per step could not be compared (no steps, or no kernels, in this "
                                    "capture or the baseline)", {}, [], None)
    g, r, b = best
    numbers = {"kernel_per_step_us": r["kernel_per_step_us"], "baseline_kernel_per_step_us": b["kernel_per_step_us"],
               "growth": g, "steps": r["steps"]}
    where = f"rank {r['rank']}: kernel time {_ms(r['kernel_per_step_us'])} per step, {g:.2f}x the baseline's " \
            f"{_ms(b['kernel_per_step_us'])}"
    if g >= KERNEL_GROWTH:
        return _check(SUPPORTED, where, numbers, [], r["rank"])
    if g < KERNEL_SAME:
        return _check(NOT_SUPPORTED, where + ": the same kernels take as long as when healthy", numbers, [], r["rank"])
    return _check(INCONCLUSIVE, where, numbers, [], r["rank"])


def _own_ops(r: dict) -> dict[str, dict]:
    return {p["name"]: p for p in r["profile"] if p["kind"] == "cpu_op" and p["calls"] and p["us"] is not None}


def _against_peer(r: dict, b: dict) -> tuple[float, float | None, float | None] | None:
    """(slowdown, own-work factor) of a replica's rank against its peer's, over the operators both
    ran: slowdown is its step time over the peer's, or without steps how many fewer operator calls
    per second it made; own-work is the median over those operators of its time per call over the
    peer's (None when no operator is on both sides); busy is the share of the peer's time those
    operators take (nested ones counted again: an overestimate, so it errs against "outside")."""
    mine, theirs = _own_ops(r), _own_ops(b)
    both = [n for n in mine if n in theirs]
    if r["steps"] and b["steps"]:
        slowdown = _ratio(r["step_mean_us"], b["step_mean_us"])
    elif r["profile_unit"] == b["profile_unit"] == "second" and both:
        slowdown = _ratio(sum(theirs[n]["calls"] for n in both), sum(mine[n]["calls"] for n in both))
    else:
        slowdown = None
    if slowdown is None:
        return None
    ratios = sorted((mine[n]["us"] / mine[n]["calls"]) / (theirs[n]["us"] / theirs[n]["calls"])
                    for n in both if theirs[n]["us"])
    # the median operator: one operator the scheduler preempted (tens of microseconds each) must not decide
    own = (ratios[(len(ratios) - 1) // 2] + ratios[len(ratios) // 2]) / 2 if ratios else None
    per = b["step_mean_us"] if b["profile_unit"] == "step" else 1e6     # profile values: per step or per second
    busy = min(1.0, sum(theirs[n]["us"] for n in both) / per) if per else None
    return slowdown, None if own is None else round(own, 3), None if busy is None else round(busy, 4)


def _outside_own_work(ev: list[dict], peer: list[dict], what: str) -> dict[str, Any]:
    """A CPU-only trace of a serving replica with its healthy peer in the same window (issue 30):
    kernel time cannot be seen, but where the cause lies can. A neighbour on the replica's GPU (or
    a slower GPU) makes it wait on the device: it gets less done than the peer while each of its own
    operators takes as long per call as the peer's, and neither host-blocking work nor data-loader
    waits take a larger share than on the peer (those would be its own code's doing)."""
    best = None
    for r in ev:
        b = _base_rank(peer, r["rank"])
        found = _against_peer(r, b) if b else None
        if found is not None and (best is None or found[0] > best[0][0]):
            best = (found, r, b)
    if best is None:
        return _check(INCONCLUSIVE, f"CPU-only trace: {what} shows as slower work than the healthy peer's, and no "
                                    "rank could be compared with the peer (no operators on both sides)", {},
                      list(_KERNELS), None)
    (slowdown, own, busy), r, b = best
    hb = round(r["host_blocking"]["share_pct"] - b["host_blocking"]["share_pct"], 3) \
        if r["host_blocking"]["share_pct"] is not None and b["host_blocking"]["share_pct"] is not None else None
    iw = round(r["input_wait"]["share_pct"] - b["input_wait"]["share_pct"], 3) \
        if r["input_wait"]["share_pct"] is not None and b["input_wait"]["share_pct"] is not None else None
    numbers = {"slowdown": slowdown, "own_per_call": own, "host_blocking_share_delta_pct": hb,
               "input_wait_share_delta_pct": iw, "steps": r["steps"], "unit": r["profile_unit"]}
    pace = "step time" if r["steps"] and b["steps"] else "operator calls per second"
    where = (f"rank {r['rank']}: {slowdown:.2f}x slower than its healthy peer (by {pace}, same window)"
             + (f", its own operators {own:.2f}x as long per call" if own is not None else ""))
    if slowdown < KERNEL_SAME:
        return _check(NOT_SUPPORTED, where + ": it gets as much done as the peer", numbers, list(_KERNELS), r["rank"])
    # slower own operators can explain at most what they add to the peer's pace (Amdahl): busy share
    # x (own - 1). What is left is lost outside them. A replica that idles longer between requests runs
    # its microsecond operators on colder caches (measured 1.2x to 2.3x per call behind a 60 ms device
    # wait, run to run), so their per-call ratio alone must not decide
    explained = 1 + (busy or 0.0) * max(0.0, own - 1) if own is not None else None
    outside = round(slowdown / explained, 3) if explained else None
    numbers.update(peer_busy_share=busy, explained_by_own_work=None if explained is None else round(explained, 3),
                   lost_outside_own_work=outside)
    if slowdown >= KERNEL_GROWTH and outside is not None and outside >= KERNEL_GROWTH \
            and (hb or 0) < HOST_SYNC_SUPPORTED_PCT and (iw or 0) < INPUT_MIN_PCT:
        return _check(SUPPORTED, where + f": the time is lost outside its own work, waiting on the device, as "
                                         f"{what} makes it (CPU-only trace: the kernels themselves are not visible)",
                      numbers, list(_KERNELS), r["rank"])
    return _check(INCONCLUSIVE, where + (f"; host-blocking share +{hb:.1f} points" if hb else "")
                  + (f"; data-loader share +{iw:.1f} points" if iw else "")
                  + ": not clearly lost outside its own work", numbers, list(_KERNELS), r["rank"])


def regressions(ev: list[dict], baseline: list[dict] | None) -> list[dict[str, Any]]:
    """The largest increases per operator/kernel against the baseline, per rank (same unit only)."""
    out = []
    for r in ev:
        b = _base_rank(baseline, r["rank"])
        if b is None or b["profile_unit"] != r["profile_unit"]:
            continue
        base = {(p["kind"], p["name"]): p for p in b["profile"]}
        for p in r["profile"]:
            q = base.get((p["kind"], p["name"]))
            before = q["us"] if q else 0.0
            delta = (p["us"] or 0.0) - (before or 0.0)
            if delta > 0:
                out.append({"rank": r["rank"], "kind": p["kind"], "name": p["name"], "unit": r["profile_unit"],
                            "us": p["us"], "baseline_us": before, "delta_us": round(delta, 3),
                            "calls": p["calls"], "baseline_calls": q["calls"] if q else 0.0,
                            "ratio": _ratio(p["us"], before)})
    out.sort(key=lambda x: -x["delta_us"])
    return out[:TOP_REGRESSIONS]


def _unclassified(regs: list[dict], baseline: list[dict] | None) -> dict[str, Any]:
    if not baseline:
        return _check(INCONCLUSIVE, "no baseline capture of this job to compare with", {}, [], None)
    if not regs:
        return _check(NOT_SUPPORTED, "no operator or kernel takes longer than in the baseline", {"regressions": []},
                      [], None)
    top = regs[0]
    return _check(INCONCLUSIVE, f"no single cause is diagnosed; largest change: {top['kind']} {top['name']} on rank "
                                f"{top['rank']}, +{_ms(top['delta_us'])} per {top['unit']}",
                  {"regressions": regs[:3]}, [], top["rank"])


def judge(reason: dict | None, evidence: list[dict], trace_kind: str | None,
          baseline: dict[str, Any] | None) -> dict[str, Any]:
    """The summary's `verdict` object. `baseline`: {"capture_id", "summary_uri", "evidence"} or None."""
    reason = reason or {}
    alert = None
    if reason.get("kind") == "alert":
        alert = {k: reason.get(k) for k in ("alertname", "diagnosis", "workload", "starts_at", "text")}
    diagnosis = reason.get("diagnosis")
    cpu_only = trace_kind == "cpu_only"
    base_ev = baseline["evidence"] if baseline else None
    regs = regressions(evidence, base_ev)

    def device(what: str) -> dict[str, Any]:
        if cpu_only and base_ev and baseline.get("peer"):   # a serving replica against its peer, same window
            return _outside_own_work(evidence, base_ev, what)
        return _kernels(evidence, base_ev, cpu_only, what)

    checks = {
        "host_sync": _host_sync(evidence, base_ev, cpu_only),
        "input_starvation": _input(evidence, base_ev, cpu_only),
        "noisy_neighbor": device("a noisy neighbour (our kernels slowed by another's)"),
        "device_slowdown": device("a device slowdown"),
        "unclassified": _unclassified(regs, base_ev),
    }
    if diagnosis in checks:
        verdict, why = checks[diagnosis]["verdict"], checks[diagnosis]["why"]
    elif diagnosis:
        verdict, why = INCONCLUSIVE, f"gpulens has no trace check for diagnosis {diagnosis!r}"
    else:
        verdict, why = None, "no diagnosis to check (manual capture); every check is shown below"
    return {"alert": alert, "diagnosis": diagnosis, "verdict": verdict, "why": why, "trace_kind": trace_kind,
            "checks": checks,
            "baseline": {k: baseline[k] for k in ("capture_id", "summary_uri")} if baseline else None,
            "regressions": regs}
