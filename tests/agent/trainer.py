"""A tiny CPU training loop for agent tests: armed by the gpulens hook, traced by Kineto on demand.

    python trainer.py STOP_FILE MAX_SECONDS

Runs small matmul steps with a short sleep (cheap on a shared 2-core machine) inside Python
helper functions (so `python_function` events exist when stacks are on), until STOP_FILE exists or
MAX_SECONDS passed. Prints "ready <pid>" once torch is imported (Kineto has registered by then).
"""

import os
import sys
import time


def step(model, x):
    return model(x).relu().sum()


def main(stop_file: str, max_s: float) -> None:
    import torch

    torch.set_num_threads(1)
    model = torch.nn.Linear(32, 32)
    x = torch.randn(16, 32)
    print(f"ready {os.getpid()}", flush=True)
    end = time.time() + max_s
    while time.time() < end and not os.path.exists(stop_file):
        with torch.no_grad():
            step(model, x)
        time.sleep(0.005)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]))
