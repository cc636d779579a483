"""What the hook's step counter costs a training step (issue 34).

    .venv/bin/python bench/hook_steps.py [--steps 20000] [--repeats 7]

The hook registers one global optimizer post-step hook (hooks/site/_gpulens_steps.py) that copies
the Kineto step count and the time into a memory-mapped ring. This times `optimizer.step()` of a
tiny model (SGD over a 4x4 Linear: the smallest step, where the hook's share is largest) with no
extra hook, with an empty global post-hook (the price of any hook at all) and with the
publisher, in one process, interleaved, and prints medians of ns per step and the differences.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from gpulens.hooks import hook_path

sys.path.insert(0, str(hook_path()))

import torch  # noqa: E402
from torch.autograd.profiler import KinetoStepTracker  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_post_hook  # noqa: E402

from _gpulens_steps import StepPublisher  # noqa: E402


def per_step_ns(opt, steps: int) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(steps):
        opt.step()
    return (time.perf_counter_ns() - t0) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=20000)
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args()
    torch.set_num_threads(1)
    model = torch.nn.Linear(4, 4)
    for q in model.parameters():
        q.grad = torch.zeros_like(q)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    pub = StepPublisher(str(Path(tempfile.mkdtemp()) / "bench.steps"), KinetoStepTracker)
    results: dict[str, list[float]] = {"no hook": [], "empty hook": [], "step publisher": []}
    per_step_ns(opt, a.steps)                           # warm up
    for _ in range(a.repeats):
        results["no hook"].append(per_step_ns(opt, a.steps))
        h = register_optimizer_step_post_hook(lambda o, args, kw: None)
        results["empty hook"].append(per_step_ns(opt, a.steps))
        h.remove()
        h = register_optimizer_step_post_hook(pub.on_step)
        results["step publisher"].append(per_step_ns(opt, a.steps))
        h.remove()
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"torch {torch.__version__}, {a.steps} steps x {a.repeats} repeats, medians (ns per optimizer.step())")
    for k, v in med.items():
        print(f"  {k:15s} {v:9.0f}")
    print(f"  publisher - empty hook  {med['step publisher'] - med['empty hook']:7.0f} ns per step")
    print(f"  publisher - no hook     {med['step publisher'] - med['no hook']:7.0f} ns per step "
          f"({(med['step publisher'] / med['no hook'] - 1) * 100:.1f} % of the smallest step)")
    # the hook alone, called directly (the step's own noise hides a microsecond)
    def empty(o=None, args=None, kw=None) -> None:
        return None
    calls = {"empty function": [], "on_step": []}
    for _ in range(a.repeats):
        for name, fn in (("empty function", empty), ("on_step", pub.on_step)):
            t0 = time.perf_counter_ns()
            for _ in range(a.steps * 10):
                fn(opt, (), {})
            calls[name].append((time.perf_counter_ns() - t0) / (a.steps * 10))
    cm = {k: statistics.median(v) for k, v in calls.items()}
    print(f"  direct call: empty {cm['empty function']:.0f} ns, on_step {cm['on_step']:.0f} ns "
          f"(the publisher's own work: {cm['on_step'] - cm['empty function']:.0f} ns per step)")
    pub.close()


if __name__ == "__main__":
    main()
