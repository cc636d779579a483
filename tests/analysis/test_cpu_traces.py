"""Real PyTorch CPU traces (no GPU, no distributedInfo): the CPU subset runs, the rest says why not.

Expected numbers are computed here from the raw trace JSON, independently of HTA, applying the one
HTA rule the analyses inherit: the last ProfilerStep (and every CPU event from its start on) is
dropped.
"""

from __future__ import annotations

import hashlib
import math
from collections import defaultdict

import pytest

from gpulens.capture.analysis import AnalyzeOptions, analyze_manifest

from .conftest import CaptureBuilder, raw_events

GPU_ONLY = ("temporal_breakdown", "kernel_breakdown", "comm_comp_overlap", "idle_time", "kernel_launch_stats",
            "stragglers")


def _us(e) -> int:
    """HTA's reading of an ns-resolution event: ts = ceil(ts), end = floor(ts + dur), whole µs."""
    return math.floor(e["ts"] + e["dur"]) - math.ceil(e["ts"])


def _steps(events):
    return sorted(((int(e["name"].split("#")[1]), e["ts"], _us(e)) for e in events
                   if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")))


@pytest.fixture(scope="module")
def stepped_run(tmp_path_factory, torch_traces):
    b = CaptureBuilder(root=tmp_path_factory.mktemp("cpu") / "archive")
    for r in (0, 1):
        b.add(r, torch_traces / f"stepped-rank{r}.json")
    capture = b.write()
    return capture, analyze_manifest(capture.manifest_uri, AnalyzeOptions(jobs=2))


@pytest.fixture(scope="module")
def ondemand_run(tmp_path_factory, torch_traces):
    b = CaptureBuilder(root=tmp_path_factory.mktemp("ondemand") / "archive")
    for r in (0, 1):
        b.add(r, torch_traces / f"ondemand-rank{r}.json")
    capture = b.write()
    return capture, analyze_manifest(capture.manifest_uri, AnalyzeOptions(jobs=1))


def test_gpu_analyses_are_not_applicable_with_the_reason(stepped_run):
    _, run = stepped_run
    s = run.summary
    assert run.analysed and s["trace_kind"] == "cpu_only"
    for name in GPU_ONLY:
        a = s["analyses"][name]
        assert a["status"] == "not_applicable" and a["result"] is None, name
        assert "no GPU activity" in a["reason"], name
    for name in ("iteration_times", "cpu_op_breakdown", "user_annotation_breakdown"):
        assert s["analyses"][name]["status"] == "ok", name


def test_iteration_times_match_the_raw_trace(stepped_run, torch_traces):
    _, run = stepped_run
    res = run.summary["analyses"]["iteration_times"]["result"]
    means = {}
    for r in (0, 1):
        raw = _steps(raw_events(torch_traces / f"stepped-rank{r}.json"))
        assert [s[0] for s in raw] == [1, 2, 3, 4]
        kept = raw[:-1]  # HTA drops the last step
        ours = [s for s in res["steps"] if s["rank"] == r]
        assert [s["step"] for s in ours] == [1, 2, 3]
        for (_, _, dur), s in zip(kept, ours):
            assert s["dur_us"] == dur
        means[r] = sum(d for _, _, d in kept) / len(kept)
        row = next(p for p in res["per_rank"] if p["rank"] == r)
        assert row["steps"] == 3 and row["mean_us"] == round(means[r], 3)
    assert res["slowest_rank"] == max(means, key=means.get)


def test_cpu_op_breakdown_matches_the_raw_trace(stepped_run, torch_traces):
    _, run = stepped_run
    top = run.summary["analyses"]["cpu_op_breakdown"]["result"]["top_ops"]
    for r in (0, 1):
        events = raw_events(torch_traces / f"stepped-rank{r}.json")
        cutoff = _steps(events)[-1][1]  # CPU events from the last step's start on are filtered out
        count, total = defaultdict(int), defaultdict(float)
        for e in events:
            if e.get("ph") == "X" and e.get("cat") == "cpu_op" and e["ts"] < cutoff:
                count[e["name"]] += 1
                total[e["name"]] += _us(e)
        mine = [t for t in top if t["rank"] == r]
        assert mine, r
        for t in mine:
            assert t["count"] == count[t["name"]], t
            assert t["total_us"] == total[t["name"]], t
        assert mine[0]["total_us"] == max(total.values())  # sorted by inclusive time, largest first
        assert count["aten::addmm"] == 2 * 3  # 2 Linear layers x 3 kept steps


def test_user_annotations_leave_profiler_steps_to_iteration_times(stepped_run):
    _, run = stepped_run
    names = {t["name"] for t in run.summary["analyses"]["user_annotation_breakdown"]["result"]["top"]}
    assert "Optimizer.step#SGD.step" in names
    assert not any(n.startswith("ProfilerStep#") for n in names)


def test_rankless_traces_get_a_rank_in_a_copy_only(stepped_run):
    capture, run = stepped_run
    for r in run.summary["ranks"]:
        assert r["trace"]["distributed_rank"] is None and r["trace"]["rank_inserted"] is True
        assert r["trace"]["clock"].startswith("base:")
    for a in capture.manifest.artifacts:  # the archive still holds the original bytes
        data = capture.trace(a.target_id).read_bytes()
        assert hashlib.sha256(data).hexdigest() == a.sha256 and b"distributedInfo" not in data


def test_ondemand_traces_without_steps(ondemand_run, torch_traces):
    _, run = ondemand_run
    a = run.summary["analyses"]
    assert run.analysed
    assert a["iteration_times"]["status"] == "not_applicable" and "ProfilerStep" in a["iteration_times"]["reason"]
    assert a["cpu_op_breakdown"]["status"] == "ok"
    # no ProfilerStep: HTA filters nothing, so every cpu_op event counts
    for r in (0, 1):
        raw = sum(1 for e in raw_events(torch_traces / f"ondemand-rank{r}.json")
                  if e.get("ph") == "X" and e.get("cat") == "cpu_op" and e["name"] == "aten::addmm")
        ours = next(t for t in a["cpu_op_breakdown"]["result"]["top_ops"] if t["rank"] == r and t["name"] == "aten::addmm")
        assert ours["count"] == raw == 2 * 3
