"""The trainer hook arms Kineto, registers workers (never launchers), chains, and never breaks training."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from capture.models import RegistrationRecord
from hooks import hook_path, load_hook_module
from tests.conftest import free_port

HOOK = load_hook_module()
TORCHRUN = str(Path(sys.executable).parent / "torchrun")


def python_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPULENS_", "KINETO_", "SLURM_"))}
    env["PYTHONPATH"] = str(hook_path())
    env.update(extra)
    return env


def test_role_detection():
    assert HOOK.role(["/usr/bin/python3", "-u", "train.py"]) == "worker"
    assert HOOK.role(["/venv/bin/python", "/venv/bin/torchrun", "--nproc-per-node=2", "train.py"]) == "launcher"
    assert HOOK.role(["python", "-m", "torch.distributed.run", "train.py"]) == "launcher"
    assert HOOK.role(["python", "-c", "from multiprocessing.spawn import spawn_main; spawn_main()"]) == "helper"
    assert HOOK.role(["python", "-m", "multiprocessing.resource_tracker"]) == "helper"
    # a worker whose script path mentions torchrun is still a worker
    assert HOOK.role(["/v/bin/python", "-u", "/tmp/test_torchrun_case/train.py"]) == "worker"
    assert HOOK.role(["/v/bin/python", "-u", "/v/lib/torch/distributed/run.py", "x.py"]) == "launcher"


def test_arm_sets_kineto_env_and_a_per_pod_job_id(tmp_path):
    env = {"GPULENS_SOCKET_DIR": "/run/gl", "GPULENS_TRACE_DIR": str(tmp_path), "GPULENS_REGISTRY_DIR": str(tmp_path),
           "GPULENS_JOB_ID": "j1", "GPULENS_POD_UID": "uid-a", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}
    path = HOOK.arm(env, cmdline=["python", "train.py"])
    assert env["KINETO_USE_DAEMON"] == "1"
    assert env["KINETO_IPC_SOCKET_DIR"] == "/run/gl" and env["KINETO_ONDEMAND_TRACE_DIR"] == str(tmp_path)
    rec = RegistrationRecord.load(Path(path))
    assert rec.global_rank == 1 and rec.world_size == 2 and rec.pid == os.getpid()
    assert rec.kineto_job_id == int(env["SLURM_JOB_ID"]) > 0
    # another pod (another uid) gets another Kineto job id, so equal pids cannot collide in dynolog
    other = {"GPULENS_JOB_ID": "j1", "GPULENS_POD_UID": "uid-b"}
    HOOK.arm(other, cmdline=["python", "train.py"])
    assert other["SLURM_JOB_ID"] != env["SLURM_JOB_ID"]
    os.unlink(path)


def test_arm_keeps_a_real_slurm_job_id(tmp_path):
    env = {"SLURM_JOB_ID": "4242", "GPULENS_REGISTRY_DIR": str(tmp_path)}
    path = HOOK.arm(env, cmdline=["python", "train.py"])
    assert env["SLURM_JOB_ID"] == "4242"
    assert json.loads(Path(path).read_text())["kineto_job_id"] == 4242
    os.unlink(path)


def test_launcher_and_helpers_do_not_register(tmp_path):
    for cmd in (["python", "/v/bin/torchrun", "x.py"], ["python", "-c", "from multiprocessing.spawn import spawn_main"]):
        env = {"GPULENS_REGISTRY_DIR": str(tmp_path), "RANK": "0"}
        assert HOOK.arm(env, cmdline=cmd) is None
        assert "SLURM_JOB_ID" not in env  # stays on Kineto job 0: a request for the workers' job never hits it
        assert env["KINETO_USE_DAEMON"] == "1"
    assert list(tmp_path.iterdir()) == []


def test_disabled_hook_does_nothing(tmp_path):
    env = {"GPULENS_HOOK_DISABLE": "1", "GPULENS_REGISTRY_DIR": str(tmp_path)}
    assert HOOK.arm(env, cmdline=["python", "t.py"]) is None
    assert "KINETO_USE_DAEMON" not in env and list(tmp_path.iterdir()) == []


def test_record_written_by_the_hook_process_validates_and_is_removed_at_exit(tmp_path):
    code = ("import os, glob, json, sys; f = glob.glob(os.environ['GPULENS_REGISTRY_DIR'] + '/*.json');"
            "print(json.dumps({'files': f, 'pid': os.getpid(), 'daemon': os.environ.get('KINETO_USE_DAEMON')}))")
    out = subprocess.run([sys.executable, "-c", code], env=python_env(GPULENS_REGISTRY_DIR=str(tmp_path), GPULENS_JOB_ID="jx"),
                         capture_output=True, text=True, timeout=60, check=True)
    seen = json.loads(out.stdout)
    assert seen["daemon"] == "1" and len(seen["files"]) == 1
    assert f"__p{seen['pid']}.json" in seen["files"][0]
    assert list(tmp_path.iterdir()) == []  # removed at exit
    # and no temp files were left behind either


def test_record_content_validates_against_the_schema(tmp_path):
    code = "import os, glob; print(open(glob.glob(os.environ['GPULENS_REGISTRY_DIR'] + '/*.json')[0]).read())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                         env=python_env(GPULENS_REGISTRY_DIR=str(tmp_path), GPULENS_JOB_ID="jx", RANK="5", LOCAL_RANK="1",
                                        WORLD_SIZE="8", LOCAL_WORLD_SIZE="4", GPULENS_ATTEMPT="2"))
    rec = RegistrationRecord.from_dict(json.loads(out.stdout))
    assert (rec.job_id, rec.attempt, rec.global_rank, rec.local_rank, rec.base_rank) == ("jx", 2, 5, 1, 4)


def test_unwritable_registry_is_one_stderr_line_and_the_program_runs(tmp_path):
    missing = tmp_path / "does-not-exist"
    out = subprocess.run([sys.executable, "-c", "print('trained')"], capture_output=True, text=True, timeout=60,
                         env=python_env(GPULENS_REGISTRY_DIR=str(missing)))
    assert out.returncode == 0 and out.stdout.strip() == "trained"
    assert out.stderr.count("gpulens-hook:") == 1 and len(out.stderr.strip().splitlines()) == 1


def test_the_images_own_sitecustomize_still_runs(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import os\nos.environ['THEIRS_RAN'] = os.environ.get('KINETO_USE_DAEMON', 'unset')\n")
    env = python_env()
    env["PYTHONPATH"] = f"{hook_path()}{os.pathsep}{theirs}"
    out = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('THEIRS_RAN'))"], env=env,
                         capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "1"  # ran, and after arming


TRAIN = """
import os, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(4) * (dist.get_rank() + 1)
dist.all_reduce(t)
assert t[0].item() == 3.0
print(f"worker rank={os.environ['RANK']} pid={os.getpid()}", flush=True)
open(os.path.join(sys.argv[1], f"seen-{os.environ['RANK']}"), "w").write(repr(sorted(os.listdir(sys.argv[2]))))
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_real_torchrun_registers_exactly_the_two_workers(tmp_path):
    reg, out_dir = tmp_path / "reg", tmp_path / "out"
    reg.mkdir(), out_dir.mkdir()
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    # a socket dir with nothing listening: Kineto gives up fast instead of polling an abstract socket
    env = python_env(GPULENS_REGISTRY_DIR=str(reg), GPULENS_JOB_ID="job-t", GPULENS_SOCKET_DIR=str(tmp_path))
    proc = subprocess.Popen([TORCHRUN, "--nproc-per-node=2", f"--master-port={free_port()}", str(script), str(out_dir), str(reg)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stderr[-2000:]
    pids = {int(r): int(p) for r, p in re.findall(r"worker rank=(\d+) pid=(\d+)", stdout)}
    assert sorted(pids) == [0, 1]
    seen = eval((out_dir / "seen-0").read_text())
    records = [name for name in seen if name.endswith(".json")]
    assert len(records) == 2, seen
    for rank, pid in pids.items():
        assert any(f"__r{rank}__" in r and r.endswith(f"__p{pid}.json") for r in records), (rank, pid, records)
    assert not any(f"__p{proc.pid}.json" in r for r in records)  # the launcher never registers
    assert list(reg.iterdir()) == []  # gone when the job ended


@pytest.mark.slow
def test_real_torchrun_with_unwritable_registry_still_trains(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    (tmp_path / "out").mkdir()
    blocker = tmp_path / "file-not-dir"
    blocker.write_text("")
    env = python_env(GPULENS_REGISTRY_DIR=str(blocker / "reg"), GPULENS_JOB_ID="job-t", GPULENS_SOCKET_DIR=str(tmp_path))
    out = subprocess.run([TORCHRUN, "--nproc-per-node=2", f"--master-port={free_port()}", str(script), str(tmp_path / "out"), str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("worker rank=") == 2
    assert out.stderr.count("gpulens-hook: not armed") == 2
