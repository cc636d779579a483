"""The Kineto probes (abstract_probe, tick_probe, stall_probe): run by a test in a private network
namespace (`run_probe`: abstract sockets are per namespace, so no other `@dynolog` on the machine is
met), each with the plain trainer.py armed for the daemon (KINETO_USE_DAEMON, the job id in
SLURM_JOB_ID, nothing of the caller's gpulens or Kineto settings), stopped through its stop file and
killed if it does not stop."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

TRAINER = Path(__file__).with_name("trainer.py")


def _read(stream, lines: list) -> None:
    for raw in iter(stream.readline, b""):
        lines.append((time.time(), raw.decode(errors="replace").rstrip()))


def start_trainer(job: int, stop: Path, max_s: int, *, kineto_lines: list | None = None) -> subprocess.Popen:
    """Start it; with `kineto_lines`, Kineto's INFO lines (KINETO_LOG_LEVEL=0) are read from its
    stderr line by line into that list as (arrival time, text)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPULENS_", "KINETO_", "SLURM_", "PYTHONPATH"))}
    env.update(KINETO_USE_DAEMON="1", SLURM_JOB_ID=str(job), OMP_NUM_THREADS="1")
    if kineto_lines is not None:
        env["KINETO_LOG_LEVEL"] = "0"
    trainer = subprocess.Popen([sys.executable, str(TRAINER), str(stop), str(max_s)], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE if kineto_lines is not None else subprocess.DEVNULL)
    if kineto_lines is not None:
        threading.Thread(target=_read, args=(trainer.stderr, kineto_lines), daemon=True).start()
    return trainer


def stop_trainer(trainer: subprocess.Popen, stop: Path) -> None:
    stop.touch()
    try:
        trainer.wait(20)
    except subprocess.TimeoutExpired:
        trainer.kill()
        trainer.wait()


def run_probe(name: str, timeout: float) -> dict:
    """Run probe `name` (a file beside this one) under `unshare --net` with a fresh output folder
    (under /var/tmp: /tmp is Kineto's default trace folder); returns the JSON line it prints last."""
    out = Path(tempfile.mkdtemp(prefix="gl-probe-", dir="/var/tmp"))
    try:
        run = subprocess.run(["unshare", "--net", sys.executable, str(Path(__file__).with_name(name)), str(out)],
                             capture_output=True, text=True, timeout=timeout, check=False)
        assert run.returncode == 0, run.stderr[-3000:]
        return json.loads(run.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(out, ignore_errors=True)
