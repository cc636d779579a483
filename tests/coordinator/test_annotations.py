"""Capture annotations: what Grafana receives (checked by the Grafana double against the API
contract), that an unreachable Grafana never blocks a capture and its retries are visible, and
the file sink of the embedded mode."""

from __future__ import annotations

import asyncio
import json

from gpulens.capture.annotations import Annotation, AnnotationSync, FileSink, GrafanaSink
from gpulens.capture.coordinator import Phase
from gpulens.capture.wire.auth import SecretFile
from gpulens.capture.models import CaptureReason, CaptureRequest
from tests.doubles.grafana_double import GrafanaDouble, RunningGrafana

from .agent_double import AgentDouble, RunningAgent
from .conftest import AGENT_TOKEN, make_coordinator, write_job

GRAFANA_TOKEN = "glsa_test"


def grafana_sink(http, url, tmp_path, timeout_s=2.0):
    tok = tmp_path / "grafana.token"
    tok.write_text(GRAFANA_TOKEN)
    return GrafanaSink(http, url, SecretFile(tok), timeout_s=timeout_s)


def alert_request(alertname="GpuHostSync", diagnosis="host_sync"):
    return CaptureRequest(job_id="train", duration_ms=200, requested_by="alertmanager",
                          reason=CaptureReason(kind="alert", alertname=alertname, diagnosis=diagnosis,
                                               fingerprint="abc", starts_at="2026-01-01T00:00:00Z"))


async def test_one_annotation_per_capture_tagged_and_closed_when_it_converges(tmp_path, http):
    write_job(tmp_path / "registry", pods={"train-0": ("node-a", 0)}, local_world_size=2)
    grafana = GrafanaDouble(GRAFANA_TOKEN)
    async with RunningAgent(AgentDouble("node-a", AGENT_TOKEN)) as a, RunningGrafana(grafana) as g:
        c = make_coordinator(tmp_path, http, {"node-a": a.url}, annotations=grafana_sink(http, g.url, tmp_path))
        rec, _ = c.start(alert_request())
        await c.wait(rec.capture_id)
        await c._syncs[rec.capture_id].wait_synced(10)
        await c.close()
    assert grafana.refused == []
    (ann,) = grafana.annotations.values()
    assert ann["tags"][:4] == ["gpulens", f"capture:{rec.capture_id}", "job:train", "namespace:ml"]
    assert "diagnosis:host_sync" in ann["tags"] and "alert:GpuHostSync" in ann["tags"]
    assert ann["time"] == int(round(rec.requested_at * 1000)) and ann["timeEnd"] == int(round(rec.converged_at * 1000))
    assert "all ranks archived" in ann["text"] and 'href="file://' in ann["text"]
    assert rec.annotation["state"] == "synced" and rec.annotation["id"] == ann["id"]
    methods = [m for m, _, _ in grafana.requests]
    assert methods.count("POST") == 1 and "PATCH" in methods


async def test_grafana_down_never_blocks_the_capture_and_the_retries_are_visible(tmp_path, http):
    write_job(tmp_path / "registry", pods={"train-0": ("node-a", 0)}, local_world_size=2)
    grafana = GrafanaDouble(GRAFANA_TOKEN, down=True)
    async with RunningAgent(AgentDouble("node-a", AGENT_TOKEN)) as a, RunningGrafana(grafana) as g:
        c = make_coordinator(tmp_path, http, {"node-a": a.url}, annotations=grafana_sink(http, g.url, tmp_path))
        rec, _ = c.start(alert_request())
        await c.wait(rec.capture_id)
        assert rec.phase == Phase.CONVERGED and rec.fully_succeeded
        assert rec.annotation["state"] == "retrying" and "503" in rec.annotation["error"]
        assert grafana.annotations == {}
        grafana.down = False
        assert await c._syncs[rec.capture_id].wait_synced(10)
        await c.close()
    (ann,) = grafana.annotations.values()
    assert ann["timeEnd"] > ann["time"] and rec.annotation["state"] == "synced"


