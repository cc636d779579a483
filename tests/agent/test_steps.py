"""The hook's step counter file, written by the hook's own code and read by the agent's reader:
the layout both sides assume, the mapping of trace spans to step numbers, and bad files."""

from __future__ import annotations

import struct
import sys
import time
from pathlib import Path

import pytest

from gpulens.hooks import hook_path
from gpulens.capture.agent.steps import StepsUnreadable, first_traced_step, read_steps
from gpulens.capture.dynolog.kineto_watch import KinetoWatch

sys.path.insert(0, str(hook_path()))
from _gpulens_steps import STEPS_SLOTS, StepPublisher, steps_filename  # noqa: E402


class Tracker:
    _current_step = 0


def stepped(tmp_path: Path, n: int, *, start: int = 1, gap_s: float = 0.0) -> tuple[StepPublisher, list[int]]:
    pub = StepPublisher(str(tmp_path / steps_filename("pid:[4026531836]", 42)), Tracker)
    times = []
    for step in range(start, start + n):
        Tracker._current_step = step
        pub.on_step()
        times.append(time.time_ns())
        if gap_s:
            time.sleep(gap_s)     # steps apart by more than the spans' width, as real steps are
    return pub, times


def test_the_hook_writes_what_the_agent_reads(tmp_path):
    pub, _ = stepped(tmp_path, 30)
    log = read_steps(pub.path)
    assert log.latest == 30 and log.kineto_iteration == 29
    assert log.steps == tuple(range(1, 31))
    assert abs(log.latest_at - time.time()) < 5
    assert log.rate() is not None and log.rate() > 0
    assert Path(pub.path).name == "steps__ns4026531836__p42.steps"


def test_the_ring_keeps_only_its_last_lap(tmp_path):
    pub, _ = stepped(tmp_path, STEPS_SLOTS + 100)
    log = read_steps(pub.path)
    assert log.latest == STEPS_SLOTS + 100
    assert log.steps[0] == 101 and log.steps[-1] == STEPS_SLOTS + 100 and len(log.steps) == STEPS_SLOTS


def test_a_collection_holds_the_steps_whose_work_lies_inside_it(tmp_path):
    pub, _ = stepped(tmp_path, 10, gap_s=0.002)
    log = read_steps(pub.path)
    mid = (log.times[3] + log.times[4]) / 2, (log.times[6] + log.times[7]) / 2
    assert log.steps_during(*mid) == (5, 8)        # steps whose work (its midpoint) lies inside, edges included
    # Kineto starts and stops inside a post-hook: the starting step's own work is not collected
    assert log.steps_during(log.times[3], log.times[7]) == (5, 8)
    assert log.steps_during(log.times[0] - 10, log.times[0] - 5) is None   # before the ring: cannot tell
    assert first_traced_step(100) == 102


def test_a_forked_child_never_writes_its_parents_file(tmp_path):
    pub, _ = stepped(tmp_path, 3)
    import os
    r, w = os.pipe()
    child = os.fork()
    if child == 0:                      # a forked child (a DataLoader worker, say) that steps
        Tracker._current_step = 99
        pub.on_step()
        os.write(w, b"1" if pub.forked else b"0")
        os._exit(0)
    os.waitpid(child, 0)
    assert os.read(r, 1) == b"1"
    assert read_steps(pub.path).latest == 3 and not pub.forked


def test_closing_unhooks_before_it_unmaps(tmp_path):
    pub, _ = stepped(tmp_path, 2)

    class Handle:
        removed = False

        def remove(self):
            Handle.removed = True
    pub.handle = Handle()
    pub.close()
    assert Handle.removed and not Path(pub.path).exists()


@pytest.mark.parametrize("content, words", [
    (b"", "shorter than its header"),
    (b"NOTSTEPS" + bytes(56), "not a gpulens step file"),
    (struct.pack("<8sIIqq", b"GLSTEPS1", 1, 4096, 5, 1) + bytes(32), "do not fit"),
    (struct.pack("<8sIIqq", b"GLSTEPS1", 1, 0, 5, 1) + bytes(32), "do not fit"),
])
def test_a_file_that_is_not_a_step_file_is_refused_with_the_reason(tmp_path, content, words):
    path = tmp_path / "x.steps"
    path.write_bytes(content)
    with pytest.raises(StepsUnreadable, match=words):
        read_steps(path)


def test_entries_outside_their_slot_or_lap_are_not_believed(tmp_path):
    pub, _ = stepped(tmp_path, 5)
    struct.pack_into("<qq", pub.map, 64 + 7 * 16, 9_999, time.time_ns())   # a step in a slot not its own
    assert 9_999 not in read_steps(pub.path).steps


def test_the_registry_reads_only_a_plain_steps_file_in_its_own_folder(tmp_path):
    from gpulens.capture.agent.registry import WorkerRegistry
    reg = WorkerRegistry(tmp_path)
    pub, _ = stepped(tmp_path, 4)
    assert reg.steps(Path(pub.path).name).latest == 4
    for bad in ("", None, "../x.steps", "/etc/passwd", ".hidden.steps", "r0.json"):
        with pytest.raises(StepsUnreadable):
            reg.steps(bad)


def test_a_settled_iteration_config_no_longer_blocks_the_next_one():
    """An iteration trace that began and ended between two polls was never seen busy; once its
    file landed (settle), the next fetch is not called `another_pending`."""
    said = []
    watch = KinetoWatch(said.append)
    it = "PROFILE_START_ITERATION=0\nACTIVITIES_ITERATIONS=3"
    watch.on_poll("k", 1, 7, True)
    watch.on_fetch("k", 1, 7, "t-iter", it)
    assert watch.holds_unstarted("t-iter")
    assert watch.settle("t-iter") and not watch.holds_unstarted("t-iter")
    watch.on_poll("k", 1, 7, True)
    watch.on_fetch("k", 1, 7, "t-next", "ACTIVITIES_DURATION_MSECS=300")
    assert [o for o in said if o.kind == "refused"] == []
    assert not watch.settle("t-unknown")
