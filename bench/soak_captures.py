"""Capture after capture: N captures back to back on a real 4-rank torch job over two node agents.

    .venv/bin/python bench/soak_captures.py [--captures 50] [--trigger builtin|dynolog|both] [--step-s 0.02 ...]

Prints, per trigger, the success rate (fully archived captures), the failures by reason, the
iteration captures' alignment, trace files left on the nodes, "Failed to open" lines in the
trainers' logs, and the median / max seconds per capture (iteration captures and wall-clock
windows apart). Recorded in BENCHMARKS.md ("Capture after capture").
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.coordinator.soak import Soak  # noqa: E402


async def one(trigger: str, n: int, keep: bool, step_s: float) -> None:
    async with Soak(trigger=trigger, keep=keep, step_s=step_s) as soak:
        rate = await soak.step_rate()
        results = await soak.run(n)
        loose = await soak.settled()
        opened = [line for node in soak.nodes for line in node.failed_to_open()]
        refused = len(soak.refused_while_running)
        explained = soak.explain(results)
    reasons = Counter(t["reason"] for r in results for t in r.targets.values() if t["state"] != "archived")
    iters = [r for r in results if r.kind == "iterations"]
    aligned = sum(1 for r in iters if r.fully_archived and r.misaligned() is None)
    print(f"\n== trigger {trigger}: {n} captures (4 ranks, 2 agents), {step_s} s sleep a step: {rate:.1f} steps/s"
          + (f", kept in {soak.base}" if keep else ""))
    print(f"fully archived        {sum(r.fully_archived for r in results)}/{n}")
    print(f"failed targets        {dict(reasons) or 'none'}")
    print(f"unproven failures     {sum(len(r.unproven()) for r in results)}")
    print(f"iteration captures    {len(iters)}, aligned on all ranks {aligned}")
    print(f"refused while running {refused} (409 naming the holder)")
    print(f"traces left on nodes  {len(loose)}")
    print(f"'Failed to open'      {len(opened)}")
    for kind in ("iterations", "window"):
        secs = [r.seconds for r in results if r.kind == kind]
        if secs:
            print(f"seconds per capture   {kind:10s} median {statistics.median(secs):5.1f}  max {max(secs):5.1f}")
    # issue 47: how far each wall capture's ranks started from the chosen instant, and from each other
    wins = [[t["window"] for t in r.targets.values() if t["state"] == "archived" and t.get("window")]
            for r in results if r.kind == "window"]
    skews = [w["start_skew_s"] for ws in wins for w in ws if "start_skew_s" in w]
    spreads = [max(w["start"] for w in ws) - min(w["start"] for w in ws) for ws in wins if len(ws) > 1]
    late = sum(1 for ws in wins for w in ws if w.get("late_start"))
    if skews:
        print(f"wall start skew (s)   median {statistics.median(skews):5.2f}  max {max(skews):5.2f}  "
              f"(rank start - chosen instant; {late} late starts)")
    if spreads:
        print(f"wall start spread (s) median {statistics.median(spreads):5.2f}  max {max(spreads):5.2f}  "
              f"(latest - earliest rank start per capture)")
    for line in explained:                # what the nodes saw of each unproven failure
        print(f"  unproven: {line}")
    for i, r in enumerate(results):       # every capture not fully archived, with its evidence
        if not r.fully_archived or r.misaligned():
            print(f"  #{i} {r.kind} {r.capture_id} phase={r.phase} start={r.start_iteration} {r.seconds:.1f}s"
                  + (f" misaligned: {r.misaligned()}" if r.misaligned() else ""))
            for tid, t in sorted(r.targets.items()):
                if t["state"] != "archived":
                    print(f"      {tid}: {t['state']} {t['reason']}: {t['detail']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--captures", type=int, default=50)
    p.add_argument("--trigger", choices=["builtin", "dynolog", "both"], default="both")
    p.add_argument("--keep", action="store_true", help="keep the nodes' logs, registries and agent state")
    p.add_argument("--step-s", type=float, nargs="+", default=[0.02],
                   help="the trainers' sleep per step, one run per value (0.02: ~40 steps/s; 0.25: ~4)")
    a = p.parse_args()
    for step_s in a.step_s:
        for trigger in (["builtin", "dynolog"] if a.trigger == "both" else [a.trigger]):
            asyncio.run(one(trigger, a.captures, a.keep, step_s))


if __name__ == "__main__":
    main()
