"""Produce real PyTorch (CPU) Kineto traces for one pretend rank: run as a script, one process per rank.

Two traces per rank, both written by torch.profiler's Kineto backend:
- `stepped-rank<R>.json`: a schedule with ProfilerStep#1..4 annotations (iteration analyses apply);
- `ondemand-rank<R>.json`: a plain profiling window without steps, like a dynolog on-demand trace.
No torch.distributed, so neither has distributedInfo, exactly like on-demand traces. Rank R does
(R + 1)**2 times the matrix work of rank 0 per step, so higher ranks are measurably slower.

    python torch_traces.py OUT_DIR RANK
"""

from __future__ import annotations

import sys
from pathlib import Path

STEPS_ACTIVE = 4


def main(out: Path, rank: int) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    torch.manual_seed(rank)
    torch.set_num_threads(1)
    width = 64 * (rank + 1)
    model = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.ReLU(), torch.nn.Linear(4 * width, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(256, width), torch.randint(0, 10, (256,))

    def step():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()

    for _ in range(3):  # warm up allocator and kernels outside the profile
        step()
    stepped = out / f"stepped-rank{rank}.json"
    with profile(activities=[ProfilerActivity.CPU],
                 schedule=schedule(wait=0, warmup=1, active=STEPS_ACTIVE, repeat=1),
                 on_trace_ready=lambda p: p.export_chrome_trace(str(stepped))) as prof:
        for _ in range(STEPS_ACTIVE + 2):
            step()
            prof.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            step()
    prof.export_chrome_trace(str(out / f"ondemand-rank{rank}.json"))


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
