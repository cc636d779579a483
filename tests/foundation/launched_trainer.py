"""The trainer every launcher test starts: forms the process group the way its launcher's users
do, proves it with an all_reduce, says `ready-<rank>-<pid>` in the output folder, then trains on
(sleeps) until the pod-equivalent process group is sent SIGTERM.

    launched_trainer.py MODE OUT_DIR
MODE: env (torchrun-style environment), accelerate, deepspeed, spawn (torch.multiprocessing.spawn
of 2), relaunch (Lightning-style: rank 0 re-runs this script for rank 1, then both init).
"""

import os
import subprocess
import sys
import time


def ready(out: str, rank: int) -> None:
    path = os.path.join(out, f"ready-{rank}-{os.getpid()}")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)
    while True:  # "training" until the pod is stopped
        time.sleep(0.2)


def all_reduce_check(dist) -> int:
    import torch

    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == dist.get_world_size(), t
    return dist.get_rank()


def spawned(index: int, port: str, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=index, world_size=2)
    ready(out, all_reduce_check(dist))


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # deepspeed's launcher adds it
    mode, out = args[0], args[1]
    if mode == "env":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        ready(out, all_reduce_check(dist))
    elif mode == "accelerate":
        from accelerate import Accelerator

        acc = Accelerator(cpu=True)
        if acc.num_processes > 1:
            import torch.distributed as dist

            all_reduce_check(dist)
        ready(out, acc.process_index)
    elif mode == "deepspeed":
        # deepspeed.init_distributed() on the CPU accelerator first JIT-compiles a C++ shared-memory
        # op (many minutes on a busy 2-core machine), then calls torch.distributed.init_process_group;
        # the trainer calls that itself, from the environment DeepSpeed's launcher set. What is under
        # test is the launcher chain (runner -> deepspeed.launcher.launch -> workers).
        import deepspeed  # noqa: F401 - as a DeepSpeed script does: its accelerator and comm modules load
        import torch.distributed as dist

        dist.init_process_group("gloo")
        ready(out, all_reduce_check(dist))
    elif mode == "spawn":
        import torch.multiprocessing as mp

        mp.spawn(spawned, args=(os.environ["MASTER_PORT"], out), nprocs=2)
    elif mode == "relaunch":
        import torch.distributed as dist

        if "LOCAL_RANK" not in os.environ:  # the first process relaunches itself, like Lightning's DDP
            subprocess.Popen([sys.executable, *sys.argv], env=dict(os.environ, LOCAL_RANK="1"))
            os.environ["LOCAL_RANK"] = "0"
        rank = int(os.environ["LOCAL_RANK"])
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}", rank=rank,
                                world_size=2)
        ready(out, all_reduce_check(dist))
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
