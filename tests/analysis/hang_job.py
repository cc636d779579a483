"""A two-rank gloo job that hangs the way real ones do, for the hang analysis (issue 45).

    torchrun --nproc-per-node=2 hang_job.py OUT MODE

Ten all_reduce calls; at the sixth (collective_seq_id 6):
- `skip`: rank 1 never enters it (it sleeps): rank 0 waits in it;
- `mismatch`: rank 1 calls all_gather where rank 0 calls all_reduce;
- `spin`: rank 1 spins in `spin_holding_the_gil` (a C loop under one Python call: it never lets
  the GIL go, so no other thread of that process runs, the hook's dump thread included).
Each rank prints `rank R pid P at 5` before its sixth call. Nothing here dumps anything: the
trainer hook (on PYTHONPATH, armed by the test's environment) registered each rank when its
process group formed and listens for the agent's request (hooks/site/_gpulens_flight.py), which
the test sends while the main thread is blocked, as the agent would.
"""

import os
import sys
import time


def spin_holding_the_gil() -> int:
    return sum(range(10**15))


def main(out: str, mode: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = torch.ones(8)
    for i in range(10):
        if i == 5:
            print(f"rank {rank} pid {os.getpid()} at 5", flush=True)
            if mode == "skip" and rank == 1:
                time.sleep(600)
            if mode == "spin" and rank == 1:
                spin_holding_the_gil()
            if mode == "mismatch" and rank == 1:
                dist.all_gather([torch.zeros(8) for _ in range(2)], t)
                continue
        dist.all_reduce(t)
    time.sleep(600)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
