"""Only what the manifest names is read, only verified bytes are analysed, and every exclusion is reported."""

from __future__ import annotations

import gzip
import hashlib
import json

import pytest

from gpulens.capture.analysis import AnalyzeOptions, analyze_manifest


def _ranks(run) -> dict:
    return {(r["rank"], r["target_id"]): r for r in run.summary["ranks"]}


def _status(run) -> dict:
    return {r["target_id"]: (r["status"], r["reason"]) for r in run.summary["ranks"]}


def test_tampered_checksum_excludes_that_rank_and_says_so(builder, trace_filter):
    capture = builder().add(0, trace_filter[0]).add(1, trace_filter[1]).write()
    path = capture.trace("rank-1")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, different bytes: only the digest can tell
    path.write_bytes(bytes(data))

    run = analyze_manifest(capture.manifest_uri)
    assert _status(run) == {"rank-0": ("analysed", None), "rank-1": ("excluded", "checksum_mismatch")}
    rank1 = next(r for r in run.summary["ranks"] if r["rank"] == 1)
    assert capture.manifest.artifacts[1].sha256 in rank1["detail"]
    assert hashlib.sha256(bytes(data)).hexdigest() in rank1["detail"]
    assert run.analysed and run.summary["counts"]["excluded"] == 1
    # the remaining rank is analysed on its own: per-rank numbers for rank 0 only, stragglers need two
    a = run.summary["analyses"]
    assert [r["rank"] for r in a["temporal_breakdown"]["result"]["per_rank"]] == [0]
    assert a["temporal_breakdown"]["result"]["per_rank"][0]["idle_pct"] == 53.56
    assert a["stragglers"]["status"] == "not_applicable" and "two or more" in a["stragglers"]["reason"]
    assert "checksum_mismatch" in (capture.dir / "analysis" / "report.html").read_text()


def test_unreferenced_files_next_to_the_traces_are_not_read(builder, trace_filter, tmp_path):
    capture = builder().add(0, trace_filter[0]).add(1, trace_filter[1]).write()
    # a decoy that would change rank 0's numbers if anything scanned the folder (HTA's trace_dir mode would)
    doc = json.loads(gzip.decompress(trace_filter[0].read_bytes()))
    for e in doc["traceEvents"]:
        if e.get("cat") == "kernel":
            e["dur"] = e["dur"] * 1000
    (capture.dir / "traces" / "rank-0-retry.json").write_text(json.dumps(doc))
    (capture.dir / "traces" / "zzz.json.gz").write_bytes(b"\x1f\x8bnot gzip at all")
    (capture.dir / "stray.json").write_text("{")

    run = analyze_manifest(capture.manifest_uri)
    assert sorted(_status(run)) == ["rank-0", "rank-1"]
    assert run.summary["counts"] == {"expected": 2, "archived": 2, "analysed": 2, "excluded": 0, "missing": 0}
    temporal = run.summary["analyses"]["temporal_breakdown"]["result"]["per_rank"]
    assert [r["kernel_us"] for r in temporal] == [600058.0, 600674.0]  # the decoy's kernels are 1000x longer


def test_uri_outside_the_capture_is_refused(builder, trace_filter, tmp_path):
    outside = tmp_path / "elsewhere" / "secret.json"
    outside.parent.mkdir()
    outside.write_bytes(trace_filter[1].read_bytes())
    capture = builder().add(0, trace_filter[0]).add(1, outside, uri=outside.as_uri()).write()
    run = analyze_manifest(capture.manifest_uri)
    status = _status(run)
    assert status["rank-1"] == ("excluded", "fetch_failed")
    assert "outside the archive prefix" in next(r for r in run.summary["ranks"] if r["rank"] == 1)["detail"]
    assert status["rank-0"] == ("analysed", None)


def test_a_file_that_contradicts_its_rank_is_excluded(builder, trace_filter):
    # the manifest binds the rank-0 file to rank 1 as well
    capture = builder().add(0, trace_filter[0]).add(1, trace_filter[0], target_id="rank-1").write()
    run = analyze_manifest(capture.manifest_uri)
    r1 = next(r for r in run.summary["ranks"] if r["rank"] == 1)
    assert (r1["status"], r1["reason"]) == ("excluded", "rank_mismatch")
    assert "distributedInfo.rank=0" in r1["detail"]


