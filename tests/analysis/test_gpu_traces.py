"""The real 2-rank GPU+NCCL traces (HTA's trace_filter set) through the whole analysis.

Numbers are checked three ways: against HTA run directly on the same files (the pipeline must pass
them through unchanged), against values counted in the raw JSON (independent of HTA), and against
golden values for this fixed data set.
"""

from __future__ import annotations

import hashlib
import json
import logging

import pytest

from gpulens.capture import schemas
from gpulens.capture.analysis import AnalyzeOptions, analyze_manifest

from .conftest import CaptureBuilder, raw_events

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # pandas, inside HTA (hta_direct)


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory, trace_filter):
    b = CaptureBuilder(root=tmp_path_factory.mktemp("gpu") / "archive")
    b.add(0, trace_filter[0]).add(1, trace_filter[1]).expect(2).fail(2, "trace_timeout", "no trace before the deadline")
    capture = b.write()
    run = analyze_manifest(capture.manifest_uri, AnalyzeOptions(jobs=2))
    return capture, run


@pytest.fixture(scope="module")
def hta_direct(trace_filter, tmp_path_factory):
    """HTA's own façade on the same files, as its docs show it (explicit rank map)."""
    from hta.trace_analysis import TraceAnalysis
    logging.getLogger("hta").setLevel(logging.ERROR)
    return TraceAnalysis(trace_files={0: str(trace_filter[0]), 1: str(trace_filter[1])},
                         trace_dir=str(tmp_path_factory.mktemp("hta")))


def test_every_rank_is_accounted_for(gpu_run):
    capture, run = gpu_run
    s = run.summary
    assert run.analysed and s["status"] == "analysed" and s["trace_kind"] == "gpu"
    assert s["counts"] == {"expected": 3, "archived": 2, "analysed": 2, "excluded": 0, "missing": 1}
    by_rank = {r["rank"]: r for r in s["ranks"]}
    assert by_rank[0]["status"] == by_rank[1]["status"] == "analysed"
    assert by_rank[2]["status"] == "missing" and by_rank[2]["reason"] == "trace_timeout"
    assert run.report_uri == (capture.dir / "analysis" / "report.html").as_uri()
    assert capture.summary() == s  # what was returned is what was written


def test_summary_is_valid_json_without_nan(gpu_run):
    capture, _ = gpu_run
    text = (capture.dir / "analysis" / "summary.json").read_text()

    def no_constants(name):
        raise AssertionError(f"{name} in summary.json")
    schemas.validate("summary", json.loads(text, parse_constant=no_constants))


def test_summary_names_the_hta_that_ran(gpu_run):
    """The version of the distribution that owns the imported `hta` files (0.5.0 was published as
    HolisticTraceAnalysis, 0.6 as traceinsight; both ship `hta`, so asking one by name can lie)."""
    from importlib import metadata
    from pathlib import Path

    import hta
    here = Path(hta.__file__).resolve()
    owners = {d.version for d in metadata.distributions() for f in (d.files or [])
              if str(f) == "hta/__init__.py" and Path(d.locate_file(f)).resolve() == here}
    _, run = gpu_run
    assert len(owners) == 1 and run.summary["tool"]["hta"] == owners.pop()

def test_all_gpu_analyses_ran(gpu_run):
    _, run = gpu_run
    statuses = {n: a["status"] for n, a in run.summary["analyses"].items()}
    assert statuses == {n: "ok" for n in (
        "temporal_breakdown", "kernel_breakdown", "comm_comp_overlap", "idle_time", "kernel_launch_stats",
        "stragglers", "iteration_times", "cpu_op_breakdown", "user_annotation_breakdown")}


def test_temporal_breakdown_matches_hta(gpu_run, hta_direct):
    _, run = gpu_run
    ours = run.summary["analyses"]["temporal_breakdown"]["result"]["per_rank"]
    theirs = hta_direct.get_temporal_breakdown(visualize=False)
    assert [r["rank"] for r in ours] == [0, 1]
    for row, (_, ref) in zip(ours, theirs.iterrows()):
        assert row["idle_us"] == ref["idle_time(us)"] and row["kernel_us"] == ref["kernel_time(us)"]
        assert row["compute_pct"] == ref["compute_time_pctg"]
    assert [r["idle_pct"] for r in ours] == [53.56, 54.72]
    assert [r["kernel_us"] for r in ours] == [600058.0, 600674.0]


