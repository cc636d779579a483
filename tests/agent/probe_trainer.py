"""The plain trainer the Kineto probes run (abstract_probe, tick_probe, stall_probe): trainer.py
armed for the daemon (KINETO_USE_DAEMON, the job id in SLURM_JOB_ID, nothing of the caller's
gpulens or Kineto settings), and stopped through its stop file, killed if it does not stop."""

from __future__ import annotations

import os
import subprocess
import sys
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
