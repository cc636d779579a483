"""`gpulens analyze` as the coordinator runs it: exit codes, stdout = the report URI only, progress on stderr."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpulens.capture.analysis import ManifestRefused, analyze_manifest

LOGFMT = re.compile(r"^ts=\S+ level=(debug|info|warning|error) component=analysis event=[a-z_.]+( |$)")


def gpulens(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpulens.cli", "analyze", *args], capture_output=True, text=True,
                          timeout=300)


def _write(path: Path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path.as_uri()


def test_happy_path_prints_only_the_report_uri(builder, trace_filter):
    capture = builder().add(0, trace_filter[0]).add(1, trace_filter[1]).write()
    out = gpulens(capture.manifest_uri)
    assert out.returncode == 0, out.stderr
    assert out.stdout == (capture.dir / "analysis" / "report.html").as_uri() + "\n"
    lines = out.stderr.strip().splitlines()
    assert lines and all(LOGFMT.match(line) for line in lines), [l for l in lines if not LOGFMT.match(l)][:3]
    events = [re.search(r"event=(\S+)", l).group(1) for l in lines]
    for step in ("manifest.read", "dask.started", "artifact.fetched", "artifact.verified", "trace.loaded",
                 "analysis.started", "analysis.finished", "rank_summary.written", "rank.mapped", "analysis.written"):
        assert step in events, step
    assert "progress=2/2" in out.stderr and "capture_id=c-test" in out.stderr
    assert json.loads((capture.dir / "analysis" / "summary.json").read_text())["status"] == "analysed"


def test_nothing_analysed_is_exit_3_with_a_report(builder, trace_filter):
    capture = builder().add(0, trace_filter[0]).write()
    capture.trace("rank-0").write_bytes(b"tampered")
    out = gpulens(capture.manifest_uri)
    assert out.returncode == 3
    assert out.stdout.strip() == (capture.dir / "analysis" / "report.html").as_uri()
    assert "nothing was analysed" in out.stderr and "reason=checksum_mismatch" in out.stderr
    assert capture.summary()["status"] == "nothing_analysed"


@pytest.mark.parametrize("text,needle", [
    ("{}", "is empty"),
    ("not json", "is not JSON"),
])
def test_unusable_manifests_exit_2_and_write_nothing(tmp_path, text, needle):
    uri = _write(tmp_path / "c-1" / "manifest.json", text)
    out = gpulens(uri)
    assert out.returncode == 2 and needle in out.stderr and out.stdout == ""
    assert not (tmp_path / "c-1" / "analysis").exists()


def test_manifest_without_artifacts_exits_2(builder):
    capture = builder().expect(0).expect(1).fail(0, "not_registered", "no record").write()
    out = gpulens(capture.manifest_uri)
    assert out.returncode == 2 and out.stdout == ""
    assert "has no archived artifact" in out.stderr and "rank-0=not_registered" in out.stderr
    assert not (capture.dir / "analysis").exists()


@pytest.mark.parametrize("args,needle", [
    (["http://example.invalid/manifest.json"], "must be file:///"),
    (["--jobs", "0", "file:///nonexistent/manifest.json"], "--jobs must be between 1 and 64"),
    ([], "required"),
])
def test_bad_arguments_exit_2(args, needle):
    out = gpulens(*args)
    assert out.returncode == 2 and needle in out.stderr and out.stdout == ""


def test_refusal_codes(builder, tmp_path):
    def refused(text: str) -> str:
        with pytest.raises(ManifestRefused) as exc:
            analyze_manifest(_write(tmp_path / "c" / "manifest.json", text))
        return exc.value.code

    empty = builder().write()  # schema-valid, nothing expected, nothing archived
    with pytest.raises(ManifestRefused) as exc:
        analyze_manifest(empty.manifest_uri)
    assert exc.value.code == "empty"
    assert refused("{}") == "empty"
    assert refused("[1, 2]") == "invalid"
    assert refused("\xff\xfe") == "not_json"
    valid = json.loads((empty.dir / "manifest.json").read_text())
    valid["artifacts"] = [{"target_id": "rank-0", "rank": 0, "local_rank": 0, "node": "n", "pod": "p", "pid": 1,
                           "attempt": 0, "uri": "file:///x", "size": 1, "sha256": "ABC", "trace_id": None}]
    with pytest.raises(ManifestRefused, match=r"artifacts\[0\]\.sha256"):
        analyze_manifest(_write(tmp_path / "d" / "manifest.json", json.dumps(valid)))
    with pytest.raises(ManifestRefused, match="cannot read manifest") as exc:
        analyze_manifest((tmp_path / "nowhere" / "manifest.json").as_uri())
    assert exc.value.code == "unreadable"


def test_unwritable_output_is_exit_1_with_the_reason(builder, trace_filter, tmp_path):
    capture = builder().add(0, trace_filter[0]).write()
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where --out wants a folder")
    out = gpulens(capture.manifest_uri, "--out", str(blocker / "sub"))
    assert out.returncode == 1 and out.stdout == ""
    assert "event=analysis.write_failed" in out.stderr and "not-a-dir" in out.stderr