def test_kernel_breakdown_numbers(gpu_run, hta_direct):
    _, run = gpu_run
    res = run.summary["analyses"]["kernel_breakdown"]["result"]
    by_type = {t["kernel_type"]: t for t in res["by_type"]}
    assert by_type["COMMUNICATION"]["pct"] == 55.5 and by_type["COMMUNICATION"]["total_us"] == 305584.0
    assert by_type["COMPUTATION"]["pct"] == 33.6
    ref_types, _ = hta_direct.get_gpu_kernel_breakdown(visualize=False)
    assert sorted(by_type) == sorted(ref_types["kernel_type"])
    nccl = {k["rank"]: k["total_us"] for k in res["top_kernels"] if k["name"].startswith("ncclKernel_SendRecv")}
    assert nccl == {0: 195327.0, 1: 168027.0}


def test_overlap_idle_and_launch_numbers(gpu_run, hta_direct):
    _, run = gpu_run
    a = run.summary["analyses"]
    assert [r["overlap_pct"] for r in a["comm_comp_overlap"]["result"]["per_rank"]] == [11.81, 20.05]
    idle = {(r["rank"], r["stream"]): r for r in a["idle_time"]["result"]["per_stream"]}
    ref, _ = hta_direct.get_idle_time_breakdown(ranks=[0, 1], visualize=False)
    for (rank, stream, cat), value in ref.set_index(["rank", "stream", "idle_category"])["idle_time"].items():
        assert idle[(rank, stream)][f"{cat}_us"] == value
    assert idle[(0, 7)]["idle_us"] == 213825.0 + 1985.0 + 261740.0
    launches = {r["rank"]: r for r in a["kernel_launch_stats"]["result"]["per_rank"]}
    assert launches[0]["launches"] == 602 and launches[1]["launches"] == 577
    assert launches[0]["cpu_duration_us"]["median"] == 7.0


def test_stragglers_and_iterations(gpu_run):
    _, run = gpu_run
    a = run.summary["analyses"]
    st = a["stragglers"]["result"]
    assert st["candidates"] == [1] and st["num_candidates"] == 1 and st["profiler_steps"] == [551]
    assert st["late_start_counts"] == [{"rank": 0, "count": 0}, {"rank": 1, "count": 1}]
    it = a["iteration_times"]["result"]
    # ProfilerStep#552 is the last step: HTA drops it, #551 remains
    assert [(s["rank"], s["step"]) for s in it["steps"]] == [(0, 551), (1, 551)]
    assert it["slowest_rank"] == 1


def test_trace_facts_match_raw_json(gpu_run, trace_filter):
    _, run = gpu_run
    for rank, path in enumerate(trace_filter):
        events = raw_events(path)
        facts = next(r for r in run.summary["ranks"] if r["rank"] == rank)["trace"]
        assert facts["kernels"] == sum(1 for e in events if e.get("cat") == "kernel")
        assert facts["comm_kernels"] == sum(1 for e in events if e.get("cat") == "kernel"
                                            and e["name"].startswith("nccl"))
        assert facts["cpu_ops"] == sum(1 for e in events if e.get("cat") == "cpu_op")
        assert facts["clock"] == "epoch_us" and facts["distributed_rank"] == rank
        assert facts["rank_inserted"] is False  # the file already says its rank


def test_archived_bytes_are_untouched(gpu_run):
    capture, _ = gpu_run
    for a in capture.manifest.artifacts:
        data = capture.trace(a.target_id).read_bytes()
        assert hashlib.sha256(data).hexdigest() == a.sha256
    # beside each trace, only its per-rank summary (the map's output) was added
    assert sorted(p.name for p in (capture.dir / "traces").iterdir()) == [
        "rank-0.analysis.json", "rank-0.json.gz", "rank-1.analysis.json", "rank-1.json.gz"]


def test_stragglers_with_new_nccl_kernel_names(builder, trace_filter, tmp_path):
    """NCCL >= 2.19 names kernels ncclDevKernel_*; HTA's straggler code alone (0.5.0, 0.6.1) fails on them."""
    import gzip

    renamed = []
    for rank, path in enumerate(trace_filter):
        text = gzip.decompress(path.read_bytes()).replace(b'"ncclKernel_', b'"ncclDevKernel_')
        renamed.append(tmp_path / f"dev-{rank}.json")
        renamed[-1].write_bytes(text)
    capture = builder().add(0, renamed[0]).add(1, renamed[1]).write()
    run = analyze_manifest(capture.manifest_uri)
    st = run.summary["analyses"]["stragglers"]
    assert st["status"] == "ok", st["reason"]
    assert st["result"]["nccl_naming"] == "ncclDevKernel" and st["result"]["candidates"] == [1]

    from hta.trace_analysis import TraceAnalysis
    plain = TraceAnalysis(trace_files={0: str(renamed[0]), 1: str(renamed[1])}, trace_dir=str(tmp_path))
    with pytest.raises(ValueError):
        plain.get_potential_stragglers(num_candidates=1)
