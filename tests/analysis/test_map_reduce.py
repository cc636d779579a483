"""Map per rank, reduce across ranks: each rank analysed alone gives what one HTA over all ranks gave,
and the capture's answer is reduced from the per-rank summaries alone."""

from __future__ import annotations

import copy
import json
import logging
import socket

import pytest

from gpulens.capture import schemas
from gpulens.capture.analysis import analyze_manifest
from gpulens.capture.analysis.analyses import DEFAULT_ANALYSES
from gpulens.capture.analysis.contents import combine_contents, describe
from gpulens.capture.analysis.hta_loading import _assemble, _parse, facade, load_rank
from gpulens.capture.analysis.manifest_reading import read_manifest
from gpulens.capture.analysis.reduce import reduce_ranks
from gpulens.capture.analysis.summary import build_summary
from gpulens.ground.logs import get_logger

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # pandas, inside HTA


@pytest.fixture(scope="module")
def one_hta_and_per_rank(trace_filter, tmp_path_factory):
    """The same two ranks loaded both ways: into one HTA trace (the single-process path before the
    split), and each into its own (the map step)."""
    from hta.common.trace import Trace
    logging.getLogger("hta").setLevel(logging.ERROR)
    d = str(tmp_path_factory.mktemp("hta"))
    files = {0: str(trace_filter[0]), 1: str(trace_filter[1])}
    whole = Trace(trace_files=dict(files), trace_dir=d)
    _assemble(whole, {r: _parse(p, whole.parser_config) for r, p in files.items()}, files)
    log = get_logger("test")
    alone = {r: load_rank(r, p, d, log) for r, p in files.items()}
    return whole, alone


def _hta_stragglers(whole, contents) -> dict:
    """HTA's own straggler call over all ranks in one trace (what the analysis did before the split)."""
    from hta.analyzers.straggler import find_stragglers_with_late_start_comm_kernels

    from gpulens.capture.analysis.analyses.stragglers import _NcclNameCompat, candidates_wanted

    counts = {}

    def impl(df, symbol_table, n, visualize):
        table = symbol_table if contents.legacy_nccl_names else _NcclNameCompat(symbol_table)
        series = find_stragglers_with_late_start_comm_kernels(df, table, n, False)
        counts.update({int(r): int(v) for r, v in series.items()})
        return series

    wanted = candidates_wanted(len(contents.ranks))
    found = facade(whole).get_potential_stragglers(num_candidates=wanted, visualize=False,
                                                   straggler_identification_impl=impl)
    return {"candidates": [int(r) for r in found], "num_candidates": wanted,
            "profiler_steps": list(contents.profiler_steps),
            "late_start_counts": [{"rank": r, "count": c} for r, c in sorted(counts.items())],
            "nccl_naming": "ncclKernel" if contents.legacy_nccl_names else "ncclDevKernel"}


def test_every_analysis_merged_from_ranks_equals_one_hta_over_all_ranks(one_hta_and_per_rank):
    whole, alone = one_hta_and_per_rank
    contents_all = describe(whole)
    per_rank_contents = {r: describe(t) for r, t in alone.items()}
    assert combine_contents(list(per_rank_contents.values())) == contents_all
    compared = []
    for analysis in DEFAULT_ANALYSES:
        if analysis.applies(contents_all) is not None:
            continue
        # the stragglers' map step is an extract; over all ranks at once it is HTA's own call
        expected = (_hta_stragglers(whole, contents_all) if analysis.name == "stragglers"
                    else analysis.run(facade(whole), contents_all))
        parts = [analysis.run(facade(alone[r]), per_rank_contents[r]) for r in sorted(alone)
                 if analysis.applies_to_rank(per_rank_contents[r]) is None]
        assert analysis.combine(parts, contents_all) == expected, analysis.name
        compared.append(analysis.name)
    # the GPU set exercises every analysis that compares or sums across ranks
    assert {"stragglers", "kernel_breakdown", "iteration_times", "temporal_breakdown"} <= set(compared)


