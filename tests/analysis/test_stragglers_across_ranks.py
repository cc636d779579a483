"""The cross-rank straggler section on a real multi-rank torch job (CPU only, DDP over gloo) with one
rank slowed: it names that rank, says by how much and how consistently, and what differs. Also on
the same job as a plain loop that never calls `prof.step()` (no ProfilerStep#N markers: what an
on-demand capture of most loops holds), its steps taken between the optimizer's own spans."""

from __future__ import annotations

import pytest

from gpulens.capture.analysis import analyze_manifest
from gpulens.capture.analysis.cross_rank import stragglers

from .conftest import DDP_SLOW_RANK, DDP_WORLD, CaptureBuilder, raw_events

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


@pytest.fixture(scope="module")
def ddp_run(ddp_traces, tmp_path_factory):
    b = CaptureBuilder(root=tmp_path_factory.mktemp("ddp") / "archive")
    for r in range(DDP_WORLD):
        b.add(r, ddp_traces / f"rank-{r}.json")
    return analyze_manifest(b.write().manifest_uri)


def test_the_slowed_rank_is_named_with_how_much_and_how_often(ddp_run):
    s = ddp_run.summary
    assert s["trace_kind"] == "cpu_only" and s["counts"]["analysed"] == DDP_WORLD
    x = s["cross_rank"]
    assert x["status"] == "ok"
    top, *others = x["stragglers"]
    assert top["rank"] == DDP_SLOW_RANK
    # a loaded machine may make another rank slow in an iteration: never consistently, never by as much
    assert all(not o["consistent"] and (o["more_us_per_step"] or 0) < 0.25 * top["more_us_per_step"] for o in others)
    assert top["consistent"] and top["slow_iterations"] == top["of_iterations"] == len(x["iterations"]) >= 3
    assert top["more_pct_of_step"] > 30  # ~80 ms of sleep per step in a step of a few ms of work
    assert f"rank {DDP_SLOW_RANK}" in x["why"]
    assert top["differs"][0]["what"] == "data-loader wait"  # its input pipeline, not its compute
    # the step times alone do not tell: DDP keeps the ranks in lock step (the others wait in all-reduce)
    per = {r["rank"]: r for r in x["per_rank"]}
    steps = [per[r]["step_median_us"] for r in range(DDP_WORLD)]
    assert max(steps) < 1.5 * min(steps)
    others = [per[r]["collective_median_us"] for r in range(DDP_WORLD) if r != DDP_SLOW_RANK]
    assert min(others) > 2 * per[DDP_SLOW_RANK]["collective_median_us"]
    html = (ddp_run.summary["outputs"]["report_uri"]).removeprefix("file://")
    assert "Stragglers across ranks" in open(html).read()


def test_no_straggler_when_ranks_do_the_same_work():
    steps = {r: [{"step": i, "dur_us": 1000.0, "collective_us": 400.0 + r} for i in range(1, 5)] for r in range(4)}
    x = stragglers(steps, None)
    assert x["status"] == "ok" and x["stragglers"] == [] and "no rank" in x["why"]


def test_without_collectives_the_slow_step_is_the_straggler_and_inconsistency_is_said():
    steps = {r: [{"step": i, "dur_us": 1000.0, "collective_us": 0.0} for i in range(1, 5)] for r in range(3)}
    steps[1][2]["dur_us"] = 1500.0  # rank 1 slow in one iteration of four
    x = stragglers(steps, None)
    [top] = x["stragglers"]
    assert top["rank"] == 1 and top["slow_iterations"] == 1 and top["of_iterations"] == 4 and not top["consistent"]


def test_one_rank_with_steps_is_not_enough():
    x = stragglers({0: [{"step": 1, "dur_us": 1.0, "collective_us": 0.0}], 1: []}, None)
    assert x["status"] == "not_applicable" and "two or more" in x["why"]