async def test_a_create_that_timed_out_but_landed_is_found_not_duplicated(http, tmp_path):
    grafana = GrafanaDouble(GRAFANA_TOKEN)
    grafana.slow_next(1, 1.5)                      # Grafana stores it, the client gives up at 0.5 s
    async with RunningGrafana(grafana) as g:
        sync = AnnotationSync(grafana_sink(http, g.url, tmp_path, timeout_s=0.5), "capture:c-1",
                              backoff_initial_s=0.05, backoff_max_s=0.1)
        sync.set(Annotation(time_ms=1_700_000_000_000, text="x", tags=("gpulens", "capture:c-1")))
        await asyncio.sleep(0.1)
        sync.set(Annotation(time_ms=1_700_000_000_000, time_end_ms=1_700_000_005_000, text="done",
                            tags=("gpulens", "capture:c-1")))
        assert await sync.wait_synced(10)
        await sync.close()
    assert len(grafana.annotations) == 1
    (ann,) = grafana.annotations.values()
    assert ann["text"] == "done" and ann["timeEnd"] == 1_700_000_005_000


async def test_a_deleted_annotation_is_created_again(http, tmp_path):
    grafana = GrafanaDouble(GRAFANA_TOKEN)
    async with RunningGrafana(grafana) as g:
        sync = AnnotationSync(grafana_sink(http, g.url, tmp_path), "capture:c-2", backoff_initial_s=0.05)
        sync.set(Annotation(time_ms=1_700_000_000_000, text="a", tags=("gpulens",)))
        assert await sync.wait_synced(5)
        grafana.annotations.clear()                # someone deleted it in the UI
        sync.set(Annotation(time_ms=1_700_000_000_000, text="b", tags=("gpulens",)))
        assert await sync.wait_synced(5)
        await sync.close()
    assert [a["text"] for a in grafana.annotations.values()] == ["b"]


async def test_labels_are_escaped_in_the_html_text(tmp_path, http):
    write_job(tmp_path / "registry", pods={"train-0": ("node-a", 0)}, local_world_size=1)
    grafana = GrafanaDouble(GRAFANA_TOKEN)
    async with RunningAgent(AgentDouble("node-a", AGENT_TOKEN)) as a, RunningGrafana(grafana) as g:
        c = make_coordinator(tmp_path, http, {"node-a": a.url}, annotations=grafana_sink(http, g.url, tmp_path))
        rec, _ = c.start(alert_request(alertname="<script>alert(1)</script>", diagnosis='"><img src=x>'))
        await c.wait(rec.capture_id)
        assert await c._syncs[rec.capture_id].wait_synced(10)
        await c.close()
    assert grafana.refused == []
    (ann,) = grafana.annotations.values()
    assert "<script>" not in ann["text"] and "&lt;script&gt;" in ann["text"] and "<img" not in ann["text"]


async def test_a_wrong_grafana_token_is_a_visible_annotation_failure(tmp_path, http):
    write_job(tmp_path / "registry", pods={"train-0": ("node-a", 0)}, local_world_size=1)
    grafana = GrafanaDouble("another-token")
    async with RunningAgent(AgentDouble("node-a", AGENT_TOKEN)) as a, RunningGrafana(grafana) as g:
        c = make_coordinator(tmp_path, http, {"node-a": a.url}, annotations=grafana_sink(http, g.url, tmp_path))
        rec, _ = c.start(alert_request())
        await c.wait(rec.capture_id)
        await c.close()
    assert rec.fully_succeeded and rec.annotation["state"] == "retrying" and "401" in rec.annotation["error"]
    assert grafana.annotations == {}


