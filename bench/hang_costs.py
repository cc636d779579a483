"""What the hang capture's hook side costs a job (issue 45): its idle cost and its dump's size.

    .venv/bin/python bench/hang_costs.py [--rounds 5] [--steps 2100]

A plain two-rank gloo loop (a 256x256 matmul and an all_reduce of 4,096 floats per step, no
profiler, nothing of gpulens in it) runs, interleaved round by round, three ways: without the hook;
armed by the hook with no socket folder (registered, no Flight Recorder listener); armed with a
socket folder (the listener's thread blocked in accept() for the whole run: what every armed rank
carries). Rank 0 prints its median step time; the medians over rounds are compared side by side.
Then the armed run with the listener is asked for its dump the way the agent asks
(capture/agent/flight.py) once more steps than torch's default ring (2,000 entries) have run:
bytes and entries per rank, and how long the hook took to write it. One JSON document on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpulens.capture.agent.flight import dump_path, read_flight_dump, request_flight_dump  # noqa: E402
from gpulens.hooks import hook_path  # noqa: E402

LOOP = r'''
import os, statistics, sys, time
import torch, torch.distributed as dist
steps, hold = int(sys.argv[1]), sys.argv[2]
torch.set_num_threads(1)
dist.init_process_group("gloo")
a, t = torch.randn(256, 256), torch.ones(4096)
times = []
for i in range(steps):
    t0 = time.perf_counter()
    a = torch.tanh(a @ a)
    dist.all_reduce(t)
    times.append(time.perf_counter() - t0)
if dist.get_rank() == 0:
    print("median_us", round(statistics.median(times[100:]) * 1e6, 2), flush=True)
print("done", dist.get_rank(), os.getpid(), flush=True)
if hold == "hold":
    time.sleep(600)
dist.barrier()
dist.destroy_process_group()
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job(mode: str, steps: int, base: Path, hold: bool = False) -> tuple[list[subprocess.Popen], list[Path], dict]:
    base.mkdir(parents=True, exist_ok=True)
    script = base / "loop.py"
    script.write_text(LOOP)
    port, env0 = free_port(), {k: v for k, v in os.environ.items() if not k.startswith(("GPULENS_", "KINETO_"))}
    dirs = {"reg": base / "reg", "traces": base / "traces", "sock": Path(tempfile.mkdtemp(prefix="gl-hb-", dir="/tmp"))}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    procs, logs = [], []
    for rank in range(2):
        env = dict(env0, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        if mode != "no_hook":
            env.update(PYTHONPATH=str(hook_path()), GPULENS_JOB_ID="bench", GPULENS_REGISTRY_DIR=str(dirs["reg"]),
                       GPULENS_TRACE_DIR=str(dirs["traces"]))
            if mode == "hook_listener":
                env["GPULENS_SOCKET_DIR"] = str(dirs["sock"])
        log = base / f"{mode}-{rank}.log"
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, str(script), str(steps), "hold" if hold else "go"], env=env,
                                      stdout=open(log, "w"), stderr=subprocess.STDOUT))
    return procs, logs, dirs


def median_step(mode: str, steps: int, base: Path) -> float:
    procs, logs, dirs = job(mode, steps, base)
    for p in procs:
        assert p.wait(300) == 0, logs[0].read_text()[-2000:]
    shutil.rmtree(dirs["sock"], ignore_errors=True)
    line = next(x for x in logs[0].read_text().splitlines() if x.startswith("median_us"))
    return float(line.split()[1])


def dump_size(steps: int, base: Path) -> dict:
    procs, logs, dirs = job("hook_listener", steps, base, hold=True)
    try:
        end = time.time() + 300
        while not all("done" in log.read_text() for log in logs):
            assert time.time() < end and all(p.poll() is None for p in procs), [x.read_text()[-1000:] for x in logs]
            time.sleep(0.2)
        records = [json.loads(f.read_text()) for f in dirs["reg"].glob("*.json")]
        out = {}
        for rec in sorted(records, key=lambda r: r["global_rank"]):
            t0 = time.perf_counter()
            answer = asyncio.run(request_flight_dump(str(dirs["sock"] / rec["flight_socket"]), "c-bench",
                                                     f"rank-{rec['global_rank']}", timeout_s=60))
            seconds = time.perf_counter() - t0
            dump = read_flight_dump(dump_path(dirs["traces"], "c-bench", f"rank-{rec['global_rank']}"))
            out[rec["global_rank"]] = {"bytes": answer["bytes"], "entries": len(dump["entries"]),
                                       "seconds_to_dump": round(seconds, 3)}
        return out
    finally:
        for p in procs:
            p.kill()
            p.wait()
        shutil.rmtree(dirs["sock"], ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2100, help="steps per run (default: just over torch's 2,000-entry ring)")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="gl-hang-bench-", dir="/var/tmp"))
    modes = ("no_hook", "hook_no_listener", "hook_listener")
    seen: dict[str, list[float]] = {m: [] for m in modes}
    try:
        for r in range(args.rounds):
            for m in (modes if r % 2 == 0 else modes[::-1]):      # interleaved, order alternating
                seen[m].append(median_step(m, args.steps, base / f"{r}-{m}"))
        med = {m: statistics.median(v) for m, v in seen.items()}
        result = {"machine": f"{os.cpu_count()} CPUs", "steps": args.steps, "rounds": args.rounds,
                  "median_step_us": {m: round(v, 2) for m, v in med.items()},
                  "per_round_us": seen,
                  "ratio_listener_to_no_hook": round(med["hook_listener"] / med["no_hook"], 4),
                  "ratio_listener_to_hook_without": round(med["hook_listener"] / med["hook_no_listener"], 4),
                  "dump_after_steps": dump_size(args.steps, base / "dump")}
        print(json.dumps(result, indent=1))
        return 0
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