def test_serving_replicas_numbered_apart_are_checked_against_their_own_rank(builder, trace_filter):
    """Two replicas of two torch.distributed workers each: the capture numbers them 0..3, each
    worker's trace says its replica's own rank (0 or 1). The manifest's worker_rank is what the
    trace is checked against; without it replica B's files look like another rank's."""
    capture = (builder().add(0, trace_filter[0], pod="server-a").add(1, trace_filter[1], pod="server-a")
               .add(2, trace_filter[0], pod="server-b", worker_rank=0)
               .add(3, trace_filter[1], pod="server-b", worker_rank=1).write())
    run = analyze_manifest(capture.manifest_uri)
    assert {t: s for t, s in _status(run).items()} == {f"rank-{r}": ("analysed", None) for r in range(4)}
    # the check still bites inside a replica: a file of worker 0 bound to worker 1 of replica B
    swapped = (builder().add(0, trace_filter[0], pod="server-a").add(1, trace_filter[1], pod="server-a")
               .add(2, trace_filter[0], pod="server-b", worker_rank=0)
               .add(3, trace_filter[0], pod="server-b", worker_rank=1).write())
    run = analyze_manifest(swapped.manifest_uri)
    r3 = next(r for r in run.summary["ranks"] if r["rank"] == 3)
    assert (r3["status"], r3["reason"]) == ("excluded", "rank_mismatch")
    assert "rank 1 (capture rank 3)" in r3["detail"]


def test_duplicate_rank_keeps_the_first(builder, trace_filter):
    capture = builder().add(0, trace_filter[0]).add(0, trace_filter[0], target_id="rank-0-dup", expect=False).write()
    run = analyze_manifest(capture.manifest_uri)
    assert _status(run) == {"rank-0": ("analysed", None), "rank-0-dup": ("excluded", "duplicate_rank")}


def test_ranks_on_different_clocks_are_not_mixed(builder, cpu_only_assembled):
    """Real files from two different jobs: one base-relative, one epoch-µs. HTA would overflow on them."""
    capture = builder().add(0, cpu_only_assembled[0]).add(34, cpu_only_assembled[34]).write()
    run = analyze_manifest(capture.manifest_uri)
    assert _status(run) == {"rank-0": ("analysed", None), "rank-34": ("excluded", "clock_mismatch")}
    detail = next(r for r in run.summary["ranks"] if r["rank"] == 34)["detail"]
    assert "base:1719853884000000000" in detail and "epoch_us" in detail
    assert run.analysed and run.summary["trace_kind"] == "cpu_only"


def test_content_decides_compression_not_the_name(builder, torch_traces):
    plain = (torch_traces / "stepped-rank0.json").read_bytes()
    capture = (builder()
               .add(0, gzip.compress(plain), file_name="rank-0.json")        # gzip bytes, .json name
               .add(1, (torch_traces / "stepped-rank1.json").read_bytes(), file_name="rank-1.json.gz")  # plain, .gz
               .write())
    run = analyze_manifest(capture.manifest_uri)
    assert {r["rank"]: r["status"] for r in run.summary["ranks"]} == {0: "analysed", 1: "analysed"}
    assert [r["trace"]["compressed"] for r in run.summary["ranks"]] == [True, False]
    assert run.summary["analyses"]["iteration_times"]["status"] == "ok"


@pytest.mark.parametrize("payload,needle", [
    (b"this is not json", "not JSON"),
    (b'{"traceEvents": []}', "no complete events"),
    (b'[{"ph": "X"}]', "no top-level traceEvents"),
    (b'{"traceEvents": [{"ph": "M", "name": "process_name", "ts": 1, "pid": 1, "tid": 1}]}', "no complete events"),
    (gzip.compress(b"x", mtime=0)[:-6], "corrupt gzip"),   # mtime=0: the same test id in every lane
])
def test_unreadable_traces_are_excluded_not_fatal(builder, trace_filter, payload, needle):
    capture = builder().add(0, trace_filter[0]).add(1, payload).write()
    run = analyze_manifest(capture.manifest_uri)
    r1 = next(r for r in run.summary["ranks"] if r["rank"] == 1)
    assert (r1["status"], r1["reason"]) == ("excluded", "unreadable") and needle in r1["detail"]
    assert run.analysed


