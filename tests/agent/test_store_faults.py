"""The agent's target facts under faults: a state dir that is full (a real, tiny tmpfs) never
shows a status that is not on disk, the final status lands once space is back and is the same
after a restart; a second, different final status is refused; files of the wrong shape are
moved aside at start-up and the rest load."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from gpulens.capture.agent.pipeline import Pipeline, PipelineSettings
from gpulens.capture.agent.registry import WorkerRegistry
from gpulens.capture.agent.store import FinalStatusConflict, StatusStore, StoreWriteFailed, TargetRecord
from gpulens.capture.models import FailureReason, TargetState, TargetStatus
from tests.tinyfs import tiny_fs

CAP = "cap-00000001"


def dispatch(**kw) -> dict:
    d = {"job_id": "train", "attempt": 0, "rank": 0, "duration_ms": 500,
         "activities": ["cpu_op"], "deadline": time.time() + 60, "archive_prefix": "file:///tmp/archive/x"}
    d.update(kw)
    return d


def record(target: str = "rank-0") -> TargetRecord:
    return TargetRecord(CAP, target, dispatch(), TargetStatus(target))


def on_disk(root: Path, target: str = "rank-0") -> dict:
    return json.loads((root / "captures" / CAP / f"{target}.json").read_text())["status"]


@pytest.fixture
def fs(tmp_path):
    fs = tiny_fs(tmp_path / "state")
    yield fs
    fs.close()


@pytest.mark.root
def test_a_failed_write_publishes_nothing_and_leaves_no_temp_file(fs):
    store = StatusStore(fs.path)
    rec = record()
    store.put(rec)
    fs.fill()
    rec.fail(FailureReason.NOT_REGISTERED, "x")
    with pytest.raises(StoreWriteFailed, match="No space left on device"):
        store.put(rec)
    assert store.status(CAP, "rank-0").state is TargetState.PENDING  # what the disk says
    assert on_disk(fs.path)["state"] == "pending"
    assert [f for f in fs.files() if f.endswith(".tmp")] == []


@pytest.mark.root
async def test_a_full_state_dir_delays_the_final_status_until_it_is_on_disk(fs, tmp_path):
    store = StatusStore(fs.path)
    rec = record()
    store.put(rec)
    (tmp_path / "reg").mkdir()
    settings = PipelineSettings(node="n1", trace_dir=tmp_path, archive_root="file:///tmp/archive",
                                registration_grace_s=0.0, retry_interval_s=0.05, persist_retry_s=(0.02, 0.05))
    pipeline = Pipeline(settings, registry=WorkerRegistry(tmp_path / "reg"), trigger=None, store=store,  # type: ignore[arg-type]
                        observer=None, verify_pool=None, archive=None)  # type: ignore[arg-type]
    fs.fill()
    task = asyncio.create_task(pipeline.run(rec))
    shown: list[str] = []
    deadline = time.time() + 10
    while rec.status.state is not TargetState.FAILED:  # the pipeline has decided (in memory)
        assert time.time() < deadline
        await asyncio.sleep(0.01)
    for _ in range(20):  # the disk is still full: what is shown is what is on disk
        shown.append(store.status(CAP, "rank-0").state.value)
        assert on_disk(fs.path)["state"] == "pending"
        await asyncio.sleep(0.02)
    assert set(shown) == {"pending"} and not task.done()  # retrying, not dead with an unretrieved error
    fs.free()
    await asyncio.wait_for(task, 10)
    final = store.status(CAP, "rank-0")
    assert (final.state, final.reason) == (TargetState.FAILED, FailureReason.NOT_REGISTERED)
    assert on_disk(fs.path)["reason"] == "not_registered"
    again = StatusStore(fs.path).load()  # a restarted agent reports the same final status
    assert [(r.status.state, r.status.reason) for r in again] == [(TargetState.FAILED, FailureReason.NOT_REGISTERED)]


def test_a_second_different_final_status_is_refused(tmp_path):
    store = StatusStore(tmp_path)
    rec = record()
    rec.fail(FailureReason.PROCESS_GONE, "gone")
    store.put(rec)
    rec.set_state(TargetState.ARCHIVED, "late")
    with pytest.raises(FinalStatusConflict):
        store.put(rec)
    assert on_disk(tmp_path)["state"] == "failed" and store.status(CAP, "rank-0").reason is FailureReason.PROCESS_GONE
    rec.fail(FailureReason.PROCESS_GONE, "gone, said again")  # the same final status may be written again
    store.put(rec)


@pytest.mark.parametrize("content", [
    "null", "[]", '"text"', "{}", '{"status": []}', '{"status": {}, "dispatch": {}}', '{"capture_id": "cap-0000',
    "WRONG_TARGET", "BAD_DISPATCH",
])
def test_wrong_shape_target_files_are_moved_aside_and_the_rest_load(tmp_path, content):
    good = StatusStore(tmp_path)
    good.put(record("rank-0"))
    folder = tmp_path / "captures" / CAP
    if content == "WRONG_TARGET":  # valid, but another target's fact under this name
        content = (folder / "rank-0.json").read_text()
    elif content == "BAD_DISPATCH":
        doc = json.loads((folder / "rank-0.json").read_text())
        doc.update(target_id="rank-1", dispatch={"rank": "zero"})
        doc["status"]["target_id"] = "rank-1"
        content = json.dumps(doc)
    (folder / "rank-1.json").write_text(content)
    loaded = StatusStore(tmp_path).load()
    assert [r.target_id for r in loaded] == ["rank-0"]
    names = sorted(p.name for p in folder.iterdir())
    assert "rank-1.json" not in names and any(n.startswith("rank-1.bad-") for n in names), names
