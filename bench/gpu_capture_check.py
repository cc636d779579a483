"""GPU machine check for capture after capture (issue 34) and trace sizes (issue 27), real CUDA.

    python3 bench/gpu_capture_check.py [--out FILE]

Two gloo ranks of a plain loop with its model on the GPU (tests/agent/plain_trainer.py,
GPULENS_TRAINER_DEVICE=cuda), armed by the real hook; the agent in this process (builtin
endpoint). It reads the ranks' published step counts, chooses one start iteration as the
coordinator does, captures 3 iterations with GPU activities (kernel, gpu_memcpy, cuda_runtime),
then at once a 500 ms window: both must be archived, the iteration capture's ranks on identical
optimizer steps starting at first_traced_step(start) (Kineto with CUPTI writes the same
collection span as on CPU), and the GPU trace sizes per iteration are printed for the budget's
estimate. Prints "SKIP: ..." and exits 0 without a CUDA GPU; else one JSON document, exit 0 when
every check holds.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
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
TOKEN = "gpu-check-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_trace(uri: str) -> dict:
    path = uri.removeprefix("file://")
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        return json.load(f)


async def main(out: str | None) -> int:
    try:
        import torch
        if not torch.cuda.is_available():
            print("SKIP: no CUDA GPU")
            return 0
    except ImportError:
        print("SKIP: no torch")
        return 0
    from gpulens.capture.agent.client import AgentClient
    from gpulens.capture.agent.runtime import AgentOptions, start_agent
    from gpulens.capture.agent.steps import first_traced_step
    from gpulens.capture.archive import RetryPolicy
    from gpulens.capture.coordinator.start_iteration import plan_start
    from gpulens.hooks import hook_path

    base = Path(tempfile.mkdtemp(prefix="gl-gpu-", dir="/var/tmp"))
    sock = tempfile.mkdtemp(prefix="gl-", dir="/tmp")
    for d in ("reg", "traces", "archive", "state"):
        (base / d).mkdir()
    stop = base / "stop"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPULENS_", "KINETO_", "SLURM_"))}
    env.update(PYTHONPATH=os.pathsep.join([str(hook_path()), env.get("PYTHONPATH", "")]),
               GPULENS_REGISTRY_DIR=str(base / "reg"), GPULENS_SOCKET_DIR=sock, GPULENS_TRACE_DIR=str(base / "traces"),
               GPULENS_JOB_ID="gpu", GPULENS_TRAINER_DEVICE="cuda", OMP_NUM_THREADS="1")
    log = open(base / "trainer.log", "w")
    trainer = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                                f"--master-port={free_port()}", str(REPO / "tests" / "agent" / "plain_trainer.py"),
                                str(stop), "400"], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    report: dict = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "checks": {}}
    running = await start_agent(AgentOptions(
        host="127.0.0.1", port=0, node="gpu-node", registry_dir=base / "reg", trace_dir=base / "traces",
        state_dir=base / "state", archive_root=f"file://{base}/archive", token=TOKEN, trigger="builtin",
        socket_dir=sock, retry_interval_s=0.5, archive_policy=RetryPolicy(attempts=3, first_delay_s=0.2)))
    ok = True
    try:
        async with AgentClient(running.url, TOKEN) as client:
            end = time.time() + 180
            while True:
                views = {w.record.global_rank: w.steps for w in await client.workers() if w.alive}
                if len(views) == 2 and all(v is not None and v.count >= 30 for v in views.values()):
                    break
                if time.time() > end or trainer.poll() is not None:
                    raise RuntimeError(f"ranks did not step: {views}; {(base / 'trainer.log').read_text()[-3000:]}")
                await asyncio.sleep(0.5)
            report["steps_per_s"] = {r: v.per_s for r, v in views.items()}
            plan = plan_start(views, 3, now=time.time(), lead_s=12.0)
            report["plan"] = plan.detail

            def body(cid: str, rank: int, **kw) -> dict:
                b = {"job_id": "gpu", "attempt": 0, "rank": rank, "duration_ms": 500,
                     "activities": ["cpu_op", "kernel", "gpu_memcpy", "cuda_runtime"],
                     "deadline": time.time() + 120, "archive_prefix": f"file://{base}/archive/default/gpu/0/{cid}"}
                b.update(kw)
                return b

            async def converge(cid: str) -> dict:
                end = time.time() + 150
                while time.time() < end:
                    st = await client.status(cid)
                    if st and all(s.terminal for s in st):
                        return {s.target_id: s for s in st}
                    await asyncio.sleep(0.3)
                raise RuntimeError(f"{cid} did not converge")

            for rank in (0, 1):
                await client.dispatch("c-gpu-iter", f"rank-{rank}", body("c-gpu-iter", rank, duration_ms=30_000, iterations=3,
                                                                          start_iteration=plan.iteration))
            it_done = await converge("c-gpu-iter")
            for rank in (0, 1):
                await client.dispatch("c-gpu-window", f"rank-{rank}", body("c-gpu-window", rank))
            win_done = await converge("c-gpu-window")
        ranks = {}
        for name, done in (("iterations", it_done), ("window", win_done)):
            for tid, st in done.items():
                entry = {"state": st.state.value, "reason": st.reason.value if st.reason else None, "detail": st.detail}
                if st.artifact is not None:
                    trace = load_trace(st.artifact.uri)
                    cats: dict = {}
                    for e in trace["traceEvents"]:
                        cats[e.get("cat")] = cats.get(e.get("cat"), 0) + 1
                    entry.update(iterations=st.artifact.iterations, stored=st.artifact.size,
                                 sizes=getattr(st.artifact, "sizes", None), categories=cats,
                                 collection_span=any(e.get("cat") == "Trace" for e in trace["traceEvents"]))
                ranks[f"{name}/{tid}"] = entry
        report["targets"] = ranks
        firsts = {v["iterations"]["first"] for k, v in ranks.items() if k.startswith("iterations/") and v.get("iterations")}
        checks = {
            "all archived": all(v["state"] == "archived" for v in ranks.values()),
            "iteration ranks identical at first_traced_step(start)": firsts == {first_traced_step(plan.iteration)},
            "GPU kernels in the traces": all((v.get("categories") or {}).get("kernel", 0) > 0 for v in ranks.values()),
        }
        report["checks"], ok = checks, all(checks.values())
    finally:
        await running.stop()
        stop.touch()
        try:
            trainer.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(trainer.pid, 9)
        log.close()
        shutil.rmtree(sock, ignore_errors=True)
        report["trainer_log_tail"] = (base / "trainer.log").read_text(errors="replace")[-1500:]
        shutil.rmtree(base, ignore_errors=True)
    text = json.dumps(report, indent=1, default=str)
    print(text)
    if out:
        Path(out).write_text(text)
    return 0 if ok else 1


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out")
    sys.exit(asyncio.run(main(p.parse_args().out)))
