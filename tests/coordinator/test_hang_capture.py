"""A hang capture end to end on a job nobody shaped for it (issue 45): a plain two-rank gloo job
(tests/analysis/hang_job.py: ten all_reduce calls, rank 1 never enters the sixth), one rank per
node, each node with a real `gpulens agent`; `gpulens capture start --hang --wait` through a real
coordinator. Each agent asks its rank's hook for the Flight Recorder dump and reads its stacks
with py-spy, archives the `hang_evidence` document and names it in the manifest; `gpulens
analyze` (the coordinator's runner) reads exactly what the manifest names and the verdict names
rank 1, its pod, its node, the collective and its sequence id, and where rank 1 is: in the
summary, the report, the capture's status and its Grafana annotation. Without the hook's dumps
the sequence ids are unknowable: every assertion on seq 6 fails. The hang capture is followed by
a short Kineto window of every rank (a trace capture of its own): each rank's trace is empty, is
archived as that rank's evidence (`traces/<target>.empty.json`), and the rank fails `trace_empty`,
saying so.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

from gpulens.capture import schemas
from gpulens.capture.annotations import capture_annotation
from gpulens.capture.coordinator import DeadlinePolicy, FanoutSettings, make_app
from gpulens.capture.coordinator.analysis_runner import AnalysisRunner
from gpulens.capture.models import Manifest
from gpulens.capture.wire.auth import Credentials, SecretFile
from tests.conftest import free_port

from .conftest import AGENT_TOKEN, make_coordinator
from .real_nodes import Node
from .servers import REPO, serving

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

HANG_JOB = str(REPO / "tests" / "analysis" / "hang_job.py")
TOKEN = "coordinator-token"
POLICY = DeadlinePolicy(dispatch_s=5.0, archive_s=10.0, report_s=5.0)


async def _cli(url: str, *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpulens.cli", "capture", *args, "--url", url, cwd=REPO,
        env={**os.environ, "GPULENS_TOKEN": TOKEN}, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 240)
    return proc.returncode, out.decode(), err.decode()


async def test_a_stalled_job_is_named_by_its_hang_capture(tmp_path, http):
    base = Path(tempfile.mkdtemp(prefix="gl-hang-", dir="/var/tmp"))
    archive, shared_reg, token = base / "archive", base / "registry", base / "agent.token"
    token.write_text(AGENT_TOKEN)
    nodes = [Node("node-a", base, archive), Node("node-b", base, archive)]
    port = free_port()
    try:
        for rank, node in enumerate(nodes):
            node.start_trainer(rank, 2, base / "stop", argv=[HANG_JOB, str(base), "skip"],
                               extra_env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        await asyncio.gather(*(n.start_agent(token) for n in nodes))
        end = time.time() + 180
        logs = [n.base / "trainer.log" for n in nodes]
        while not all(n.records() for n in nodes) or not all(" at 5" in p.read_text() for p in logs):
            assert time.time() < end, [p.read_text()[-2000:] for p in logs]
            for n in nodes:
                assert n.trainer.poll() is None, (n.base / "trainer.log").read_text()[-2000:]
            await asyncio.sleep(0.3)
        for n in nodes:
            (record,) = [json.loads(p.read_text()) for p in n.records()]
            assert record["flight_socket"], record     # the hook listens: registered with its process group
        shared_reg.mkdir()
        for n in nodes:
            for rec in n.records():
                (shared_reg / rec.name).symlink_to(rec)

        c = make_coordinator(tmp_path, http, {n.name: n.url for n in nodes}, registry=shared_reg, policy=POLICY,
                             fanout=FanoutSettings(poll_interval_s=0.5, max_poll_interval_s=1.0),
                             archive_root=f"file://{archive}", analysis=AnalysisRunner(timeout_s=180))
        (tmp_path / "c.token").write_text(TOKEN)
        async with serving(make_app(c, Credentials(tokens=(SecretFile(tmp_path / "c.token"),)))) as url:
            # rank 0 prints "at 5" just before it enters the sixth all_reduce: let it be in it
            await asyncio.sleep(1.0)
            code, out, err = await _cli(url, "start", "--job", "train", "--hang", "--wait")
            assert code == 0, (out, err, [(n.base / "agent.log").read_text()[-3000:] for n in nodes])
            cid, manifest_uri = out.split()
            await c.wait(cid)
            record = c.get(cid)
            assert record.analysis.get("state") == "done", record.analysis
            code, status_text, err = await _cli(url, "status", cid)
            assert code == 0, err
            # the hang capture is followed by a Kineto window of every rank, a trace capture of its
            # own: neither rank does any traced work in it (one waits in the collective, the other
            # never reaches it)
            follow = record.followed_by
            assert follow and f"window    {follow}" in status_text, (follow, status_text)
            await c.wait(follow)
            window = c.get(follow)

        m = Manifest.from_json(Path(manifest_uri.removeprefix("file://")).read_text())
        assert m.request["kind"] == "hang" and m.fully_succeeded and not m.failures
        assert {(a.rank, a.node, a.pod, a.kind) for a in m.artifacts} == {
            (0, "node-a", "train-0", "hang_evidence"), (1, "node-b", "train-1", "hang_evidence")}
        for a in m.artifacts:
            assert a.uri.endswith(f"/traces/rank-{a.rank}.hang.json"), a.uri
            data = Path(a.uri.removeprefix("file://")).read_bytes()
            assert hashlib.sha256(data).hexdigest() == a.sha256 and len(data) == a.size
            doc = schemas.validate("hang_evidence", json.loads(data))
            assert doc["flight_recorder"]["dump"] is not None, doc["flight_recorder"]   # the hook answered
            assert doc["stacks"]["doc"] is not None, doc["stacks"]                      # py-spy read it
        for n in nodes:      # the hook's dump file was folded into the document: nothing left beside traces
            assert not list((n.base / "traces").rglob("*flight*")), list((n.base / "traces").rglob("*"))
            assert not (n.base / "traces" / cid).exists(), list((n.base / "traces").rglob("*"))

        summary_path = Path(manifest_uri.removeprefix("file://")).parent / "analysis" / "summary.json"
        summary = schemas.validate("hang_summary", json.loads(summary_path.read_text()))
        v = summary["verdict"]
        print("[hang] verdict:", v["line"])
        assert v["kind"] == "never_entered" and v["seq"] == 6 and "all_reduce" in v["op"], v
        (suspect,) = v["suspects"]
        assert (suspect["rank"], suspect["pod"], suspect["node"]) == (1, "train-1", "node-b"), suspect
        assert "hang_job.py" in suspect["frame"] and "hang_job.py" in suspect["now_at"], suspect
        assert "sleep" in suspect["now_at"] or "main" in suspect["now_at"], suspect
        line = v["line"]
        for needle in ("rank 1", "train-1", "node-b", "collective_seq_id 6", "all_reduce"):
            assert needle in line, (needle, line)
        assert "rank 0 (" not in line.split(" never entered")[0], line     # the waiting rank is not the suspect
        report = (summary_path.parent / "report.html").read_text()
        assert re.search(r'class="verdict"><b>[^<]*rank 1[^<]*collective_seq_id 6', report), report[:2000]

        assert record.analysis["verdict"] == line                 # the status and annotation lead with it
        assert f"verdict   {line}" in status_text, status_text
        note = capture_annotation(record.to_status(full=False), archive_root=f"file://{archive}")
        assert "collective_seq_id 6" in note.text and "hang" in note.tags, note

        # the window: each rank's trace is empty, and that emptiness is kept as its evidence
        assert window.request.kind == "trace" and window.request.duration_ms == 1000, window.request
        assert cid in (window.request.reason.text or ""), window.request.reason
        trace_manifest = Manifest.from_json(Path(window.manifest_uri.removeprefix("file://")).read_text())
        assert not trace_manifest.artifacts
        assert {(f.rank, f.reason) for f in trace_manifest.failures} == {(0, "trace_empty"), (1, "trace_empty")}, \
            trace_manifest.failures
        for f in trace_manifest.failures:
            assert "did no traced work for the whole window" in f.detail and "--hang" in f.detail, f.detail
            kept = Path(trace_manifest.archive_prefix.removeprefix("file://")) / "traces" / f"{f.target_id}.empty.json"
            assert f"{kept.as_uri()}" in f.detail, (kept, f.detail)
            trace = json.loads(kept.read_text())        # Kineto's own file, whole: the header, no activity
            assert trace["traceName"] and not [e for e in trace["traceEvents"] if e.get("cat") == "cpu_op"]
    finally:
        (base / "stop").touch()
        for n in nodes:
            if n.trainer and n.trainer.poll() is None:
                n.trainer.kill()
        await asyncio.gather(*(n.stop() for n in nodes))
        shutil.rmtree(base, ignore_errors=True)
