"""The embedded operator and page: jobs from registration records, routes to the newest attempt,
captures listed from the archive, hostile strings kept as text."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from aiohttp.test_utils import TestClient, TestServer

from gpulens.up.layout import Layout
from gpulens.up.local_operator import LocalOperator, read_jobs
from gpulens.up.page import Page, list_captures
from gpulens.up.supervisor import ChildSpec


def record(reg: Path, name: str, **fields) -> None:
    base = {"namespace": "ns", "job_id": "train", "attempt": 0, "pod": "p0"}
    (reg / name).write_text(json.dumps({**base, **fields}))


def test_read_jobs_groups_pods_and_skips_broken_files(tmp_path):
    record(tmp_path, "a.json")
    record(tmp_path, "b.json", pod="p1")
    record(tmp_path, "c.json", attempt=1)
    (tmp_path / "half.json").write_text('{"namespace": "ns", "job_')
    (tmp_path / "foreign.json").write_text('{"hello": 1}')
    assert read_jobs(tmp_path) == {("ns", "train", 0): {"p0", "p1"}, ("ns", "train", 1): {"p0"}}


class FakeSupervisor:
    def __init__(self):
        self.started: list[str] = []

    async def start(self, spec: ChildSpec):
        self.started.append(spec.name)
        # the fields of the Child that Supervisor.start returns which the operator reads
        return SimpleNamespace(pid=4242, log_path=Path("/logs") / f"{spec.name}.log", final=False)


def fake_runner(tmp_path: Path):
    layout = Layout.create(tmp_path / "w")
    runner = SimpleNamespace(layout=layout, sup=FakeSupervisor(), said=[])
    runner.say = runner.said.append
    runner.coordinator_spec = lambda ns, job, attempt, index, serving=False: ChildSpec(
        f"coordinator-{ns}-{job}-a{attempt}", ["true"], url=f"http://127.0.0.1:{9470 + index}")
    return runner


async def test_one_coordinator_per_attempt_and_routes_to_the_newest(tmp_path):
    runner = fake_runner(tmp_path)
    op = LocalOperator(runner)
    record(runner.layout.registry, "a.json")
    await op.reconcile()
    await op.reconcile()  # nothing new: no second coordinator
    assert runner.sup.started == ["coordinator-ns-train-a0"]
    record(runner.layout.registry, "b.json", attempt=1, pod="p9")
    await op.reconcile()
    assert runner.sup.started == ["coordinator-ns-train-a0", "coordinator-ns-train-a1"]
    routes = json.loads(runner.layout.routes_file.read_text())
    assert routes["routes"] == {"ns/train": "http://127.0.0.1:9471"}  # the newest attempt
    assert routes["pods"] == {"ns/p0": "ns/train", "ns/p9": "ns/train"}
    assert not list(runner.layout.state.glob("*.tmp"))  # written atomically


def write_manifest(folder: Path, capture_id: str, *, report: bool, job="train", failures=()):
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text(json.dumps({
        "capture_id": capture_id, "job_id": job, "attempt": 0, "created_at": 5.0, "fully_succeeded": not failures,
        "artifacts": [{}], "expected_targets": [{}, {}] if failures else [{}],
        "failures": [{"target_id": "rank-1", "reason": r} for r in failures]}))
    if report:
        (folder / "analysis").mkdir()
        (folder / "analysis" / "report.html").write_text("<html></html>")


def test_list_captures_reads_manifests_and_reports(tmp_path):
    write_manifest(tmp_path / "ns/train/0/c-1", "c-1", report=True)
    write_manifest(tmp_path / "ns/train/0/c-2", "c-2", report=False, failures=["agent_unreachable"])
    (tmp_path / "ns/train/0/c-3").mkdir(parents=True)
    (tmp_path / "ns/train/0/c-3/manifest.json").write_text("not json")
    caps = {c["capture_id"]: c for c in list_captures(tmp_path)}
    assert set(caps) == {"c-1", "c-2"}
    assert caps["c-1"]["report"] == "ns/train/0/c-1/analysis/report.html"
    assert caps["c-2"]["report"] is None and caps["c-2"]["failures"] == ["rank-1: agent_unreachable"]


async def test_page_escapes_job_ids_and_serves_the_archive_read_only(tmp_path):
    runner = fake_runner(tmp_path)
    runner.urls = {}
    write_manifest(runner.layout.archive_dir / "ns/x/0/c-1", "c-1", report=True, job="<script>alert(1)</script>")
    page = Page(runner, port=0)
    async with TestClient(TestServer(page.app())) as client:
        html = await (await client.get("/")).text()
        assert "<script>alert(1)</script>" not in html and "&lt;script&gt;" in html
        r = await client.get("/archive/ns/x/0/c-1/analysis/report.html")
        assert r.status == 200
        from yarl import URL
        for path in ("/archive/%2e%2e/secrets/agent.token", "/archive/..%2fsecrets/agent.token"):
            r = await client.get(URL(path, encoded=True))
            assert r.status in (403, 404) and "token" not in (await r.text())
        assert (await client.post("/archive/ns/x/0/c-1/manifest.json", data=b"x")).status == 405
