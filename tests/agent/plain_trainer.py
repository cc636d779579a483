"""A plain DDP-style CPU training loop: no torch.profiler, no markers, just `optimizer.step()`.

    torchrun --nproc-per-node=N plain_trainer.py STOP_FILE MAX_SECONDS [SLOW_RANK SLOW_S [STEP_S]]

Each step ends with a gloo all_reduce, so the ranks stay in lockstep as DDP ranks do. This is the
common loop issue 31 describes: the iterations a capture covers must be known without it.
SLOW_RANK sleeps SLOW_S more per step before the collective (a straggler). STEP_S (0.02) is each
step's sleep, the loop's pace: 0.02 gives ~40 steps/s here, 0.25 about 4 (issue 47's rates). With
GPULENS_TRAINER_DEVICE=cuda the model runs on the GPU (the collective stays on gloo, CPU tensors:
two ranks may share one GPU), for bench/gpu_capture_check.py.
"""

import os
import sys
import time


def main(stop_file: str, max_s: float, slow_rank: int, slow_s: float, step_s: float = 0.02) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    device = os.environ.get("GPULENS_TRAINER_DEVICE", "cpu")
    width = 1024 if device == "cuda" else 32
    model = torch.nn.Linear(width, width).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(16, width, device=device)
    print(f"ready {os.getpid()} rank {rank}", flush=True)
    end = time.time() + max_s
    while True:
        flag = torch.tensor([float(os.path.exists(stop_file) or time.time() > end)])
        dist.all_reduce(flag)
        if flag[0] > 0:
            break
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        time.sleep(step_s + (slow_s if rank == slow_rank else 0.0))
    dist.destroy_process_group()


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0], float(args[1]), int(args[2]) if len(args) > 2 else -1, float(args[3]) if len(args) > 3 else 0.0,
         float(args[4]) if len(args) > 4 else 0.02)
