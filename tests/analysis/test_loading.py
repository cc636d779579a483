"""Staging for HTA (rank written into a copy) and bounded parallelism (Dask workers), tested at the mechanism."""

from __future__ import annotations

import gzip
import hashlib
import json
import os

import pytest

from gpulens.capture.analysis import AnalyzeOptions, analyze_manifest
from gpulens.capture.analysis.trace_inspection import InspectJob, inspect_trace


def _job(path, tmp_path, rank=3, **kw):
    data = path.read_bytes()
    stage = tmp_path / "stage"
    stage.mkdir(exist_ok=True)
    return InspectJob(rank, f"rank-{rank}", str(path), kw.get("sha", hashlib.sha256(data).hexdigest()),
                      kw.get("size", len(data)), str(stage))


@pytest.mark.parametrize("compress", [False, True])
def test_rankless_trace_gets_its_rank_in_a_copy_hta_can_read(torch_traces, tmp_path, compress):
    from hta.common.trace_file import create_rank_to_trace_dict

    original = (torch_traces / "ondemand-rank0.json").read_bytes()
    src = tmp_path / ("in.json.gz" if compress else "in.json")
    src.write_bytes(gzip.compress(original) if compress else original)
    before = src.read_bytes()
    out = inspect_trace(_job(src, tmp_path, rank=3))
    assert out.exclusion is None and out.facts.rank_inserted and out.facts.compressed is compress
    staged = open(out.hta_path, "rb").read()
    text = gzip.decompress(staged) if compress else staged
    doc = json.loads(text)
    assert doc["distributedInfo"] == {"rank": 3}
    assert {k: v for k, v in doc.items() if k != "distributedInfo"} == json.loads(original)
    ok, mapping = create_rank_to_trace_dict([out.hta_path])  # HTA's own regex finds the rank now
    assert ok and list(mapping) == [3]
    assert src.read_bytes() == before  # the fetched copy is not touched


def test_a_trace_with_a_rank_is_staged_unchanged(trace_filter, tmp_path):
    out = inspect_trace(_job(trace_filter[1], tmp_path, rank=1))
    assert out.exclusion is None and not out.facts.rank_inserted
    assert open(out.hta_path, "rb").read() == trace_filter[1].read_bytes()
    assert out.hta_path.endswith("rank-1.json.gz")


def test_size_alone_is_not_trusted(trace_filter, tmp_path):
    out = inspect_trace(_job(trace_filter[0], tmp_path, rank=0, sha="0" * 64))
    assert out.exclusion.value == "checksum_mismatch" and out.hta_path is None
    assert not list((tmp_path / "stage").iterdir())  # nothing staged for HTA


def test_ranks_run_on_at_most_jobs_workers_one_rank_at_a_time(builder, trace_filter):
    """5 ranks, --jobs 2: two Dask worker processes share them (never one process per rank, never
    HTA's CPU-count-wide pool: each worker parses the one rank it holds in its own process)."""
    b = builder()
    for r in range(5):
        doc = json.loads(gzip.decompress(trace_filter[r % 2].read_bytes()))
        doc["distributedInfo"]["rank"] = r
        b.add(r, gzip.compress(json.dumps(doc).encode()), file_name=f"rank-{r}.json.gz")
    capture = b.write()
    run = analyze_manifest(capture.manifest_uri, AnalyzeOptions(jobs=2))
    assert run.summary["counts"]["analysed"] == 5
    docs = [json.loads((capture.dir / "traces" / f"rank-{r}.analysis.json").read_text()) for r in range(5)]
    pids = {d["worker"]["pid"] for d in docs}
    assert 1 <= len(pids) <= 2 and os.getpid() not in pids  # never the driver itself
