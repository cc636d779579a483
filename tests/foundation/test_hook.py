"""The trainer hook arms Kineto, registers the processes that train (never launchers), chains, and never breaks training."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpulens.capture.models import RegistrationRecord
from gpulens.hooks import hook_path, load_hook_module
from tests.conftest import free_port

HOOK = load_hook_module()
TORCHRUN = str(Path(sys.executable).parent / "torchrun")


def python_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPULENS_", "KINETO_", "SLURM_"))}
    env["PYTHONPATH"] = str(hook_path())
    env.update(extra)
    return env


def test_arm_sets_kineto_env_and_a_per_pod_job_id(tmp_path):
    env = {"GPULENS_SOCKET_DIR": "/run/gl", "GPULENS_TRACE_DIR": str(tmp_path), "GPULENS_REGISTRY_DIR": str(tmp_path),
           "GPULENS_JOB_ID": "j1", "GPULENS_POD_UID": "uid-a", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}
    registrar = HOOK.arm(env, cmdline=["python", "train.py"], watch=False)
    assert env["KINETO_USE_DAEMON"] == "1"
    assert env["KINETO_IPC_SOCKET_DIR"] == "/run/gl" and env["KINETO_ONDEMAND_TRACE_DIR"] == str(tmp_path)
    assert [p for p in tmp_path.iterdir() if p.suffix != ".steps"] == []  # nothing registers before the process shows it trains
    registrar.signals.install = lambda: False  # not in the test process
    path = registrar.on_process_group(1, 2) or registrar.path
    rec = RegistrationRecord.load(Path(path))
    assert rec.global_rank == 1 and rec.world_size == 2 and rec.pid == os.getpid()
    assert rec.kineto_job_id == int(env["SLURM_JOB_ID"]) > 0
    # another pod (another uid) gets another Kineto job id, so equal pids cannot collide in dynolog
    other = {"GPULENS_JOB_ID": "j1", "GPULENS_POD_UID": "uid-b"}
    HOOK.arm(other, cmdline=["python", "train.py"], watch=False)
    assert other["SLURM_JOB_ID"] != env["SLURM_JOB_ID"]
    registrar.remove()
    assert [p for p in tmp_path.iterdir() if p.suffix != ".steps"] == []


def test_arm_keeps_a_real_slurm_job_id(tmp_path):
    env = {"SLURM_JOB_ID": "4242", "GPULENS_REGISTRY_DIR": str(tmp_path)}
    registrar = HOOK.arm(env, cmdline=["python", "train.py"], watch=False)
    registrar.signals.install = lambda: False
    registrar.on_process_group(0, 1)
    assert env["SLURM_JOB_ID"] == "4242"
    assert json.loads(Path(registrar.path).read_text())["kineto_job_id"] == 4242
    registrar.remove()


def test_the_process_group_rank_wins_over_the_environment_and_replaces_the_fallback(tmp_path):
    env = {"GPULENS_REGISTRY_DIR": str(tmp_path), "GPULENS_JOB_ID": "j", "RANK": "0", "WORLD_SIZE": "1"}
    registrar = HOOK.arm(env, cmdline=["python", "-W", "ignore", "x.py"], watch=False)
    registrar.signals.install = lambda: False
    registrar.register(identity="single_process")
    assert env[HOOK.FALLBACK_ENV] == registrar.path  # descendants that train retire it
    registrar.on_process_group(3, 4)
    names = [p.name for p in tmp_path.iterdir() if p.suffix != ".steps"]
    assert len(names) == 1 and "__r3__" in names[0], names  # one record, the group's rank
    rec = json.loads((tmp_path / names[0]).read_text())
    assert (rec["global_rank"], rec["world_size"], rec["identity"]) == (3, 4, "process_group")
    assert HOOK.FALLBACK_ENV not in env  # a real worker is never retired by a child
    registrar.remove()


def test_a_descendant_retires_only_a_record_file_in_its_own_registry(tmp_path):
    reg, elsewhere = tmp_path / "reg", tmp_path / "elsewhere"
    reg.mkdir(), elsewhere.mkdir()
    launcher = reg / "j__a0__r0__ns1__p1.json"
    launcher.write_text("{}")
    victim = elsewhere / "keep.json"
    victim.write_text("{}")
    for inherited, survives in ((str(victim), True), (str(reg / ".." / "elsewhere" / "keep.json"), True),
                                (str(launcher), False)):
        env = {"GPULENS_REGISTRY_DIR": str(reg), "GPULENS_JOB_ID": "j", HOOK.FALLBACK_ENV: inherited}
        child = HOOK.arm(env, cmdline=["python", "w.py"], watch=False)
        child.signals.install = lambda: False
        child.on_process_group(1, 2)
        assert Path(inherited).exists() is survives, inherited
        child.remove()
    assert victim.exists()


def test_disabled_hook_does_nothing(tmp_path):
    env = {"GPULENS_HOOK_DISABLE": "1", "GPULENS_REGISTRY_DIR": str(tmp_path)}
    assert HOOK.arm(env, cmdline=["python", "t.py"]) is None
    assert "KINETO_USE_DAEMON" not in env and [p for p in tmp_path.iterdir() if p.suffix != ".steps"] == []


def test_a_process_that_never_imports_torch_never_registers(tmp_path):
    out = subprocess.run([sys.executable, "-c", "import os; print(os.environ['KINETO_USE_DAEMON'])"], timeout=60,
                         env=python_env(GPULENS_REGISTRY_DIR=str(tmp_path), GPULENS_JOB_ID="jx"),
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1" and out.stderr == ""
    assert [p for p in tmp_path.iterdir() if p.suffix != ".steps"] == []


SINGLE = ("import os, glob, json, sys, torch; f = glob.glob(os.environ['GPULENS_REGISTRY_DIR'] + '/*.json');"
          "print(json.dumps({'files': f, 'pid': os.getpid(), 'daemon': os.environ.get('KINETO_USE_DAEMON')}))")


@pytest.mark.slow
def test_a_single_process_job_registers_once_it_imports_torch_and_is_removed_at_exit(tmp_path):
    out = subprocess.run([sys.executable, "-c", SINGLE], capture_output=True, text=True, timeout=120, check=True,
                         env=python_env(GPULENS_REGISTRY_DIR=str(tmp_path), GPULENS_JOB_ID="jx", RANK="5",
                                        LOCAL_RANK="1", WORLD_SIZE="8", LOCAL_WORLD_SIZE="4", GPULENS_ATTEMPT="2",
                                        GPULENS_SOCKET_DIR=str(tmp_path)))
    seen = json.loads(out.stdout)
    assert seen["daemon"] == "1" and len(seen["files"]) == 1  # one record (its step counter is a .steps file)
    assert not list(tmp_path.glob(".*"))                      # and no temp file beside it
    assert seen["files"][0].endswith(f"__p{seen['pid']}.json")
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".json"] == []  # removed at exit


@pytest.mark.slow
def test_the_record_validates_against_the_schema(tmp_path):
    code = "import os, glob, torch; print(open(glob.glob(os.environ['GPULENS_REGISTRY_DIR'] + '/*.json')[0]).read())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         env=python_env(GPULENS_REGISTRY_DIR=str(tmp_path), GPULENS_JOB_ID="jx", RANK="5", LOCAL_RANK="1",
                                        WORLD_SIZE="8", LOCAL_WORLD_SIZE="4", GPULENS_ATTEMPT="2",
                                        GPULENS_SOCKET_DIR=str(tmp_path)))
    rec = RegistrationRecord.from_dict(json.loads(out.stdout))
    assert (rec.job_id, rec.attempt, rec.global_rank, rec.local_rank, rec.base_rank) == ("jx", 2, 5, 1, 4)


@pytest.mark.slow
def test_unwritable_registry_is_one_accurate_stderr_line_and_the_program_runs(tmp_path):
    missing = tmp_path / "does-not-exist"
    out = subprocess.run([sys.executable, "-c", "import torch; print('trained')"], capture_output=True, text=True,
                         timeout=120, env=python_env(GPULENS_REGISTRY_DIR=str(missing), GPULENS_SOCKET_DIR=str(tmp_path)))
    assert out.returncode == 0 and out.stdout.strip() == "trained"
    lines = [ln for ln in out.stderr.splitlines() if "gpulens-hook:" in ln]
    assert len(lines) == 1, out.stderr
    assert "not registered" in lines[0] and "No such file or directory" in lines[0] and str(missing) in lines[0]
    assert "not armed" not in lines[0]  # Kineto's daemon mode is on: saying otherwise would be wrong


def test_the_images_own_sitecustomize_still_runs(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import os\nos.environ['THEIRS_RAN'] = os.environ.get('KINETO_USE_DAEMON', 'unset')\n")
    env = python_env()
    env["PYTHONPATH"] = f"{hook_path()}{os.pathsep}{theirs}"
    out = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('THEIRS_RAN'))"], env=env,
                         capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "1"  # ran, and after arming


def armed_hook_copy(tmp_path: Path, container: str, image_pythonpath: str | None) -> Path:
    """The hook folder as the webhook's init containers leave it in the emptyDir: the hook copied,
    then (image_pythonpath not None) the trainer image's PYTHONPATH saved under image-env/<container>."""
    import shutil
    hook = tmp_path / "opt-gpulens-hook"
    shutil.copytree(hook_path(), hook, ignore=shutil.ignore_patterns("__pycache__"))
    if image_pythonpath is not None:
        (hook / "image-env" / container).mkdir(parents=True)
        (hook / "image-env" / container / "PYTHONPATH").write_text(image_pythonpath)
    return hook


