"""Staging for HTA (rank written into a copy) and bounded parse parallelism, tested at the mechanism."""

from __future__ import annotations

import concurrent.futures
import gzip
import hashlib
import json
import multiprocessing.pool

import pytest

from capture.analysis import AnalyzeOptions, analyze_manifest
from capture.analysis.trace_inspection import InspectJob, inspect_trace


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


def test_parsing_parallelism_is_bounded_even_on_a_big_machine(builder, trace_filter, tmp_path, monkeypatch):
    """HTA would fork min(cpu_count, ranks) parsers; pretend there are 16 CPUs and record every pool."""
    import hta.common.trace as hta_trace

    monkeypatch.setattr(hta_trace.mp, "cpu_count", lambda: 16)
    hta_pools, executors = [], []
    real_pool_init = multiprocessing.pool.Pool.__init__
    real_executor_init = concurrent.futures.ProcessPoolExecutor.__init__

    def recording_pool_init(self, processes=None, *args, **kwargs):
        hta_pools.append(processes)
        real_pool_init(self, processes, *args, **kwargs)

    def recording_executor_init(self, max_workers=None, *args, **kwargs):
        executors.append(max_workers)
        real_executor_init(self, max_workers, *args, **kwargs)

    monkeypatch.setattr(multiprocessing.pool.Pool, "__init__", recording_pool_init)
    monkeypatch.setattr(concurrent.futures.ProcessPoolExecutor, "__init__", recording_executor_init)
    b = builder()
    for r in range(5):
        doc = json.loads(gzip.decompress(trace_filter[r % 2].read_bytes()))
        doc["distributedInfo"]["rank"] = r
        b.add(r, gzip.compress(json.dumps(doc).encode()), file_name=f"rank-{r}.json.gz")
    run = analyze_manifest(b.write().manifest_uri, AnalyzeOptions(jobs=2))
    assert run.summary["counts"]["analysed"] == 5
    assert hta_pools == []           # HTA's own CPU-count-wide pool is never used
    assert executors == [2, 2]       # inspection, then parsing: --jobs workers each, for 5 ranks


def test_a_worker_killed_while_parsing_costs_only_its_rank(builder, trace_filter, monkeypatch):
    """As if the OOM killer took the worker parsing rank 1: the pool breaks, nothing hangs."""
    import os
    import signal

    from capture.analysis import trace_inspection

    real = trace_inspection._facts

    def dies_on_rank_1(data, compressed):
        if b'"rank": 1' in bytes(data[:4096]):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(data, compressed)

    monkeypatch.setattr(trace_inspection, "_facts", dies_on_rank_1)  # inherited by the forked workers
    capture = builder().add(0, trace_filter[0]).add(1, trace_filter[1]).write()
    run = analyze_manifest(capture.manifest_uri, AnalyzeOptions(jobs=2))
    status = {r["rank"]: (r["status"], r["reason"], r["detail"]) for r in run.summary["ranks"]}
    assert status[0][:2] == ("analysed", None)
    assert status[1][:2] == ("excluded", "unreadable") and "worker inspecting this trace died" in status[1][2]
    assert run.analysed


def test_a_parser_killed_in_hta_costs_only_its_rank(builder, trace_filter, monkeypatch):
    """The same for HTA's parse step: the rank is excluded as hta_parse_failed, the rest analysed."""
    import os
    import signal

    import hta.common.trace as hta_trace

    real = hta_trace.parse_trace_file

    def dies_on_rank_1(path, cfg=None):
        if path.endswith("rank-1.json.gz"):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(path, cfg)

    monkeypatch.setattr(hta_trace, "parse_trace_file", dies_on_rank_1)
    capture = builder().add(0, trace_filter[0]).add(1, trace_filter[1]).write()
    run = analyze_manifest(capture.manifest_uri, AnalyzeOptions(jobs=2))
    status = {r["rank"]: (r["status"], r["reason"], r["detail"]) for r in run.summary["ranks"]}
    assert status[0][:2] == ("analysed", None)
    assert status[1][:2] == ("excluded", "hta_parse_failed") and "died" in status[1][2]
    assert run.summary["counts"]["analysed"] == 1 and run.analysed
    assert [r["rank"] for r in run.summary["analyses"]["temporal_breakdown"]["result"]["per_rank"]] == [0]
