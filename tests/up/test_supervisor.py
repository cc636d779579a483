"""The supervisor restarts crashed children and leaves no process behind when it stops."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from gpulens.up.supervisor import ChildSpec, Supervisor

# a child that starts a grandchild in its own process group and then waits forever
PARENT_WITH_GRANDCHILD = (
    "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']);"
    "open(sys.argv[1], 'w').write(str(p.pid)); time.sleep(600)"
)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); count it as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


async def test_stop_all_kills_children_and_grandchildren(tmp_path):
    sup = Supervisor(tmp_path / "logs")
    marker = tmp_path / "grandchild.pid"
    child = await sup.start(ChildSpec("parent", [sys.executable, "-c", PARENT_WITH_GRANDCHILD, str(marker)]))
    for _ in range(100):
        if marker.exists() and marker.read_text():
            break
        await asyncio.sleep(0.05)
    grandchild = int(marker.read_text())
    assert alive(child.pid) and alive(grandchild)
    await sup.stop_all(timeout_s=5)
    assert not alive(child.pid)
    assert not alive(grandchild)


async def test_crashed_child_is_restarted_then_given_up(tmp_path):
    sup = Supervisor(tmp_path / "logs")
    counter = tmp_path / "runs"
    code = "import sys; f = open(sys.argv[1], 'a'); f.write('x'); sys.exit(3)"
    await sup.start(ChildSpec("crasher", [sys.executable, "-c", code, str(counter)], max_restarts=1))
    for _ in range(100):
        if sup.children["crasher"].state == "failed":
            break
        await asyncio.sleep(0.1)
    assert sup.children["crasher"].state == "failed"
    assert counter.read_text() == "xx"  # first run + one restart, no more
    assert sup.children["crasher"].exit_code == 3
    await sup.stop_all()


async def test_child_that_never_gets_ready_is_a_clear_error(tmp_path):
    sup = Supervisor(tmp_path / "logs")

    async def never() -> bool:
        return False
    with pytest.raises(RuntimeError, match="exited with code 2 before it was ready"):
        await sup.start(ChildSpec("bad", [sys.executable, "-c", "import sys; sys.exit(2)"], ready=never, restart=False))
    await sup.stop_all()


async def test_a_child_reaped_long_ago_never_costs_the_process_that_took_its_number(tmp_path):
    """A child that exited early keeps its entry; at `stop_all` its group is signalled. Once the
    leader is reaped and no member of its group lives, the kernel may hand its number to any new
    process, a session leader of someone else's (a CI run lost an unrelated job's two ranks to a
    SIGKILL this way). Stands for the reuse: the reaped child's entry is given the pid of a live
    stranger leading its own session; `stop_all` must leave it alone and still end what is ours."""
    import subprocess

    sup = Supervisor(tmp_path / "logs")
    early = await sup.start(ChildSpec("early", [sys.executable, "-c", "pass"], restart=False))
    await asyncio.wait_for(early.proc.wait(), 30)
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    try:
        class Reaped:                                     # the exited child, its number now the stranger's
            pid, returncode = stranger.pid, early.proc.returncode

            async def wait(self) -> int:
                return self.returncode
        early.proc = Reaped()
        ours = await sup.start(ChildSpec("ours", [sys.executable, "-c", "import time; time.sleep(600)"]))
        await sup.stop_all(timeout_s=5)
        assert alive(stranger.pid), "stop_all signalled a process group that is no longer its child's"
        assert not alive(ours.pid)
    finally:
        stranger.kill()
        stranger.wait()
