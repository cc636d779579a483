"""summary.schema.json accepts what analysis writes and rejects what it must never write."""

from __future__ import annotations

import copy

import pytest

from gpulens.capture import schemas
from gpulens.capture.analysis.summary import summary_json


def _minimal() -> dict:
    return {
        "schema_version": 1, "status": "analysed",
        "capture": {"capture_id": "c-1", "job_id": "train", "attempt": 0, "manifest_uri": "file:///a/c-1/manifest.json",
                    "requested_at": 1.0, "duration_ms": 1000, "fully_succeeded": True},
        "generated_at": 2.0, "tool": {"gpulens": "0.1.0", "hta": "0.5.0"}, "trace_kind": "gpu",
        "counts": {"expected": 1, "archived": 1, "analysed": 1, "excluded": 0, "missing": 0},
        "ranks": [{"rank": 0, "target_id": "rank-0", "status": "analysed", "reason": None, "detail": "", "trace": None}],
        "analyses": {"comm_comp_overlap": {"title": "t", "status": "ok", "reason": None, "seconds": 0.1,
                                           "result": {"per_rank": [{"rank": 0, "overlap_pct": 12.5}]}}},
        "outputs": {"summary_uri": "file:///a/c-1/analysis/summary.json", "report_uri": "file:///a/c-1/analysis/report.html"},
    }


def test_summary_is_a_registered_schema():
    assert "summary" in schemas.SCHEMA_NAMES
    schemas.validate("summary", _minimal())


def _broken(path: list, value) -> dict:
    doc = copy.deepcopy(_minimal())
    node = doc
    for key in path[:-1]:
        node = node[key]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return doc


@pytest.mark.parametrize("path,value,field", [
    (["status"], "ok", "status"),
    (["analyses", "comm_comp_overlap", "result"], None, ""),                           # ok needs a result
    (["analyses", "comm_comp_overlap", "status"], "not_applicable", ""),             # ...and n/a needs a reason, no result
    (["analyses", "comm_comp_overlap", "result", "per_rank", 0, "overlap_pct"], "12%", "result"),  # via oneOf
    (["ranks", 0, "status"], "skipped", "status"),
    (["ranks", 0, "reason"], KeyError, "reason"),
    (["outputs", "report_uri"], "http://x/report.html", "report_uri"),
    (["extra"], 1, "extra"),
])
def test_schema_rejects(path, value, field):
    errs = schemas.errors("summary", _broken(path, value))
    assert errs, path
    if field:
        assert any(e.field.endswith(field) for e in errs), [e.field for e in errs]


def test_nan_never_reaches_the_file():
    doc = _minimal()
    doc["analyses"]["comm_comp_overlap"]["result"]["per_rank"][0]["overlap_pct"] = float("nan")
    with pytest.raises(ValueError):
        summary_json(doc)


def test_version_2_adds_the_cross_rank_section_and_version_1_still_reads():
    doc = _minimal()
    schemas.validate("summary", doc)  # a version-1 summary (an older baseline) stays valid
    doc.update(schema_version=2, cross_rank={"status": "ok", "why": "rank 1 ...", "iterations": [1, 2], "per_rank": [],
                                             "stragglers": [{"rank": 1, "more_us_per_step": 5.0, "more_pct_of_step": 50.0,
                                                             "slow_iterations": 2, "of_iterations": 2,
                                                             "consistent": True, "differs": []}]})
    schemas.validate("summary", doc)
    for bad in ({"schema_version": 3}, {"cross_rank": {"status": "maybe", "why": "x", "iterations": [], "per_rank": [],
                                                       "stragglers": []}}):
        with pytest.raises(schemas.SchemaError):
            schemas.validate("summary", {**doc, **bad})


def test_rank_summary_schema_refuses_what_the_reduce_could_misread():
    doc = {"schema_version": 1, "rank": 0, "target_id": "rank-0", "artifact_uri": "file:///a/t.json", "sha256": "0" * 64,
           "status": "excluded", "reason": "checksum_mismatch", "detail": "x", "facts": None, "contents": None,
           "analyses": {}, "evidence": {"rank": None, "error": None}, "tool": {"gpulens": "0", "hta": None},
           "seconds": {}}
    schemas.validate("rank_summary", doc)
    for bad in ({"status": "lost"}, {"rank": -1}, {"analyses": {"x": {"status": "ok"}}}, {"surprise": 1}):
        with pytest.raises(schemas.SchemaError):
            schemas.validate("rank_summary", {**doc, **bad})
