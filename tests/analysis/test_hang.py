"""The hang analysis on real Flight Recorder dumps (issue 45): a real two-rank gloo job hangs
(tests/analysis/hang_job.py), each rank's dump is written by the trainer hook's own code while its
main thread is blocked, and capture/analysis/hang.py names the rank that holds the others up."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
from gpulens.capture import schemas
from gpulens.capture.agent.flight import FlightUnavailable, dump_path, read_flight_dump, request_flight_dump
from gpulens.capture.agent.hang_evidence import HangTarget, collect_hang_evidence
from gpulens.capture.agent.stacks import StacksUnavailable, read_stacks
from gpulens.capture.analysis.hang import evidence_report, hang_report, where_now
from gpulens.hooks import hook_path

from tests.conftest import free_port

pytestmark = [pytest.mark.timeout(240)]

HERE = Path(__file__).parent
EVIDENCE: dict[str, list[dict]] = {}     # mode -> the hang_evidence documents its run left
LEFT: dict[str, list[str]] = {}          # mode -> the evidence dumps still in its trace folder after
TORCHRUN = str(Path(sys.executable).parent / "torchrun")


def hung_job(tmp_path: Path, mode: str, entered: dict[int, int], dumpers: tuple[int, ...] = (0, 1)
             ) -> tuple[dict[int, dict], dict[int, dict]]:
    """Run hang_job.py in `mode`, armed by the trainer hook, until it hangs at its sixth collective.
    Then, as the agent does: ask each rank's hook over its `flight_socket` for its dump (read back
    and checked by capture/agent/flight.py) until the `dumpers` show the collectives `entered` says
    they must have entered (rank -> last collective_seq_id), the others' requests must go
    unanswered within the bound; and read every rank's stacks from outside (capture/agent/stacks.py)."""
    out = tmp_path / mode
    reg, traces = out / "reg", out / "traces"
    for d in (reg, traces):
        d.mkdir(parents=True)
    sock = Path(tempfile.mkdtemp(prefix="gl-fr-", dir="/tmp"))      # short: a socket path has 108 bytes
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPULENS_", "KINETO_", "SLURM_"))}
    env.update(PYTHONPATH=str(hook_path()), OMP_NUM_THREADS="1", GPULENS_REGISTRY_DIR=str(reg), GPULENS_JOB_ID="hang",
               GPULENS_SOCKET_DIR=str(sock), GPULENS_TRACE_DIR=str(traces))
    logfile = tmp_path / f"{mode}.log"
    log = open(logfile, "w")
    p = subprocess.Popen([TORCHRUN, "--nproc-per-node=2", f"--master-port={free_port()}", str(HERE / "hang_job.py"),
                          str(out), mode], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        end = time.time() + 180
        while logfile.read_text().count(" at 5") < 2:
            assert time.time() < end and p.poll() is None, logfile.read_text()[-3000:]
            time.sleep(0.1)
        pids = {int(r): int(pid) for r, pid in re.findall(r"rank (\d+) pid (\d+) at 5", logfile.read_text())}
        records = {rec["global_rank"]: rec for rec in (json.loads(f.read_text()) for f in reg.glob("*.json"))}
        assert sorted(records) == [0, 1] and {r: rec["pid"] for r, rec in records.items()} == pids, records
        sockets = {r: str(sock / rec["flight_socket"]) for r, rec in records.items()}
        attempt = 0
        while True:     # a rank prints "at 5" just before its call: ask again until its dump shows the call
            attempt += 1
            dumps = {}
            for r in dumpers:
                answer = asyncio.run(request_flight_dump(sockets[r], "c-hang", f"rank-{r}-{attempt}", timeout_s=20))
                path = dump_path(traces, "c-hang", f"rank-{r}-{attempt}")
                assert answer["ok"] and answer["path"] == str(path) and answer["bytes"] == path.stat().st_size, answer
                dumps[r] = read_flight_dump(path)
            last = {r: int(d["pg_status"]["0"]["last_enqueued_collective"]) for r, d in dumps.items()}
            if all(last[r] >= seq for r, seq in entered.items()):
                break
            assert time.time() < end, last
            time.sleep(0.2)
        for r in sorted(set(pids) - set(dumpers)):      # asked, and bounded: no answer, nothing written
            with pytest.raises(FlightUnavailable) as err:
                asyncio.run(request_flight_dump(sockets[r], "c-hang", f"rank-{r}", timeout_s=3))
            assert err.value.reason == "no_answer", err.value
            assert not dump_path(traces, "c-hang", f"rank-{r}").exists()
        stacks = {r: asyncio.run(read_stacks(pid)) for r, pid in sorted(pids.items())}
        # and once more as a hang capture's target takes it: both halves in one document per rank
        evidence = [asyncio.run(collect_hang_evidence(HangTarget(
            "c-hang", f"ev-{r}", r, pids[r], pids[r], sockets[r], str(traces)), flight_timeout_s=3))
            for r in sorted(pids)]
        EVIDENCE[mode] = evidence
        LEFT[mode] = sorted(p.name for p in traces.rglob("ev-*"))
        return dumps, stacks
    finally:
        # torchrun starts each worker in a session of its own: its group alone would leave them hung
        workers = psutil.Process(p.pid).children(recursive=True) if p.poll() is None else []
        if p.returncode is None:     # a reaped torchrun's number may be another process group's by now
            os.killpg(p.pid, signal.SIGKILL)
        for w in workers:
            try:
                w.kill()
            except psutil.NoSuchProcess:
                pass
        p.wait()
        psutil.wait_procs(workers, timeout=30)
        log.close()
        shutil.rmtree(sock, ignore_errors=True)


def hung_job_dumps(tmp_path: Path, mode: str, entered: dict[int, int]) -> dict[int, dict]:
    return hung_job(tmp_path, mode, entered)[0]


@pytest.fixture(scope="module")
def skipped_run(tmp_path_factory):
    return hung_job(tmp_path_factory.mktemp("hang"), "skip", {0: 6})


@pytest.fixture(scope="module")
def skipped(skipped_run):
    return skipped_run[0]


@pytest.fixture(scope="module")
def spinning(tmp_path_factory):
    return hung_job(tmp_path_factory.mktemp("hang"), "spin", {0: 6}, dumpers=(0,))


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


def test_a_rank_spinning_with_the_gil_held_writes_no_dump_yet_its_stack_names_it(spinning):
    """Issue 45: the stuck rank spins in Python holding the GIL, so no thread of the hook runs in
    it (the fixture asserts it wrote no dump when asked); its stack, read from outside, still
    names the frame, and the verdict names the rank with it."""
    dumps, stacks = spinning
    assert sorted(dumps) == [0]
    for doc in stacks.values():
        schemas.validate("python_stacks", doc)
    (gil,) = [t for t in stacks[1]["threads"] if t["owns_gil"]]
    assert gil["name"] == "MainThread" and gil["active"] and gil["frames"][0]["name"] == "spin_holding_the_gil", gil
    assert not any(t["owns_gil"] for t in stacks[0]["threads"]), stacks[0]     # rank 0 waits in gloo, GIL let go
    report = hang_report(dumps, world_size=2, where={1: "pod trainer-1 on node gpu-2"}, stacks=stacks)
    v = report["verdict"]
    assert v.startswith("rank 1 (pod trainer-1 on node gpu-2) wrote no Flight Recorder dump while ranks [0] wait in "
                        "gloo:all_reduce collective_seq_id 6"), v
    assert "rank 1 is now at " in v and "hang_job.py:" in v and "(spin_holding_the_gil), holding the GIL" in v, v
    assert report["now_at"]["1"].endswith("(spin_holding_the_gil), holding the GIL")
    # without the stacks the same dumps cannot name it
    assert hang_report(dumps, world_size=2)["verdict"].startswith("no Flight Recorder dump from ranks [1]")


def test_the_stack_says_where_a_rank_that_skipped_the_collective_is_now(skipped_run):
    dumps, stacks = skipped_run
    v = hang_report(dumps, stacks=stacks)["verdict"]
    assert v.startswith("rank 1 never entered gloo:all_reduce collective_seq_id 6"), v
    # rank 1 sleeps in main (time.sleep is C: no frame of its own), not in torch; rank 0 is left out
    assert "; rank 1 is now at " in v and "hang_job.py:" in v.split("rank 1 is now at ")[1] and "rank 0 is now" not in v, v


@pytest.mark.parametrize("pid, reason", [(999_999_999, "process_gone"), (0, "unreadable"), (True, "unreadable")])
def test_stacks_of_no_process_say_why(pid, reason):
    with pytest.raises(StacksUnavailable) as err:
        asyncio.run(read_stacks(pid))
    assert err.value.reason == reason, err.value


def test_stacks_of_a_process_that_is_not_python_say_so(tmp_path):
    p = subprocess.Popen(["sleep", "60"])
    try:
        with pytest.raises(StacksUnavailable) as err:
            asyncio.run(read_stacks(p.pid))
        assert err.value.reason == "not_python" and "py-spy exit 1" in err.value.detail, err.value
    finally:
        p.kill()
        p.wait()


def test_stacks_without_the_tool_say_so(tmp_path):
    with pytest.raises(StacksUnavailable) as err:
        asyncio.run(read_stacks(os.getpid(), py_spy=str(tmp_path / "py-spy")))
    assert err.value.reason == "tool_missing", err.value


def test_a_tool_that_prints_something_else_is_refused_not_trusted(tmp_path):
    fake = tmp_path / "py-spy"       # stands for a py-spy whose JSON changed shape: refused by the schema
    fake.write_text('#!/bin/sh\necho \'[{"thread_id": "x", "frames": 3}]\'\n')
    fake.chmod(0o755)
    with pytest.raises(StacksUnavailable) as err:
        asyncio.run(read_stacks(os.getpid(), py_spy=str(fake)))
    assert err.value.reason == "unreadable" and "python_stacks" in err.value.detail, err.value


def test_a_hang_captures_evidence_holds_both_halves_or_says_why(spinning, skipped):
    """One `hang_evidence` document per rank, as a hang capture's target archives it: the spinning
    rank's dump is missing for `no_answer` and its stacks are there; the report read from the
    documents alone names the same rank with the same verdict; the hook's dump files are folded in."""
    for mode in ("spin", "skip"):
        for doc in EVIDENCE[mode]:
            schemas.validate("hang_evidence", doc)
    ev = {d["rank"]: d for d in EVIDENCE["spin"]}
    assert ev[0]["flight_recorder"]["dump"] is not None and ev[0]["stacks"]["doc"] is not None, ev[0]["flight_recorder"]
    assert ev[1]["flight_recorder"]["dump"] is None and ev[1]["flight_recorder"]["reason"] == "no_answer"
    assert ev[1]["stacks"]["reason"] is None and where_now(ev[1]["stacks"]["doc"]).endswith("holding the GIL")
    report = evidence_report(EVIDENCE["spin"], world_size=2)
    assert report["missing"] == {"1": {"dump": report["missing"]["1"]["dump"]}}
    assert report["missing"]["1"]["dump"].startswith("no_answer: ")
    assert report["verdict"] == hang_report(spinning[0], world_size=2, stacks=spinning[1])["verdict"]
    assert LEFT["spin"] == [] and LEFT["skip"] == [], LEFT        # the hook's files folded into the documents
    assert report["verdict"].startswith("rank 1 wrote no Flight Recorder dump while ranks [0] wait in"), report["verdict"]
    skip = evidence_report(EVIDENCE["skip"])
    assert skip["verdict"].startswith("rank 1 never entered gloo:all_reduce collective_seq_id 6"), skip["verdict"]
    assert skip["missing"] == {}
