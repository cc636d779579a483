"""After a coordinator restart, the captures it finished are still listed and readable (from the
archive's manifest, marked `from_archive`), instead of `unknown`; the CLI shows them as such."""

from __future__ import annotations

import json

import aiohttp
import pytest

from gpulens.capture.coordinator import make_app
from gpulens.capture.models import CaptureRequest
from gpulens.capture.wire.auth import Credentials, SecretFile
from tests.coordinator.agent_double import AgentDouble, RunningAgent
from tests.coordinator.conftest import AGENT_TOKEN, make_coordinator, write_job
from tests.coordinator.servers import serving

TOKEN = "coordinator-token"
H = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as s:
        yield s


async def _finished_then_restarted(tmp_path, http, agent_url: str):
    first = make_coordinator(tmp_path, http, {"node-a": agent_url}, state_dir=tmp_path / "state")
    record, _ = first.start(CaptureRequest(job_id="train", duration_ms=200, requested_by="ada"))
    await first.wait(record.capture_id)
    assert record.phase == "converged"
    await first.close()
    return record, make_coordinator(tmp_path, http, {"node-a": agent_url}, state_dir=tmp_path / "state")


async def test_a_restarted_coordinator_answers_finished_captures_from_the_archive(tmp_path, http):
    write_job(tmp_path / "registry", pods={"train-0": ("node-a", 0)}, local_world_size=2)
    double = AgentDouble("node-a", AGENT_TOKEN)
    double.outcome = lambda d, t: ("fail", "process_gone", "the worker exited") if t == "rank-1" else None
    (tmp_path / "c.token").write_text(TOKEN)
    async with RunningAgent(double) as agent:
        record, second = await _finished_then_restarted(tmp_path, http, agent.url)
        cid = record.capture_id
        assert second.get(cid) is None                                   # a fresh process: nothing in memory
        async with serving(make_app(second, Credentials(tokens=(SecretFile(tmp_path / "c.token"),)))) as url:
            async with http.get(f"{url}/v1/captures/{cid}", headers=H) as r:
                assert r.status == 200
                status = await r.json()
            assert status["from_archive"] is True and "restarted" in status["note"]
            assert status["phase"] == "converged" and status["manifest_uri"] == record.manifest_uri
            assert status["counts"] == {"archived": 1, "failed": 1} and status["missing_ranks"] == [1]
            assert status["fully_succeeded"] is False and status["requested_by"] == "ada"
            failed = [t for t in status["targets"] if t["state"] == "failed"]
            assert [(t["target_id"], t["reason"]) for t in failed] == [("rank-1", "process_gone")]

            async with http.get(f"{url}/v1/captures", headers=H) as r:
                listed = (await r.json())["captures"]
            assert [(c["capture_id"], c["from_archive"]) for c in listed] == [(cid, True)]

            async with http.get(f"{url}/v1/captures/{cid}/events", headers=H) as r:
                events = [json.loads(line) for line in (await r.text()).splitlines()]
            assert [e["event"] for e in events] == ["snapshot", "end"]

            # ids that are not a capture of this job attempt stay unknown, including path tricks
            for bad in ("c-20260101t000000-deadbeef", "..%2F..%2Fetc", "C-UPPER-00000000"):
                async with http.get(f"{url}/v1/captures/{bad}", headers=H) as r:
                    assert r.status == 404 and (await r.json())["phase"] == "unknown", bad

            # without its manifest the archive cannot vouch for it: unknown again
            (tmp_path / "archive" / "ml" / "train" / "0" / cid / "manifest.json").unlink()
            async with http.get(f"{url}/v1/captures/{cid}", headers=H) as r:
                assert r.status == 404
        await second.close()


async def test_the_next_attempts_coordinator_answers_a_capture_its_predecessor_finished(tmp_path, http):
    """A node lost mid-capture: the job's next attempt got a coordinator (and the job's Service)
    while the old one drained its capture and went. Asked through the Service, the new one reads
    the capture from the old attempt's folder of the archive; another job's stays unknown."""
    write_job(tmp_path / "registry", pods={"train-0": ("node-a", 0)}, local_world_size=2)
    double = AgentDouble("node-a", AGENT_TOKEN)
    (tmp_path / "c.token").write_text(TOKEN)
    async with RunningAgent(double) as agent:
        first = make_coordinator(tmp_path, http, {"node-a": agent.url})
        record, _ = first.start(CaptureRequest(job_id="train", duration_ms=200, requested_by="ada"))
        await first.wait(record.capture_id)
        await first.close()
        assert record.phase == "converged" and "/train/0/" in record.manifest_uri
        later = make_coordinator(tmp_path, http, {"node-a": agent.url}, attempt=3)
        other = make_coordinator(tmp_path, http, {"node-a": agent.url}, attempt=3, job="other")
        async with serving(make_app(later, Credentials(tokens=(SecretFile(tmp_path / "c.token"),)))) as url:
            async with http.get(f"{url}/v1/captures/{record.capture_id}", headers=H) as r:
                assert r.status == 200
                status = await r.json()
        assert status["from_archive"] is True and status["attempt"] == 0 and status["phase"] == "converged"
        assert "attempt 0's coordinator ran it" in status["note"] and "restarted" not in status["note"]
        assert status["manifest_uri"] == record.manifest_uri and status["counts"] == {"archived": 2, "failed": 0}
        assert await other.archived(record.capture_id) is None        # another job's folder is never read
        await later.close()
        await other.close()
