"""The hook under real launchers: exactly one record per worker, with the global rank its process
group reports, none for any launcher, runner or helper, and none left after the pod-equivalent
process group gets SIGTERM (how Kubernetes stops a pod).

Every case starts the launcher in a session of its own (the "pod"), waits until each worker has
formed its process group (all_reduce done, `ready-<rank>-<pid>` written), compares the registry
with the worker pids, then sends SIGTERM to the whole group and waits for every process to go.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpulens.hooks import hook_path
from tests.conftest import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TRAINER = str(Path(__file__).with_name("launched_trainer.py"))
BIN = Path(sys.executable).parent


def _torchrun() -> str:
    """The torchrun console script of the venv torch is installed in (ours, or the one ours extends)."""
    import importlib.util

    ours = BIN / "torchrun"
    if ours.exists():
        return str(ours)
    return str(Path(importlib.util.find_spec("torch").origin).parents[4] / "bin" / "torchrun")


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPULENS_", "KINETO_", "SLURM_", "RANK",
                                                                    "LOCAL_RANK", "WORLD_SIZE", "MASTER_"))}
    env.update(PYTHONPATH=str(hook_path()), GPULENS_REGISTRY_DIR=str(tmp / "reg"), GPULENS_JOB_ID="job-l",
               GPULENS_SOCKET_DIR=str(tmp / "sock"),  # nothing listens: Kineto gives up fast
               OMP_NUM_THREADS="1", HF_HOME=str(tmp / "hf"), DS_ACCELERATOR="cpu", MASTER_PORT=str(free_port()),
               PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def run_pod(tmp: Path, argv: list[str], ranks: int, **extra: str) -> None:
    for d in ("reg", "out", "sock"):
        (tmp / d).mkdir()
    log = open(tmp / "pod.log", "wb")
    pod = subprocess.Popen(argv, env=_env(tmp, **extra), cwd=tmp, stdout=log, stderr=subprocess.STDOUT,
                           start_new_session=True)
    try:
        deadline = time.time() + 600  # the machine this runs on may be heavily shared: generous
        while len(list((tmp / "out").glob("ready-*"))) < ranks:
            assert pod.poll() is None, (tmp / "pod.log").read_text()[-3000:]
            assert time.time() < deadline, (tmp / "pod.log").read_text()[-3000:]
            time.sleep(0.2)
        workers = {int(p.name.split("-")[2]): int(p.name.split("-")[1]) for p in (tmp / "out").glob("ready-*")}
        assert sorted(workers.values()) == list(range(ranks)), workers
        records = {p.name: json.loads(p.read_text()) for p in (tmp / "reg").iterdir() if p.suffix == ".json"}
        by_pid = {r["pid"]: r for r in records.values()}
        assert len(records) == ranks, (workers, sorted(records))          # none for a launcher or runner
        assert sorted(by_pid) == sorted(workers), (workers, sorted(records))
        for pid, rank in workers.items():
            assert by_pid[pid]["global_rank"] == rank, by_pid[pid]
            assert by_pid[pid]["world_size"] == (ranks if ranks > 1 else 1)
            assert by_pid[pid]["identity"] == ("process_group" if ranks > 1 else "single_process")
        if pod.pid not in workers:  # a launcher (in the Lightning style the first process is rank 0 itself)
            assert pod.pid not in by_pid
        os.killpg(pod.pid, signal.SIGTERM)
        pod.wait(timeout=120)
        deadline = time.time() + 120
        while any(_alive(pid) for pid in workers):
            assert time.time() < deadline, "workers outlived SIGTERM"
            time.sleep(0.1)
        assert list((tmp / "reg").iterdir()) == []  # every record gone, no temp file either
    finally:
        if pod.poll() is None:
            os.killpg(pod.pid, signal.SIGKILL)
            pod.wait()
        log.close()


def test_torchrun(tmp_path):
    run_pod(tmp_path, [_torchrun(), "--nproc-per-node=2", f"--master-port={free_port()}", TRAINER, "env",
                       str(tmp_path / "out")], 2)


def test_python_W_ignore_m_torch_distributed_run(tmp_path):
    """`-W ignore` and `-X` take values: an argv guess took them for the script and registered the launcher."""
    run_pod(tmp_path, [sys.executable, "-W", "ignore", "-X", "utf8", "-m", "torch.distributed.run", "--nproc-per-node=2",
                       f"--master-port={free_port()}", TRAINER, "env", str(tmp_path / "out")], 2)


def test_torch_multiprocessing_spawn(tmp_path):
    """The spawned children train (and register); the idle parent is not a worker."""
    run_pod(tmp_path, [sys.executable, TRAINER, "spawn", str(tmp_path / "out")], 2)


def test_lightning_style_self_relaunch(tmp_path):
    """Rank 0 re-runs its own script for rank 1, then both form the group (Lightning's DDP launcher)."""
    run_pod(tmp_path, [sys.executable, TRAINER, "relaunch", str(tmp_path / "out")], 2)


@pytest.fixture(scope="module")
def launchers() -> Path:
    from tests.launcher_venv import launchers_venv

    return launchers_venv()


def test_accelerate_launch_two_processes(tmp_path, launchers):
    """Without GPUs, accelerate starts two processes only with --multi_gpu (its torchrun path); the
    script's Accelerator(cpu=True) then forms a gloo group, as `accelerate launch --cpu` users get."""
    run_pod(tmp_path, [str(launchers / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                       "--mixed_precision", "no", "--dynamo_backend", "no", f"--main_process_port={free_port()}",
                       TRAINER, "accelerate", str(tmp_path / "out")], 2)


def test_accelerate_launch_cpu_single_process(tmp_path, launchers):
    run_pod(tmp_path, [str(launchers / "accelerate"), "launch", "--cpu", "--num_processes", "1", "--num_machines", "1",
                       "--mixed_precision", "no", "--dynamo_backend", "no", TRAINER, "accelerate",
                       str(tmp_path / "out")], 1)


def test_deepspeed_cpu_accelerator(tmp_path, launchers):
    run_pod(tmp_path, [str(launchers / "deepspeed"), "--num_gpus", "2", f"--master_port={free_port()}", TRAINER,
                       "deepspeed", str(tmp_path / "out")], 2)
