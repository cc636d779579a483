"""The hang analysis on real Flight Recorder dumps (issue 45): a real two-rank gloo job hangs
(tests/analysis/hang_job.py), each rank's dump is written by the trainer hook's own code while its
main thread is blocked, and capture/analysis/hang.py names the rank that holds the others up."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gpulens.capture import schemas
from gpulens.capture.analysis.hang import hang_report
from gpulens.hooks import hook_path

from tests.conftest import free_port

pytestmark = [pytest.mark.timeout(240)]

HERE = Path(__file__).parent
TORCHRUN = str(Path(sys.executable).parent / "torchrun")


def hung_job_dumps(tmp_path: Path, mode: str, entered: dict[int, int]) -> dict[int, dict]:
    """Run hang_job.py in `mode` until it hangs at its sixth collective; each rank's dump once it
    shows the collectives `entered` says it must have entered (rank -> last collective_seq_id)."""
    out = tmp_path / mode
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPULENS_", "KINETO_"))}
    env.update(PYTHONPATH=str(hook_path()), OMP_NUM_THREADS="1")
    log = open(tmp_path / f"{mode}.log", "w")
    p = subprocess.Popen([TORCHRUN, "--nproc-per-node=2", f"--master-port={free_port()}", str(HERE / "hang_job.py"),
                          str(out), mode], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        end = time.time() + 180
        while (tmp_path / f"{mode}.log").read_text().count(" at 5") < 2:
            assert time.time() < end and p.poll() is None, (tmp_path / f"{mode}.log").read_text()[-3000:]
            time.sleep(0.1)
        while True:     # a rank prints "at 5" just before its call: ask again until its dump shows the call
            (out / "dump-now").touch()
            files = {r: out / f"rank-{r}.json" for r in (0, 1)}
            while not all(f.exists() for f in files.values()):
                assert time.time() < end and p.poll() is None, (tmp_path / f"{mode}.log").read_text()[-3000:]
                time.sleep(0.05)
            dumps = {r: json.loads(f.read_text()) for r, f in files.items()}
            last = {r: int(d["pg_status"]["0"]["last_enqueued_collective"]) for r, d in dumps.items()}
            if all(last[r] >= seq for r, seq in entered.items()):
                return dumps
            assert time.time() < end, last
            for f in files.values():
                f.unlink()
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        log.close()


@pytest.fixture(scope="module")
def skipped(tmp_path_factory):
    return hung_job_dumps(tmp_path_factory.mktemp("hang"), "skip", {0: 6})


@pytest.fixture(scope="module")
def mismatched(tmp_path_factory):
    return hung_job_dumps(tmp_path_factory.mktemp("hang"), "mismatch", {0: 6, 1: 6})


def test_the_hooks_dumps_are_what_the_schema_says(skipped, mismatched):
    for dump in (*skipped.values(), *mismatched.values()):
        schemas.validate("flight_recorder", dump)
        assert dump["world_size"] == 2 and dump["entries"][-1]["frames"], dump["entries"][-1]


def test_the_rank_that_never_entered_the_collective_is_named_with_its_frame(skipped):
    report = hang_report(skipped, where={1: "pod trainer-1 on node gpu-2"})
    (group,) = report["groups"]
    assert (group["frontier_seq"], group["op"], group["waiting"], group["behind"]) == (6, "gloo:all_reduce", [0], [1])
    assert group["mismatches"] == []
    assert group["ranks"]["1"]["last_entered"] == 5 and group["ranks"]["1"]["last_completed"] == 5
    v = report["verdict"]
    assert v.startswith("rank 1 (pod trainer-1 on node gpu-2) never entered gloo:all_reduce collective_seq_id 6"), v
    assert "hang_job.py:" in v and "(main)" in v, v        # the program's own frame, not torch's wrappers
    assert "rank 0" not in v.split("which ranks")[0], v


def test_ranks_calling_different_collectives_at_one_sequence_id_are_named_with_both_ops(mismatched):
    report = hang_report(mismatched)
    (group,) = report["groups"]
    (m, *_) = group["mismatches"]
    assert m["seq"] == 6
    assert (m["calls"]["0"]["op"], m["calls"]["1"]["op"]) == ("gloo:all_reduce", "gloo:all_gather")
    assert m["calls"]["1"]["output_sizes"] != m["calls"]["0"]["output_sizes"]
    v = report["verdict"]
    assert "disagree at collective_seq_id 6" in v and "gloo:all_reduce" in v and "gloo:all_gather" in v, v


def test_a_rank_without_a_dump_is_never_judged_innocent(skipped):
    report = hang_report({0: skipped[0]}, world_size=2)
    assert report["ranks_without_dumps"] == [1]
    assert report["verdict"].startswith("no Flight Recorder dump from ranks [1]"), report["verdict"]


def test_outside_a_distributed_job_the_hook_says_why_and_writes_nothing(tmp_path):
    code = (f"import sys; sys.path.insert(0, {str(hook_path())!r}); import torch; "
            f"from _gpulens_flight import write_dump; print(write_dump({str(tmp_path / 'd.json')!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         env={k: v for k, v in os.environ.items() if not k.startswith("GPULENS_")})
    assert out.stdout.strip() == "(0, 'torch.distributed is not initialised in this process')"
    assert not (tmp_path / "d.json").exists()