def test_in_lock_step_the_rank_the_others_wait_for_is_named():
    """Equal step times (a synchronous job): only the time the others spend inside collectives tells."""
    steps = {r: [{"step": i, "dur_us": 1000.0, "collective_us": 100.0 if r == 2 else 900.0} for i in range(1, 5)]
             for r in range(4)}
    ev = [{"rank": r, "steps": 4, "profile_unit": "step", "profile": [],
           "input_wait": {"per_step_us": 850.0 if r == 2 else 50.0}, "host_blocking": {"per_step_us": 10.0},
           "kernel_per_step_us": None} for r in range(4)]
    x = stragglers(steps, ev)
    [top] = x["stragglers"]
    assert top["rank"] == 2 and top["consistent"] and top["more_us_per_step"] == 800.0
    assert top["more_pct_of_step"] == 80.0
    assert top["differs"] == [{"what": "data-loader wait", "us_per_step": 850.0, "others_median_us": 50.0,
                               "delta_us": 800.0}]  # host blocking is equal; kernel time cannot be seen (None)


def _plain_capture(traces, root, iterations=None):
    b = CaptureBuilder(root=root)
    for r in range(DDP_WORLD):
        b.add(r, traces / f"rank-{r}.json", iterations=iterations)
    return analyze_manifest(b.write().manifest_uri)


@pytest.fixture(scope="module")
def plain_run(ddp_plain_traces, tmp_path_factory):
    return _plain_capture(ddp_plain_traces, tmp_path_factory.mktemp("plain") / "archive")


def test_a_plain_loop_without_step_markers_still_names_its_straggler(plain_run, ddp_plain_traces):
    """No marker anywhere in the input (checked), six optimizer steps: five whole steps per rank,
    numbered from each trace's first optimizer step and lined up across ranks by time."""
    for r in range(DDP_WORLD):
        names = [e.get("name", "") for e in raw_events(ddp_plain_traces / f"rank-{r}.json")]
        assert not any(n.startswith("ProfilerStep#") for n in names)
        assert sum(n.startswith("Optimizer.step#") for n in names) == 6
    s = plain_run.summary
    x = s["cross_rank"]
    assert x["status"] == "ok" and x["numbering"] == "relative", x
    assert x["iterations"] == [1, 2, 3, 4, 5]
    top, *others = x["stragglers"]
    assert top["rank"] == DDP_SLOW_RANK and top["consistent"], x
    assert all(not o["consistent"] and (o["more_us_per_step"] or 0) < 0.25 * top["more_us_per_step"] for o in others)
    assert top["more_pct_of_step"] > 30 and top["differs"][0]["what"] == "data-loader wait"
    # the evidence is per step too (not per second of trace), on the same windows
    ev = {e["rank"]: e for e in s["evidence"]["per_rank"]}
    assert all(ev[r]["steps"] == 5 and ev[r]["step_numbering"] == "relative" and ev[r]["profile_unit"] == "step"
               for r in range(DDP_WORLD))
    slow = ev[DDP_SLOW_RANK]["input_wait"]["per_step_us"]
    assert all(slow > 5 * ev[r]["input_wait"]["per_step_us"] for r in range(DDP_WORLD) if r != DDP_SLOW_RANK)


def test_an_iteration_captures_own_step_numbers_number_the_steps(ddp_plain_traces, tmp_path):
    """An iteration capture's manifest says which optimizer steps each trace holds (the hook's
    count): those numbers, not relative ones, are the iterations compared."""
    iterations = {"requested": 6, "roundup": 1, "start": 40, "numbering": "optimizer_step", "first": 41,
                  "last": 46, "optimizer_steps": 6, "stepped": True}
    x = _plain_capture(ddp_plain_traces, tmp_path / "archive", iterations).summary["cross_rank"]
    assert x["numbering"] == "optimizer_step" and x["iterations"] == [42, 43, 44, 45, 46], x
    assert x["stragglers"][0]["rank"] == DDP_SLOW_RANK


def test_relative_steps_are_lined_up_by_when_they_end():
    """Rank 1's trace began one step later than rank 0's (its first window is rank 0's second): the
    reduce pairs the steps that ended together, not the ones with the same index."""
    def ranks_steps(offset, slow_at=None):
        return [{"step": k, "numbering": "relative", "dur_us": 1000.0, "end_us": 1000.0 * (k + offset + 1) + 3,
                 "collective_us": 100.0 if slow_at == k + offset else 900.0} for k in range(1, 5)]
    x = stragglers({0: ranks_steps(0), 1: ranks_steps(1, slow_at=3)}, None)
    assert x["numbering"] == "relative" and x["iterations"] == [2, 3, 4], x
    [top] = x["stragglers"]
    assert top["rank"] == 1 and top["slow_iterations"] == 1  # the one step it was slow in, at its own time
