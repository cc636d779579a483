"""Real PyTorch (CPU) Kineto traces of the serving demo's request loop (`gpulens.up.demo_server`),
healthy or behind a noisy neighbour on its GPU.

The request is the demo replica's own (`serve_one`, in its `serve.request` span); the device is a
stand-in whose answer read waits `--wait-ms` (the healthy device's work, or that plus the
neighbour's kernels queued ahead of it), so the replica's own operators are untouched and only the
wait outside them differs. Traced with torch.profiler for a fixed wall-clock window, like an
on-demand serving capture. One process per trace:

    python serving_traces.py OUT_FILE healthy|neighbour
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

WAIT_MS = {"healthy": 4.0, "neighbour": 60.0}
WINDOW_S = 1.5


class WaitingDevice:
    """The answer read of a GPU whose queue holds `wait_ms` of work ahead of it."""

    def __init__(self, wait_ms: float):
        self.wait_s = wait_ms / 1000

    def step(self, **_) -> None:
        time.sleep(self.wait_s)


def main(out: Path, state: str) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from gpulens.up.demo_server import REQUEST_SPAN, serve_one

    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).eval()
    device = WaitingDevice(WAIT_MS[state])

    def request() -> None:
        with torch.profiler.record_function(REQUEST_SPAN):
            time.sleep(0.02)                                  # decoding, as the replica's --host-ms
            serve_one(model, torch.randn(32, 64), device, kernels=40, kernel_us=100, h2d_bytes=0)

    for _ in range(3):
        request()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        end = time.monotonic() + WINDOW_S
        while time.monotonic() < end:
            request()
    prof.export_chrome_trace(str(out))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
