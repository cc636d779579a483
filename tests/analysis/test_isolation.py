"""One failing analysis never sinks the report; applicability is decided before HTA is called."""

from __future__ import annotations

from gpulens.capture.analysis import analyze_manifest
from gpulens.capture.analysis.analyses import DEFAULT_ANALYSES, Analysis
from gpulens.capture.analysis.analyses.stragglers import _NcclNameCompat


def _boom(ta, contents):
    raise AssertionError("compute_time <= kernel_time")  # what HTA raises on mixed clocks


def test_a_failing_analysis_is_reported_and_the_rest_run(builder, trace_filter):
    capture = builder().add(0, trace_filter[0]).add(1, trace_filter[1]).write()

    def counted(ta, contents):  # runs on each rank's worker, with that rank alone
        return {"ranks": list(contents.ranks)}

    analyses = [DEFAULT_ANALYSES[0], Analysis("boom", "Always fails", lambda c: None, _boom),
                Analysis("after", "Runs after the failure", lambda c: None, counted),
                Analysis("never", "Not applicable", lambda c: "not for these traces", _boom)]
    run = analyze_manifest(capture.manifest_uri, analyses=analyses)
    a = run.summary["analyses"]
    assert list(a) == ["temporal_breakdown", "boom", "after", "never"]
    assert a["boom"] == {"title": "Always fails", "status": "failed", "seconds": a["boom"]["seconds"],
                         "reason": "AssertionError: compute_time <= kernel_time", "result": None}
    assert a["after"]["status"] == "ok" and a["after"]["result"] == {"ranks": [0, 1]}  # one run per rank, merged
    assert a["never"]["status"] == "not_applicable" and a["never"]["reason"] == "not for these traces"
    assert a["temporal_breakdown"]["status"] == "ok" and run.analysed
    html = (capture.dir / "analysis" / "report.html").read_text()
    assert "AssertionError: compute_time &lt;= kernel_time" in html


def test_only_failures_means_nothing_analysed(builder, trace_filter):
    capture = builder().add(0, trace_filter[0]).write()
    run = analyze_manifest(capture.manifest_uri, analyses=[Analysis("boom", "Fails", lambda c: None, _boom)])
    assert not run.analysed and run.summary["status"] == "nothing_analysed"


def test_new_nccl_kernel_names_reach_htas_straggler_code():
    class Table:
        def get_sym_table(self):
            return ["aten::mm", "ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)", "ncclKernel_SendRecv(y)"]

    view = _NcclNameCompat(Table())
    names = view.get_sym_table()
    assert [n.startswith("ncclKernel") for n in names] == [False, True, True]
    assert view.get_sym_id_map()[names[1]] == 1  # ids unchanged, so the DataFrame still matches
    assert len(set(names)) == 3