def test_the_images_own_pythonpath_comes_back_after_the_hooks_folder(tmp_path):
    """An image whose ENV sets PYTHONPATH (a module only there, and the image's own sitecustomize)
    loses it to the pod's PYTHONPATH=<hook>; the value the init container saved puts it back, for
    the process and the processes it starts. Without the saved value the same program fails."""
    lib, theirs = tmp_path / "image-lib", tmp_path / "image-site"
    lib.mkdir()
    theirs.mkdir()
    (lib / "their_model.py").write_text("NAME = 'from the image'\n")
    (theirs / "sitecustomize.py").write_text("import os\nos.environ['THEIRS_RAN'] = '1'\n")
    program = ("import os, subprocess, sys, their_model; print(their_model.NAME, os.environ.get('THEIRS_RAN'));"
               "print(subprocess.run([sys.executable, '-c', 'import their_model, sys; print(sys.path.count(%r))'"
               " % their_model.__file__.rsplit('/', 1)[0]], capture_output=True, text=True, check=True).stdout.strip())")
    hook = armed_hook_copy(tmp_path, "trainer", f"{lib}{os.pathsep}{theirs}")
    env = python_env(PYTHONPATH=str(hook), GPULENS_CONTAINER_NAME="trainer")
    out = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["from", "the", "image", "1", "1"], out.stdout    # once on the child's path too
    assert "not armed" not in out.stderr

    bare = armed_hook_copy(tmp_path / "bare", "trainer", None)
    env = python_env(PYTHONPATH=str(bare), GPULENS_CONTAINER_NAME="trainer")
    out = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "No module named 'their_model'" in out.stderr


def test_another_containers_saved_pythonpath_is_not_taken(tmp_path):
    lib = tmp_path / "image-lib"
    lib.mkdir()
    hook = armed_hook_copy(tmp_path, "log-shipper", str(lib))
    env = python_env(PYTHONPATH=str(hook), GPULENS_CONTAINER_NAME="trainer")
    out = subprocess.run([sys.executable, "-c", "import sys; print(%r in sys.path)" % str(lib)], env=env,
                         capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


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
    pids = re.findall(r"worker rank=\d+ pid=(\d+)", out.stdout)
    assert len(pids) == 2
    for pid in pids:  # one accurate line per worker (the launcher, which imported torch too, may add its own)
        assert out.stderr.count(f"(pid {pid}) is not registered") == 1, out.stderr[-2000:]
    assert "not armed" not in out.stderr
