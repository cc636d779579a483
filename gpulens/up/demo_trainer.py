"""The demo trainer `gpulens up --demo` runs under `torchrun --nproc-per-node=2` (PyTorch CPU,
gloo), armed by the trainer hook like any real job.

Each step takes its batch from a real `torch.utils.data.DataLoader` (so traces carry its
`enumerate(DataLoader)#...__next__` spans), does a little real PyTorch work (so Kineto traces have
real `cpu_op` events), steps a `torch.optim` optimizer (so Kineto counts iterations), and drives
the CUDA driver stand-in (exporter/stub) through its exported driver symbols, so the exporter's
uprobes see demand, back-pressure and transfers exactly as they would from cuBLAS on a GPU.

An incident is switched on at run time by writing its name into the control file (`gpulens up
--incident X` does that after the warm-up); the step loop re-reads the file when it changes:

  host_sync         a "logging only" change copies a whole tensor to the host every step and reads a
                    value from it: `aten::copy_` and `aten::item` in the trace, and on the stand-in
                    a synchronous device-to-host copy the host thread waits for (the wait a real
                    GPU's `.item()` has), so back-pressure and device-to-host bytes rise
  input_starvation  the data loader is CPU-starved: each batch takes 4x longer to produce, so
                    `DataLoader.__next__` spans grow, launches and host-to-device bytes drop, and so
                    does time blocked in syncs
  noisy_neighbor    nothing changes here; `gpulens up` starts a second job on the same (stand-in)
                    GPU, whose work delays ours on the shared device timeline
  hang              rank 1 (--hang-rank) stops before the next all_reduce (in `stop_before_collective`, as a rank
                    stuck in a data loader or a checkpoint would) and never enters it; rank 0 waits
                    in it. Both stop launching while they hold the GPU: the stalled alert's shape
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def read_incident(path: str, cache: dict) -> str:
    try:
        mtime = os.stat(path).st_mtime_ns
    except OSError:
        return "none"
    if cache.get("mtime") != mtime:
        try:
            with open(path) as f:
                cache["incident"] = f.read().strip() or "none"
        except OSError:
            cache["incident"] = "none"
        cache["mtime"] = mtime
    return cache.get("incident", "none")


def batches(control: str, host_ms: float, cache: dict):
    """The dataset behind the DataLoader: one batch per `host_ms` of CPU-bound preparation (x4 when
    input_starvation is on)."""
    import torch

    class Batches(torch.utils.data.IterableDataset):
        def __iter__(self):
            while True:
                slow = 4 if read_incident(control, cache) == "input_starvation" else 1
                time.sleep(host_ms * slow / 1000)        # decoding, augmenting, ...
                yield torch.randn(32, 64)

    return torch.utils.data.DataLoader(Batches(), batch_size=None, num_workers=0)


def logging_copy(activations, snapshot) -> float:
    """host_sync's "just for logging" change: copy a whole tensor into a host buffer, then read a
    value from it (`aten::copy_`, `aten::item`; on a GPU the read waits for the device)."""
    snapshot.copy_(activations)
    return snapshot[0].item()


def stop_before_collective() -> None:
    """The hang incident's rank 1: never returns, never enters the collective the other rank waits in."""
    while True:
        time.sleep(3600)


def train_step(loader, model, opt, incident: str, activations, snapshot) -> None:
    """One step's PyTorch work (tests/analysis/incident_traces.py traces this very function). No
    ProfilerStep#N markers, as in most loops: the analysis finds the steps between the optimizer's
    own spans, numbered by the hook's step count."""
    x = next(loader)                                     # waits for the next batch
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if incident == "host_sync":
        logging_copy(activations, snapshot)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--libcuda", required=True, help="path of the stand-in libcuda.so.1")
    ap.add_argument("--control", required=True, help="file holding the current incident name")
    ap.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: run until stopped)")
    ap.add_argument("--hang-rank", type=int, default=1, help="hang: the rank that stops before the collective")
    ap.add_argument("--hang-at-step", type=int, default=0,
                    help="hang from this step on without the control file (0: only when the control file says hang)")
    ap.add_argument("--kernels", type=int, default=40)
    ap.add_argument("--kernel-us", type=int, default=100)
    ap.add_argument("--h2d-bytes", type=int, default=4 << 20)
    ap.add_argument("--host-ms", type=float, default=20.0, help="time each step waits for its input batch")
    ap.add_argument("--copy-floats", type=int, default=16 << 20,
                    help="host_sync: floats of the tensor copied to the host every step (64 MB: measured 11-16 %% "
                         "of a step; with 16 MB it was 3.5-6 %%, on either side of the verdict's 5 %% line)")
    ap.add_argument("--sync-copy-bytes", type=int, default=128 << 20,
                    help="host_sync: bytes of the synchronous device-to-host copy on the stand-in per step "
                         "(128 MiB at the stand-in's 12 GB/s: ~11 ms per rank, both ranks sharing the device). "
                         "The rules' back-pressure signal needs the blocked share of wall time at 1.5x its baseline "
                         "(~0.32 here) while the 64 MB host copy dilutes it; measured on 2 cores, both busy with "
                         "other work: 64 MiB reached 1.8x (a CI run saw under 1.5x), 128 MiB 2.9x")
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist

    from gpulens.exporter.stub import StubDriver

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    device = StubDriver(args.libcuda, device=0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cache: dict = {}
    loader = iter(batches(args.control, args.host_ms, {}))
    activations = torch.randn(args.copy_floats)
    snapshot = torch.empty_like(activations)         # the host buffer the "logging" copies into
    step, last_incident = 0, "none"
    print(f"demo-trainer rank={rank} pid={os.getpid()} started", flush=True)
    while args.steps == 0 or step < args.steps:
        incident = read_incident(args.control, cache)
        if incident != last_incident:
            print(f"demo-trainer rank={rank} incident={incident} step={step}", flush=True)
            last_incident = incident
        train_step(loader, model, opt, incident, activations, snapshot)
        device.step(kernels=args.kernels, kernel_us=args.kernel_us, h2d_bytes=args.h2d_bytes,
                    d2h_sync_bytes=args.sync_copy_bytes if incident == "host_sync" else 0)
        if step % 20 == 0:
            if rank == args.hang_rank and (incident == "hang" or 0 < args.hang_at_step <= step):
                print(f"demo-trainer rank={rank} stops before the all_reduce of step {step}", flush=True)
                stop_before_collective()
            t = torch.ones(1)
            dist.all_reduce(t)                           # keeps the ranks in step, like a real job
        step += 1
    device.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