async def test_a_grafana_token_missing_at_start_is_reported_then_used_once_it_appears(tmp_path, http):
    """The chart's tokens Secret may get its `grafana` key after coordinators exist: captures go on,
    the annotation waits visibly (401), and the token is used as soon as the file has it."""
    write_job(tmp_path / "registry", pods={"train-0": ("node-a", 0)}, local_world_size=1)
    tok, missing = tmp_path / "tokens" / "grafana", []
    token = SecretFile.optional(tok, missing.append)
    assert missing == [tok] and token.read() == ""
    grafana = GrafanaDouble(GRAFANA_TOKEN)
    async with RunningAgent(AgentDouble("node-a", AGENT_TOKEN)) as a, RunningGrafana(grafana) as g:
        sink = GrafanaSink(http, g.url, token, timeout_s=2.0)
        c = make_coordinator(tmp_path, http, {"node-a": a.url}, annotations=sink)
        rec, _ = c.start(alert_request())
        await c.wait(rec.capture_id)
        assert rec.fully_succeeded and rec.annotation["state"] == "retrying" and "401" in rec.annotation["error"]
        assert grafana.annotations == {}
        tok.parent.mkdir()
        tok.write_text(GRAFANA_TOKEN + "\n")
        assert await c._syncs[rec.capture_id].wait_synced(10)
        await c.close()
    (ann,) = grafana.annotations.values()
    assert rec.capture_id in " ".join(ann["tags"]) + ann["text"]


def test_a_present_grafana_token_is_not_reported_missing(tmp_path):
    tok, missing = tmp_path / "grafana", []
    tok.write_text("glsa_x")
    assert SecretFile.optional(tok, missing.append).read() == "glsa_x" and missing == []


async def test_file_sink_keeps_every_annotation_of_concurrent_coordinators(tmp_path):
    path = tmp_path / "state" / "annotations.json"
    sinks = [FileSink(path) for _ in range(4)]       # like four coordinators of `gpulens up`

    async def writer(i: int, sink: FileSink) -> list[int]:
        ids = []
        for j in range(10):
            ids.append(await sink.create(Annotation(1_700_000_000_000 + j, f"c{i}-{j} <b>x</b>", ("gpulens", f"c{i}"))))
        await sink.update(ids[0], Annotation(1_700_000_000_000, "updated", ("gpulens", f"c{i}"), 1_700_000_009_000))
        return ids
    all_ids = await asyncio.gather(*(writer(i, s) for i, s in enumerate(sinks)))
    doc = json.loads(path.read_text())
    assert len(doc["annotations"]) == 40 and len({a["id"] for a in doc["annotations"]}) == 40
    assert sorted(i for ids in all_ids for i in ids) == sorted(a["id"] for a in doc["annotations"])
    assert sum(a["text"] == "updated" for a in doc["annotations"]) == 4
    page = path.with_suffix(".html").read_text()
    assert page.count("<tr>") == 40 and "gpulens" in page
    assert await sinks[0].find("c3") is not None and await sinks[0].find("nope") is None


async def test_file_sink_refuses_to_overwrite_a_file_it_cannot_read(tmp_path):
    from gpulens.capture.annotations import AnnotationError
    path = tmp_path / "annotations.json"
    path.write_text("{half written")
    try:
        await FileSink(path).create(Annotation(1_700_000_000_000, "x", ("gpulens",)))
    except AnnotationError as exc:
        assert "not JSON" in str(exc)
    else:
        raise AssertionError("an unreadable annotations file was overwritten")
    assert path.read_text() == "{half written"


async def test_the_coordinator_writes_the_embedded_annotations_file(tmp_path, http):
    write_job(tmp_path / "registry", pods={"train-0": ("node-a", 0)}, local_world_size=1)
    path = tmp_path / "state" / "annotations.json"
    async with RunningAgent(AgentDouble("node-a", AGENT_TOKEN)) as a:
        c = make_coordinator(tmp_path, http, {"node-a": a.url}, annotations=FileSink(path))
        rec, _ = c.start(CaptureRequest(job_id="train", duration_ms=200, requested_by="alice"))
        await c.wait(rec.capture_id)
        assert await c._syncs[rec.capture_id].wait_synced(5)
        await c.close()
    (ann,) = json.loads(path.read_text())["annotations"]
    assert ann["tags"][0] == "gpulens" and "requested by alice" in ann["text"] and ann["timeEnd"] >= ann["time"]
