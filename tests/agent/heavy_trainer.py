"""A one-process CPU training loop whose Kineto trace is large per iteration, for budget tests.

    python heavy_trainer.py STOP_FILE MAX_SECONDS OPS

Every step is `ProfilerStep#N` around OPS small tensor ops (each one a `cpu_op` event, ~1.2 KB
of trace JSON) plus a forward/backward and a torch.optim step (Kineto counts those), so a trace
weighs about OPS x 1.2 KB per iteration (measured with torch 2.13) while the process stays cheap on a shared machine.
"""

import os
import sys
import time


def main(stop_file: str, max_s: float, ops: int) -> None:
    import torch

    torch.set_num_threads(1)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 8)
    print(f"ready {os.getpid()}", flush=True)
    end, step = time.time() + max_s, 0
    while time.time() < end and not os.path.exists(stop_file):
        with torch.profiler.record_function(f"ProfilerStep#{step}"):
            y = x
            with torch.no_grad():
                for _ in range(ops):
                    y = y.add(1.0)
            (model(x).square().mean() + y.mean() * 0).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        step += 1
        time.sleep(0.01)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), int(sys.argv[3]))
