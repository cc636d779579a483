"""`gpulens analyze` on a hang capture's manifest (issue 45): each rank's document is read only as
the manifest names it and only when it is what the manifest says. The documents are real: taken by
the agent's own collector from live Python processes (stacks read by py-spy; no process group, so
no dump, and the report says so rather than guess). Each bad input excludes its rank with its
reason; nothing is read twice, nothing outside the capture's folder is read, and a capture whose
every rank is excluded exits 3 with the report still written."""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpulens.capture import schemas
from gpulens.capture.agent.hang_capture import evidence_bytes
from gpulens.capture.agent.hang_evidence import HangTarget, collect_hang_evidence
from gpulens.capture.analysis import AnalyzeOptions, analyze_manifest
from gpulens.capture.models import Artifact, ExpectedTarget, Manifest

pytestmark = [pytest.mark.root]

CAPTURE = "c-20261207t180000-0badc0de"


@pytest.fixture(scope="module")
def documents(tmp_path_factory) -> list[dict]:
    """Two ranks' real hang_evidence documents, as the agent takes them."""
    code = "import sys, time\ndef waiting():\n    print('up', flush=True)\n    time.sleep(120)\nwaiting()"
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        assert [p.stdout.readline().strip() for p in procs] == ["up", "up"]   # in `waiting`: a frame to read
        docs = []
        for rank, p in enumerate(procs):
            t = HangTarget(CAPTURE, f"rank-{rank}", rank, p.pid, p.pid, None, str(tmp_path_factory.mktemp("t")))
            docs.append(asyncio.run(collect_hang_evidence(t)))
        assert all(d["stacks"]["doc"] for d in docs), docs
        return docs
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _capture(tmp_path: Path, documents: list[dict], *, tamper=None) -> str:
    """The capture's folder in a file archive: each document archived, a manifest naming them."""
    prefix = tmp_path / "archive" / "ml" / "train" / "0" / CAPTURE
    (prefix / "traces").mkdir(parents=True)
    artifacts = []
    for doc in documents:
        data, sha = evidence_bytes(doc)
        path = prefix / "traces" / f"{doc['target_id']}.hang.json"
        path.write_bytes(data)
        artifacts.append(dict(target_id=doc["target_id"], rank=doc["rank"], local_rank=0, node=f"node-{doc['rank']}",
                              pod=f"train-{doc['rank']}", pid=doc["pid"], attempt=0, uri=path.as_uri(), size=len(data),
                              sha256=sha, trace_id=None, kind="hang_evidence"))
    if tamper:
        tamper(prefix, artifacts)
    m = Manifest(capture_id=CAPTURE, job_id="train", attempt=0, requested_at=time.time(), duration_ms=2000,
                 expected_targets=[ExpectedTarget(f"rank-{r}", r, 0, f"train-{r}", f"node-{r}") for r in range(2)],
                 artifacts=[Artifact(**a) for a in artifacts], request={"job_id": "train", "kind": "hang"},
                 converged_at=time.time())
    (prefix / "manifest.json").write_text(m.to_json())
    return (prefix / "manifest.json").as_uri()


def _ranks(run) -> dict[int, dict]:
    return {r["rank"]: r for r in run.summary["ranks"]}


def test_both_ranks_read_and_the_report_says_it_has_no_dump_to_judge(tmp_path, documents):
    run = analyze_manifest(_capture(tmp_path, documents))
    schemas.validate("hang_summary", run.summary)
    assert run.analysed and run.summary["counts"] == {"expected": 2, "archived": 2, "analysed": 2, "excluded": 0,
                                                      "missing": 0}
    v = run.summary["verdict"]
    assert v["kind"] == "no_dump" and v["seq"] is None, v          # no process group: no sequence id to name
    assert [s["rank"] for s in v["suspects"]] == [0, 1]
    assert all("waiting" in s["now_at"] and "sleep" not in (s["frame"] or "") for s in v["suspects"]), v["suspects"]
    assert all(r["dump"].startswith("no_socket") and r["stacks"] is None for r in run.summary["ranks"])
    report = Path(run.report_uri.removeprefix("file://")).read_text()
    assert "no Flight Recorder dump from ranks [0, 1]" in report and "<script" not in report


def test_a_changed_document_is_excluded_as_checksum_mismatch(tmp_path, documents):
    def tamper(prefix, artifacts):
        path = prefix / "traces" / "rank-1.hang.json"
        doc = json.loads(path.read_text())
        doc["stacks"]["doc"]["threads"][0]["frames"][0]["name"] = "somewhere_else"
        path.write_text(json.dumps(doc))
    run = analyze_manifest(_capture(tmp_path, documents, tamper=tamper))
    ranks = _ranks(run)
    assert ranks[0]["status"] == "analysed"
    assert (ranks[1]["status"], ranks[1]["reason"]) == ("excluded", "checksum_mismatch"), ranks[1]
    assert "somewhere_else" not in json.dumps(run.summary)


def test_a_document_of_another_rank_is_excluded_not_read_as_this_one(tmp_path, documents):
    def tamper(prefix, artifacts):          # rank 1's slot names rank 0's (valid, checksummed) document
        artifacts[1].update(uri=artifacts[0]["uri"], size=artifacts[0]["size"], sha256=artifacts[0]["sha256"])
    run = analyze_manifest(_capture(tmp_path, documents, tamper=tamper))
    assert (_ranks(run)[1]["status"], _ranks(run)[1]["reason"]) == ("excluded", "not_this_rank"), _ranks(run)[1]


def test_a_uri_outside_the_capture_and_a_trace_artifact_are_not_read(tmp_path, documents):
    outside = tmp_path / "elsewhere.json"
    def tamper(prefix, artifacts):
        data = (prefix / "traces" / "rank-0.hang.json").read_bytes()
        outside.write_bytes(data)
        artifacts[0]["uri"] = outside.as_uri()
        artifacts[1]["kind"] = None       # a trace where a hang document belongs
    uri = _capture(tmp_path, documents, tamper=tamper)
    proc = subprocess.run([sys.executable, "-m", "gpulens.cli", "analyze", uri], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 3, proc.stderr[-2000:]       # nothing analysed; the report still written
    summary = json.loads((Path(uri.removeprefix("file://")).parent / "analysis" / "summary.json").read_text())
    ranks = {r["rank"]: r for r in summary["ranks"]}
    assert (ranks[0]["reason"], ranks[1]["reason"]) == ("fetch_failed", "not_hang_evidence"), ranks
    assert summary["status"] == "nothing_analysed" and summary["verdict"]["kind"] == "no_evidence"
    assert proc.stdout.strip().endswith("/analysis/report.html")
    assert hashlib.sha256(outside.read_bytes()).hexdigest() not in json.dumps(summary)