def test_decompression_is_bounded(builder, trace_filter):
    capture = builder().add(0, trace_filter[0]).add(1, trace_filter[1]).write()
    run = analyze_manifest(capture.manifest_uri, AnalyzeOptions(max_trace_bytes=1 << 20))  # traces are ~1.7 MB
    assert {r["reason"] for r in run.summary["ranks"]} == {"unreadable"}
    assert all("more than 1048576 bytes" in r["detail"] for r in run.summary["ranks"])
    assert not run.analysed and run.summary["status"] == "nothing_analysed"


def test_missing_ranks_carry_the_manifest_reason(builder, trace_filter):
    capture = (builder().add(0, trace_filter[0]).expect(1).expect(2)
               .fail(1, "process_gone", "worker exited before the window").write())
    run = analyze_manifest(capture.manifest_uri)
    assert _status(run) == {"rank-0": ("analysed", None), "rank-1": ("missing", "process_gone"),
                            "rank-2": ("missing", "not_archived")}
    assert run.summary["capture"]["fully_succeeded"] is False


def test_the_work_folder_is_removed(builder, trace_filter, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    capture = builder().add(0, trace_filter[0]).write()
    analyze_manifest(capture.manifest_uri, AnalyzeOptions(work_dir=work))
    assert list(work.iterdir()) == []


def test_out_dir_leaves_the_archive_alone(builder, trace_filter, tmp_path):
    capture = builder().add(0, trace_filter[0]).write()
    out = tmp_path / "local"
    run = analyze_manifest(capture.manifest_uri, AnalyzeOptions(out_dir=out))
    assert run.report_uri == (out / "report.html").resolve().as_uri()
    assert sorted(p.name for p in out.iterdir()) == ["ranks", "report.html", "summary.json"]
    assert [p.name for p in (out / "ranks").iterdir()] == ["rank-0-00000.analysis.json"]
    assert not (capture.dir / "analysis").exists()
    assert sorted(p.name for p in (capture.dir / "traces").iterdir()) == ["rank-0.json.gz"]  # nothing added
    assert json.loads((out / "summary.json").read_text())["outputs"]["report_uri"] == run.report_uri


def test_ranks_of_another_job_size_are_excluded(builder, trace_filter):
    """Same clock and window, but the file says it belongs to a 64-rank job, not the 128-rank one."""
    other = json.loads(gzip.decompress(trace_filter[1].read_bytes()))
    other["distributedInfo"]["world_size"] = 64
    capture = (builder().add(0, trace_filter[0]).add(1, gzip.compress(json.dumps(other).encode()),
                                                      file_name="rank-1.json.gz").write())
    run = analyze_manifest(capture.manifest_uri)
    assert _status(run) == {"rank-0": ("analysed", None), "rank-1": ("excluded", "world_size_mismatch")}
    assert "world_size=64" in next(r for r in run.summary["ranks"] if r["rank"] == 1)["detail"]


def test_same_clock_but_another_window_is_excluded(builder, trace_filter):
    """Both epoch-µs, but rank 1 was recorded a day later: not this capture's window."""
    later = json.loads(gzip.decompress(trace_filter[1].read_bytes()))
    for e in later["traceEvents"]:
        if "ts" in e:
            e["ts"] += 86_400 * 1_000_000
    capture = (builder().add(0, trace_filter[0]).add(1, gzip.compress(json.dumps(later).encode()),
                                                      file_name="rank-1.json.gz").write())
    run = analyze_manifest(capture.manifest_uri)
    assert _status(run) == {"rank-0": ("analysed", None), "rank-1": ("excluded", "clock_mismatch")}
    detail = next(r for r in run.summary["ranks"] if r["rank"] == 1)["detail"]
    assert "2023-04-29T" in detail and "2023-04-28T" in detail  # both start times, a day apart


@pytest.mark.parametrize("up", ["..", "%2e%2e", "%2E%2e", "%252e%252e", ".%2e"])
def test_an_encoded_escape_from_the_capture_is_never_read(builder, trace_filter, tmp_path, up):
    """A valid trace with the right sha256, outside the archive, named through an encoded `..`."""
    outside = tmp_path / "elsewhere" / "secret.json.gz"
    outside.parent.mkdir()
    outside.write_bytes(trace_filter[1].read_bytes())
    b = builder()
    uri = b.dir.as_uri() + "/" + "/".join([up] * 5) + "/elsewhere/secret.json.gz"
    capture = b.add(0, trace_filter[0]).add(1, outside, uri=uri).write()
    run = analyze_manifest(capture.manifest_uri)
    assert _status(run)["rank-1"] == ("excluded", "fetch_failed")
    assert "decodes to" in next(r for r in run.summary["ranks"] if r["rank"] == 1)["detail"]
    assert _status(run)["rank-0"] == ("analysed", None)


def test_a_trace_outside_the_capture_window_is_excluded_with_the_times(builder, trace_filter):
    """Same clock as rank 0 and close enough to group with it, but starting 200 s after the request:
    more than the documented start slack (WINDOW_START_SLACK_S), so not this capture's trace."""
    from gpulens.capture.analysis.rank_selection import WINDOW_START_SLACK_S
    late = json.loads(gzip.decompress(trace_filter[1].read_bytes()))
    for e in late["traceEvents"]:
        if "ts" in e:
            e["ts"] += 200 * 1_000_000
    assert 200 > WINDOW_START_SLACK_S
    capture = (builder().add(0, trace_filter[0]).add(1, gzip.compress(json.dumps(late).encode()),
                                                      file_name="rank-1.json.gz").write())
    run = analyze_manifest(capture.manifest_uri)
    assert _status(run) == {"rank-0": ("analysed", None), "rank-1": ("excluded", "outside_window")}
    detail = next(r for r in run.summary["ranks"] if r["rank"] == 1)["detail"]
    assert "the capture was requested at 2023-04-28T" in detail and "the trace spans 2023-04-28T" in detail


def test_agent_gzip_archives_and_old_raw_ones_analyse_together_and_the_report_shows_the_sizes(builder, trace_filter):
    """Issue 27: the agent archives `rank-N.json.gz` with the checksum of the gzip; a capture from
    before stores raw `.json`. Both analyse; the summary and the report carry the sizes and say
    which rank Kineto stopped early."""
    raw0 = gzip.decompress(trace_filter[0].read_bytes())
    stored0 = gzip.compress(raw0, compresslevel=1)
    sizes = {"budget": 4 << 20, "estimate": 3 << 20, "uncompressed": len(raw0), "stored": len(stored0),
             "encoding": "gzip", "gpu_buffer_mb": 4, "stopped_early": "2 of 5 iterations traced: Kineto stopped early"}
    capture = (builder()
               .add(0, stored0, file_name="rank-0.json.gz", sizes=sizes)
               .add(1, gzip.decompress(trace_filter[1].read_bytes()), file_name="rank-1.json")    # an old archive
               .write())
    run = analyze_manifest(capture.manifest_uri)
    assert _status(run) == {"rank-0": ("analysed", None), "rank-1": ("analysed", None)}
    ranks = {r["rank"]: r for r in run.summary["ranks"]}
    assert ranks[0]["sizes"] == sizes and ranks[0]["trace"]["compressed"] is True
    assert "sizes" not in ranks[1] and ranks[1]["trace"]["compressed"] is False
    html = (capture.dir / "analysis" / "report.html").read_text()
    assert f"largest rank 0: {len(raw0) / (1 << 20):.1f} MiB of trace JSON (budget 4.0 MiB per rank" in html
    assert "rank 0: 2 of 5 iterations traced: Kineto stopped early" in html