def test_stragglers_merge_uses_htas_common_time_axis(one_hta_and_per_rank):
    """Each rank alone is aligned to its own first event; the merge must shift it back (min_ts)."""
    from gpulens.capture.analysis.analyses import stragglers

    whole, alone = one_hta_and_per_rank
    contents = {r: describe(t) for r, t in alone.items()}
    parts = [stragglers.run(facade(alone[r]), contents[r]) for r in sorted(alone)]
    assert parts[0]["min_ts"] != parts[1]["min_ts"]  # the ranks did not start at the same instant
    merged = stragglers.merge(parts, combine_contents(list(contents.values())))
    assert merged["late_start_counts"] == [{"rank": 0, "count": 0}, {"rank": 1, "count": 1}]
    # had rank 0 started a second later on the common clock, its kernels would start late: it is named
    later = [dict(parts[0], min_ts=parts[0]["min_ts"] + 1_000_000), parts[1]]
    assert stragglers.merge(later, combine_contents(list(contents.values())))["candidates"] == [0]


def test_rank_summaries_are_written_next_to_their_traces(builder, trace_filter):
    capture = builder().add(0, trace_filter[0]).add(1, trace_filter[1]).write()
    run = analyze_manifest(capture.manifest_uri)
    for a in capture.manifest.artifacts:
        path = capture.dir / "traces" / f"{a.target_id}.analysis.json"
        doc = schemas.validate("rank_summary", json.loads(path.read_text()))
        assert (doc["rank"], doc["status"], doc["sha256"]) == (a.rank, "analysed", a.sha256)
        assert doc["tool"]["hta"] == run.summary["tool"]["hta"]
        assert doc["worker"]["peak_rss_bytes"] > 0
    assert run.summary["counts"]["analysed"] == 2
    # where they ran: `gpulens analyze`'s own local cluster, each rank's worker host named
    assert run.summary["analysed_on"] == {"scheduler": "local", "workers": 2}
    assert [r["worker"] for r in run.summary["ranks"]] == [socket.gethostname()] * 2
    assert "Ranks analysed on a local Dask cluster (2 workers)" in (capture.dir / "analysis" / "report.html").read_text()


def test_the_reduce_needs_only_the_rank_summaries(builder, trace_filter):
    """Re-reduced from the archived rank summaries, with the traces gone: the same summary.json."""
    capture = builder().add(0, trace_filter[0]).add(1, trace_filter[1]).expect(2).write()
    run = analyze_manifest(capture.manifest_uri)
    for a in capture.manifest.artifacts:
        capture.trace(a.target_id).unlink()
    summaries = [json.loads((capture.dir / "traces" / f"{a.target_id}.analysis.json").read_text())
                 for a in capture.manifest.artifacts]
    source = read_manifest(capture.manifest_uri)
    reduced = reduce_ranks(source.manifest, copy.deepcopy(summaries), list(DEFAULT_ANALYSES), get_logger("test"))
    again = build_summary(source, reduced.plan, reduced.contents, reduced.results, reduced.hta,
                          run.summary_uri, run.report_uri, evidence=reduced.evidence, cross_rank=reduced.cross_rank,
                          analysed_on=run.summary["analysed_on"], workers=[s["worker"]["host"] for s in summaries])
    original = dict(run.summary)
    for s in (again, original):
        s.pop("generated_at")
        for a in s["analyses"].values():
            a.pop("seconds")
    assert again == original
    # and the reduce really reads them: a rank whose summary says it failed its checks is excluded
    summaries[1].update(status="excluded", reason="checksum_mismatch", detail="test")
    reduced = reduce_ranks(source.manifest, summaries, list(DEFAULT_ANALYSES), get_logger("test"))
    assert [e.rank for e in reduced.plan.with_status("analysed")] == [0]
    assert reduced.contents.ranks == (0,)
