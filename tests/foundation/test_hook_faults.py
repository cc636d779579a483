"""The hook's record under faults: a full, read-only or inode-exhausted registry is one accurate
stderr line and no temp file, training runs on; SIGTERM/SIGINT remove the record while the
trainer's own signal handling stays exactly what it was.

Most cases put a stand-in `torch` package (an empty module named torch) first on PYTHONPATH: the
hook reacts to a module named torch finishing its import, and these mechanics (files, signals)
do not depend on what torch contains, so each case costs milliseconds. One case per fault uses
real torch and a real process group.
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
from tests.tinyfs import tiny_fs


@pytest.fixture
def fake_torch(tmp_path) -> Path:
    d = tmp_path / "standin"
    (d / "torch").mkdir(parents=True)
    (d / "torch" / "__init__.py").write_text('"""Stands for torch: only its import is observed by the hook."""\n')
    return d


def env_for(registry: Path, *, standin: Path | None = None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPULENS_", "KINETO_", "SLURM_", "RANK", "WORLD_"))}
    path = [str(hook_path())] + ([str(standin)] if standin else [])
    env.update(PYTHONPATH=os.pathsep.join(path), GPULENS_REGISTRY_DIR=str(registry), GPULENS_JOB_ID="jf",
               GPULENS_SOCKET_DIR=str(registry.parent), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


@pytest.fixture
def tinyfs(tmp_path):
    fs = tiny_fs(tmp_path / "reg")
    yield fs
    fs.close()


def _hook_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if "gpulens-hook:" in ln]


# --- registry faults ---------------------------------------------------------------------------

REAL = ("import os, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:' + os.environ['PORT'], rank=0, world_size=1)\n"
        "print('trained', os.getpid())\n")


@pytest.mark.slow
@pytest.mark.root
def test_full_registry_real_torch_is_one_accurate_line_and_no_temp_file(tinyfs, tmp_path):
    from tests.conftest import free_port

    tinyfs.fill()
    out = subprocess.run([sys.executable, "-c", REAL], env=env_for(tinyfs.path, PORT=str(free_port())),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.startswith("trained"), out.stderr[-2000:]
    pid = out.stdout.split()[1]
    lines = _hook_lines(out.stderr)
    # one line for the process, although it tried twice (torch import, then init_process_group)
    assert len(lines) == 1, lines
    assert f"(pid {pid}) is not registered" in lines[0] and "No space left on device" in lines[0]
    assert str(tinyfs.path) in lines[0] and "Kineto daemon mode stays on" in lines[0]
    assert "not armed" not in out.stderr
    assert tinyfs.files() == []  # no 0-byte temp file, no record


@pytest.mark.root
@pytest.mark.parametrize("fault, message", [
    ("full", "No space left on device"),
    ("read_only", "Read-only file system"),
    ("no_inodes", "cannot create a file in"),
])
def test_registry_faults_with_the_standin(tinyfs, fake_torch, fault, message):
    if fault == "full":
        tinyfs.fill()
    elif fault == "read_only":
        tinyfs.read_only()
    else:
        n = 0
        try:
            while True:
                (tinyfs.path / f".filler-inode{n}").touch()
                n += 1
        except OSError:
            pass
    out = subprocess.run([sys.executable, "-c", "import torch; print('trained')"],
                         env=env_for(tinyfs.path, standin=fake_torch), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "trained"
    lines = _hook_lines(out.stderr)
    assert len(lines) == 1 and message in lines[0] and "is not registered" in lines[0], out.stderr
    assert [f for f in tinyfs.files() if not f.startswith(".filler")] == []


@pytest.mark.root
def test_a_full_registry_then_space_again_registers_a_later_process(tinyfs, fake_torch):
    tinyfs.fill()
    first = subprocess.run([sys.executable, "-c", "import torch"], env=env_for(tinyfs.path, standin=fake_torch),
                           capture_output=True, text=True, timeout=60)
    assert len(_hook_lines(first.stderr)) == 1
    tinyfs.free()
    code = "import os, torch; print(sorted(n for n in os.listdir(os.environ['GPULENS_REGISTRY_DIR']) if not n.endswith('.steps')))"
    second = subprocess.run([sys.executable, "-c", code], env=env_for(tinyfs.path, standin=fake_torch),
                            capture_output=True, text=True, timeout=60, check=True)
    assert _hook_lines(second.stderr) == [] and len(eval(second.stdout)) == 1


# --- signals -----------------------------------------------------------------------------------

def default_dispositions() -> None:
    """The child starts with SIGINT/SIGTERM at their defaults, as a pod's process does, whatever
    the suite inherited: a suite started in the background (`cmd &` without job control, nohup)
    ignores SIGINT, the child would inherit SIG_IGN, and Python keeps an ignored SIGINT ignored."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def start(registry: Path, standin: Path, code: str) -> subprocess.Popen:
    """`code` runs, then the child prints `ready` and waits for lines on stdin (`check` answers
    whether its record is there, `exit` ends it normally)."""
    loop = ("import os, sys\nprint('ready', flush=True)\nfor line in sys.stdin:\n"
            "    if line.strip() == 'check': print('record', len([f for f in os.listdir(os.environ['GPULENS_REGISTRY_DIR'])"
            " if f.endswith('.json')]), flush=True)\n"
            "    if line.strip() == 'exit': break\n")
    proc = subprocess.Popen([sys.executable, "-c", code + "\n" + loop], env=env_for(registry, standin=standin),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_dispositions)
    proc.before = []  # type: ignore[attr-defined]  # what `code` printed
    while (line := proc.stdout.readline().strip()) != "ready":
        assert line, proc.stderr.read()
        proc.before.append(line)  # type: ignore[attr-defined]
    return proc


