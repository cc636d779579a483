"""GPU machine check for the hang capture (issue 45) with NCCL, real CUDA.

    python3 bench/hang_gpu_check.py

A one-rank NCCL job armed by the real hook (a lent machine has one GPU, and NCCL refuses two
ranks on one device, so no rank can be made to wait for another here): 30 all_reduce calls on
cuda:0, then the main thread blocks in `torch.cuda.synchronize()` behind a long `torch.cuda._sleep`.
While it is blocked, the dump is asked the way the agent asks (capture/agent/flight.py) and the
stacks are read with py-spy (capture/agent/stacks.py); both are checked against their schemas,
and the analysis (capture/analysis/hang.py) must read NCCL's entries: 30 collectives named
`nccl:all_reduce` with their sizes, all completed, and "no collective is pending". Prints
"SKIP: ..." and exits 0 without a CUDA GPU; else one JSON document, exit 0 when every check holds.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

JOB = r'''
import os, sys, torch, torch.distributed as dist
dist.init_process_group("nccl")
torch.cuda.set_device(0)
t = torch.ones(1 << 20, device="cuda")
for _ in range(30):
    dist.all_reduce(t)
torch.cuda.synchronize()
torch.cuda._sleep(int(2e11))           # ~1-2 minutes of GPU cycles: the host blocks below
print("blocked", os.getpid(), flush=True)
torch.cuda.synchronize()
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    try:
        import torch
        if not torch.cuda.is_available() or not torch.distributed.is_nccl_available():
            print("SKIP: no CUDA GPU with NCCL")
            return 0
    except ImportError:
        print("SKIP: no torch")
        return 0
    from gpulens.capture import schemas
    from gpulens.capture.agent.flight import dump_path, read_flight_dump, request_flight_dump
    from gpulens.capture.agent.stacks import read_stacks
    from gpulens.capture.analysis.hang import calls_of, hang_report, where_now
    from gpulens.hooks import hook_path

    base = Path(tempfile.mkdtemp(prefix="gl-hang-gpu-", dir="/var/tmp"))
    sock = Path(tempfile.mkdtemp(prefix="gl-", dir="/tmp"))
    for d in ("reg", "traces"):
        (base / d).mkdir()
    (base / "job.py").write_text(JOB)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPULENS_", "KINETO_"))}
    env.update(PYTHONPATH=os.pathsep.join([str(hook_path()), env.get("PYTHONPATH", "")]), GPULENS_JOB_ID="gpu-hang",
               GPULENS_REGISTRY_DIR=str(base / "reg"), GPULENS_SOCKET_DIR=str(sock),
               GPULENS_TRACE_DIR=str(base / "traces"), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
               LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    log = open(base / "job.log", "w")
    proc = subprocess.Popen([sys.executable, str(base / "job.py")], env=env, stdout=log, stderr=subprocess.STDOUT)
    report: dict = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0),
                    "nccl": ".".join(map(str, torch.cuda.nccl.version())), "checks": {}}
    ok = True
    try:
        end = time.time() + 180
        while "blocked" not in (base / "job.log").read_text():
            if time.time() > end or proc.poll() is not None:
                raise RuntimeError((base / "job.log").read_text()[-3000:])
            time.sleep(0.2)
        (record,) = [json.loads(p.read_text()) for p in (base / "reg").glob("*.json")]
        t0 = time.perf_counter()
        answer = asyncio.run(request_flight_dump(str(sock / record["flight_socket"]), "c-gpu-hang", "rank-0",
                                                 timeout_s=30))
        report["dump_seconds"] = round(time.perf_counter() - t0, 3)
        dump = read_flight_dump(dump_path(base / "traces", "c-gpu-hang", "rank-0"))
        report["dump_bytes"] = answer["bytes"]
        stacks = asyncio.run(read_stacks(proc.pid))
        schemas.validate("python_stacks", stacks)
        calls = calls_of(0, dump)
        report["calls"] = len(calls)
        report["ops"] = sorted({c.op for c in calls})
        report["sizes"] = sorted({repr(c.input_sizes) for c in calls})
        report["where_now"] = where_now(stacks)
        report["verdict"] = hang_report({0: dump}, world_size=1, stacks={0: stacks})["verdict"]
        checks = {
            "dump answered while the main thread is blocked in synchronize": bool(answer.get("ok")),
            "30 NCCL all_reduce entries": len([c for c in calls if c.op == "nccl:all_reduce"]) == 30,
            "every entry completed": all(c.completed for c in calls),
            "sizes read": all(c.input_sizes for c in calls),
            "nothing pending": report["verdict"].startswith("no collective is pending"),
            "stacks show the job's frame": any("job.py" in str(f.get("filename")) for t in stacks["threads"]
                                               for f in t.get("frames") or []),
        }
        report["checks"] = checks
        ok = all(checks.values())
    except Exception as exc:  # noqa: BLE001 - a device check reports what broke
        report["error"] = f"{type(exc).__name__}: {exc}"
        ok = False
    finally:
        proc.kill()
        proc.wait()
        log.close()
        shutil.rmtree(sock, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
