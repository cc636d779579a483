"""A two-rank (gloo) CPU training loop that steps a torch.optim optimizer, for iteration captures.

    torchrun --nproc-per-node=2 stepping_trainer.py STOP_FILE PAUSE_FILE MAX_SECONDS

Every step is `ProfilerStep#N` (N = optimizer steps taken so far, which is what Kineto counts) and
ends with an all_reduce, so the ranks stay in lockstep. While PAUSE_FILE exists the ranks stop
stepping together, at the same N (rank 0 decides, the decision is all_reduced): a test can then
let Kineto on both ranks fetch a config while neither steps, so both handle it at the same count.
Each rank writes its step count to `<PAUSE_FILE>.<rank>` when it pauses, and creates
`<PAUSE_FILE>.started.<rank>` after its 20th step.
"""

import os
import sys
import time


def main(stop_file: str, pause_file: str, max_s: float) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.nn.Linear(32, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(16, 32)
    print(f"ready {os.getpid()}", flush=True)
    end, step = time.time() + max_s, 0
    while True:
        flags = torch.tensor([float(os.path.exists(stop_file) or time.time() > end), float(os.path.exists(pause_file))])
        dist.all_reduce(flags)            # rank 0's view would do; the sum keeps both ranks' decision equal
        if flags[0] > 0:
            break
        if flags[1] > 0:
            with open(f"{pause_file}.{rank}", "w") as f:
                f.write(str(step))
            time.sleep(0.05)
            continue
        with torch.profiler.record_function(f"ProfilerStep#{step}"):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        step += 1
        if step == 20:                    # Kineto has counted steps: iteration requests apply from now on
            with open(f"{pause_file}.started.{rank}", "w") as f:
                f.write(str(step))
        time.sleep(0.01)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