def ask(proc: subprocess.Popen, line: str) -> str:
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    return proc.stdout.readline().strip()


@pytest.fixture
def reg(tmp_path) -> Path:
    d = tmp_path / "reg"
    d.mkdir()
    return d


def records(reg: Path) -> list[str]:
    return sorted(p.name for p in reg.iterdir())


def test_sigterm_with_the_default_disposition_removes_the_record_and_still_kills(reg, fake_torch):
    proc = start(reg, fake_torch, "import torch")
    assert ask(proc, "check") == "record 1"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM  # killed by the signal, as without the hook
    assert records(reg) == []


def test_sigint_default_is_still_keyboardinterrupt_and_removes_the_record(reg, fake_torch):
    proc = start(reg, fake_torch, "import torch")
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == -signal.SIGINT and "KeyboardInterrupt" in proc.stderr.read()
    assert records(reg) == []


THEIRS = ("import signal, sys\n"
          "def theirs(signum, frame):\n"
          "    print('theirs', signum, flush=True); sys.exit(7)\n")


@pytest.mark.parametrize("order", ["before", "after"])
def test_the_trainers_handler_is_chained_whenever_it_was_installed(reg, fake_torch, order):
    install = "signal.signal(signal.SIGTERM, theirs)\n"
    check = "print('getsignal', signal.getsignal(signal.SIGTERM) is theirs, flush=True)\n"
    code = THEIRS + (install + "import torch\n" if order == "before" else "import torch\n" + install) + check
    proc = start(reg, fake_torch, code)
    assert proc.before == ["getsignal True"]  # the trainer sees its own handler
    assert ask(proc, "check") == "record 1"
    proc.send_signal(signal.SIGTERM)
    assert proc.stdout.readline().strip() == f"theirs {int(signal.SIGTERM)}"
    assert proc.wait(timeout=30) == 7
    assert records(reg) == []


def test_getsignal_reports_the_trainers_handler(reg, fake_torch):
    code = THEIRS + "import torch\nsignal.signal(signal.SIGTERM, theirs)\n"
    code += "print('getsignal', signal.getsignal(signal.SIGTERM) is theirs, signal.signal(signal.SIGTERM, signal.SIG_DFL) is theirs)"
    proc = subprocess.run([sys.executable, "-c", code], env=env_for(reg, standin=fake_torch), capture_output=True,
                          text=True, timeout=30, check=True)
    assert proc.stdout.split() == ["getsignal", "True", "True"]


def test_an_ignored_sigterm_stays_ignored_and_the_record_stays(reg, fake_torch):
    proc = start(reg, fake_torch, "import signal, torch\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)")
    proc.send_signal(signal.SIGTERM)
    assert ask(proc, "check") == "record 1"  # alive, answering, still registered
    assert ask(proc, "exit") == "" and proc.wait(timeout=30) == 0
    assert records(reg) == []  # removed at exit


def test_a_forked_child_killed_by_sigterm_leaves_the_parents_record(reg, fake_torch):
    # the child says it runs before it is signalled: a signal between fork() and Python's after-fork
    # reset is dropped for any Python-level handler (CPython clears pending signals in the child)
    code = ("import os, signal, time, torch\n"
            "r, w = os.pipe()\n"
            "pid = os.fork()\n"
            "if pid == 0:\n    os.write(w, b'x')\n    time.sleep(60)\n    os._exit(0)\n"
            "os.read(r, 1)\n"
            "os.kill(pid, signal.SIGTERM)\n"
            "_, status = os.waitpid(pid, 0)\n"
            "print('child', os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, flush=True)\n")
    proc = start(reg, fake_torch, code)
    assert proc.before == ["child True"]  # the child died of SIGTERM, as it would have without the hook
    assert ask(proc, "check") == "record 1"  # and its inherited handler did not remove its parent's record  # the child's handler did not remove its parent's record
    ask(proc, "exit")
    assert proc.wait(timeout=30) == 0 and records(reg) == []


def test_a_trainer_that_never_imports_torch_is_untouched_by_signals(reg, fake_torch):
    code = "import signal\nprint(signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, type(signal.signal).__name__)"  # method: ours
    out = subprocess.run([sys.executable, "-c", code], env=env_for(reg, standin=fake_torch), capture_output=True,
                         text=True, timeout=30, check=True)
    assert out.stdout.split() == ["True", "function"] and records(reg) == []
