"""Produce real traces of a real multi-rank torch job: DistributedDataParallel over gloo (CPU), one
process per rank, with torch.profiler's Kineto backend; one rank is slowed by its input pipeline.

Every step ends in DDP's gradient all-reduce, so the ranks stay in lock step: the fast ranks wait
for the slow one inside `gloo:all_reduce`, and all step times look alike. That is the case a
cross-rank straggler analysis must see through. The traces carry distributedInfo (rank, world
size) and ProfilerStep#1..N, as torch.profiler writes them.

With `plain`, the loop is one that never calls `prof.step()` (most training loops, and every loop an
on-demand capture reaches): the profiler runs across the steps with no schedule, so the trace holds
the optimizer's own `Optimizer.step#SGD.step` spans and no ProfilerStep#N marker at all.

    python ddp_traces.py OUT_DIR RANK WORLD_SIZE SLOW_RANK [plain]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

STEPS_ACTIVE = 5
SLOW_SAMPLE_S = 0.0025     # per sample, 32 samples a batch: ~80 ms more per step on the slow rank (at 0.8 ms,
                           # ~26 ms, CPU contention at load 12 made other ranks look 10 ms slow, over the tests' 1/4)


def main(out: Path, rank: int, world: int, slow_rank: int, plain: bool = False) -> None:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, schedule

    dist.init_process_group("gloo", init_method=(out / "rendezvous").resolve().as_uri(), rank=rank, world_size=world)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    class Samples(torch.utils.data.Dataset):
        def __len__(self):
            return 1 << 20

        def __getitem__(self, i):
            if rank == slow_rank:
                time.sleep(SLOW_SAMPLE_S)  # a slow input pipeline on this rank only
            return torch.randn(64), i % 10

    batches = iter(torch.utils.data.DataLoader(Samples(), batch_size=32))

    def step():
        x, y = next(batches)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(3):
        step()
    path = out / f"rank-{rank}.json"
    if plain:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(STEPS_ACTIVE + 1):
                step()
        prof.export_chrome_trace(str(path))
        dist.barrier()
        dist.destroy_process_group()
        return
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=STEPS_ACTIVE, repeat=1),
                 on_trace_ready=lambda p: p.export_chrome_trace(str(path))) as prof:
        for _ in range(STEPS_ACTIVE + 2):
            step()
            prof.step()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:] == ["plain"])
