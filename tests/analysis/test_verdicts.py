"""The verdict section answers the alert from the trace: real torch traces of the demo trainer's own
step loop (healthy, host_sync, input_starvation) go through `analyze_manifest`, and the verdict must
follow the evidence, including the controls (host_sync evidence on a healthy or an input-starved
capture is not supported)."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from gpulens.capture import schemas
from gpulens.capture.analysis import analyze_manifest

from .browser import CHROMIUM, render
from .conftest import HERE, raw_events

INCIDENTS = ("none", "host_sync", "input_starvation")


@pytest.fixture(scope="module")
def incident_traces(tmp_path_factory) -> dict[str, Path]:
    """One real trace per incident (incident_traces.py), made in parallel once per module."""
    out = tmp_path_factory.mktemp("incident-traces")
    procs = {m: subprocess.Popen([sys.executable, str(HERE / "incident_traces.py"), str(out / f"{m}.json"), m],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for m in INCIDENTS}
    try:
        for m, p in procs.items():
            _, err = p.communicate(timeout=300)
            assert p.returncode == 0, err.decode()[-2000:]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return {m: out / f"{m}.json" for m in INCIDENTS}


def alert(diagnosis: str) -> dict:
    return {"reason": {"kind": "alert", "alertname": "GPUWorkloadX", "diagnosis": diagnosis,
                       "workload": "demo/demo-trainer-0", "starts_at": "2026-12-01T10:00:00Z",
                       "fingerprint": "abc"}}


def analysed(builder, trace: Path, diagnosis: str | None, capture_id: str = "c-test") -> dict:
    b = builder(capture_id=capture_id)
    if diagnosis:
        b.request = alert(diagnosis)
    run = analyze_manifest(b.add(0, trace).write().manifest_uri)
    schemas.validate("summary", run.summary)
    return run.summary


def test_induced_host_sync_is_supported_with_numbers_and_call_sites(builder, incident_traces):
    s = analysed(builder, incident_traces["host_sync"], "host_sync")
    v = s["verdict"]
    assert v["alert"]["alertname"] == "GPUWorkloadX" and v["alert"]["workload"] == "demo/demo-trainer-0"
    assert v["diagnosis"] == "host_sync" and v["verdict"] == "supported", v["why"]
    n = v["checks"]["host_sync"]["numbers"]
    assert n["share_pct"] >= 5 and n["steps"] == 7 and n["per_step_us"] > 0
    names = {x["name"] for x in n["by_name"]}
    assert {"aten::copy_", "aten::item"} <= names
    # the copy, then its callers: the demo loop has no annotation or Python frame around it to name
    assert n["call_sites"][0]["site"] == "aten::copy_", n["call_sites"]
    # a CPU-only trace says which evidence cannot exist instead of counting it as zero
    assert any("cudaStreamSynchronize" in c for c in v["checks"]["host_sync"]["cannot_see"])
    assert v["checks"]["noisy_neighbor"]["verdict"] == "inconclusive"
    assert "cannot exist" in v["checks"]["noisy_neighbor"]["why"]
    assert s["evidence"]["per_rank"][0]["kernel_us"] is None  # not 0


def test_host_sync_evidence_is_not_supported_on_healthy_and_input_starved_captures(builder, incident_traces):
    healthy = analysed(builder, incident_traces["none"], "host_sync", "c-healthy")
    assert healthy["verdict"]["verdict"] == "not_supported", healthy["verdict"]["why"]
    starved = analysed(builder, incident_traces["input_starvation"], "input_starvation", "c-starved")
    checks = starved["verdict"]["checks"]
    assert checks["host_sync"]["verdict"] == "not_supported", checks["host_sync"]["why"]
    assert checks["host_sync"]["numbers"]["share_pct"] < 1
    assert starved["verdict"]["verdict"] == "supported", starved["verdict"]["why"]
    assert checks["input_starvation"]["numbers"]["share_pct"] >= 50


def test_only_copies_the_program_makes_count_as_host_blocking_on_cpu_traces():
    """An operator's internal copy (addmm's copy_, a dtype promotion's aten::to inside div_) is not
    a transfer: counting it made healthy CPU-only steps look 1-5 % host-blocked on a loaded machine."""
    import pandas as pd

    from gpulens.capture.analysis.evidence import _program_copies

    ids = {n: i for i, n in enumerate(["aten::addmm", "aten::copy_", "aten::to", "aten::_to_copy", "aten::div_"])}
    rows = [  # (tid, ts, end, name): addmm > copy_ | to > _to_copy > copy_ | div_ > to > _to_copy | copy_
        (1, 0, 10, "aten::addmm"), (1, 2, 3, "aten::copy_"),
        (1, 20, 30, "aten::to"), (1, 21, 29, "aten::_to_copy"), (1, 22, 28, "aten::copy_"),
        (1, 40, 50, "aten::div_"), (1, 41, 45, "aten::to"), (1, 42, 44, "aten::_to_copy"),
        (2, 5, 9, "aten::copy_")]
    ops = pd.DataFrame([{"tid": t, "ts": a, "end": b, "dur": b - a, "name": ids[n]} for t, a, b, n in rows])
    kept = _program_copies(ops, ids)
    assert sorted(zip(kept["tid"], kept["ts"])) == [(1, 21), (1, 22), (2, 5)]


def test_loader_wait_is_measured_from_dataloader_spans(builder, incident_traces):
    """The measured wait is the DataLoader __next__ spans of the raw trace, not a guess."""
    s = analysed(builder, incident_traces["input_starvation"], None)
    assert s["verdict"]["verdict"] is None and s["verdict"]["alert"] is None  # manual: nothing to judge
    spans = [e for e in raw_events(incident_traces["input_starvation"])
             if e.get("ph") == "X" and str(e.get("name", "")).startswith("enumerate(DataLoader)#")]
    # no ProfilerStep#N in the demo's loop: a step runs from one optimizer step's end to the next's
    ends = sorted(e["ts"] + e["dur"] for e in raw_events(incident_traces["input_starvation"])
                  if e.get("ph") == "X" and str(e.get("name", "")).startswith("Optimizer.step#"))
    assert not any(str(e.get("name", "")).startswith("ProfilerStep#") for e in raw_events(incident_traces["input_starvation"]))
    in_steps = [e for e in spans if any(a <= e["ts"] < b for a, b in zip(ends, ends[1:]))]
    w = s["evidence"]["per_rank"][0]["input_wait"]
    assert w["events"] == len(in_steps) == 7
    assert w["total_us"] == pytest.approx(sum(e["dur"] for e in in_steps), rel=1e-3)


def test_report_opens_with_the_verdict_and_escapes_alert_text(builder, incident_traces):
    b = builder()
    b.request = alert("host_sync")
    b.request["reason"]["text"] = "<script>window.__pwned=1</script>"
    run = analyze_manifest(b.add(0, incident_traces["host_sync"]).write().manifest_uri)
    html = Path(run.report_uri.removeprefix("file://")).read_text()
    main = html.split("<main>", 1)[1]
    assert main.startswith('<section class="verdict supported" id="verdict">')
    assert "<script>window.__pwned" not in html and "&lt;script&gt;window.__pwned" in html
    assert "No baseline capture of this job" in main
    assert " 0 %" not in main.split("</section>", 1)[0]


def test_unknown_diagnosis_is_inconclusive_and_schema_rejects_bad_verdicts(builder, incident_traces):
    s = analysed(builder, incident_traces["none"], "exporter_degraded")
    assert s["verdict"]["verdict"] == "inconclusive" and "exporter_degraded" in s["verdict"]["why"]
    bad = json.loads(json.dumps(s))
    bad["verdict"]["verdict"] = "probably"
    assert schemas.errors("summary", bad)
    bad = json.loads(json.dumps(s))
    bad["verdict"]["checks"]["host_sync"]["why"] = ""
    assert schemas.errors("summary", bad)


VERDICT_PROBES = {
    "heading": "document.querySelector('#verdict h2').innerText",
    "border": "getComputedStyle(document.querySelector('#verdict')).borderTopColor",
    "checks": "[...document.querySelectorAll('#verdict table.checks tbody tr')].map(r => r.innerText)",
    "first_section": "document.querySelector('main').firstElementChild.id",
    "alert": "document.querySelector('#verdict dl').innerText",
}


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="chromium is not installed")
async def test_verdict_section_screenshot_in_headless_chromium(builder, incident_traces, tmp_path):
    b = builder()
    b.request = alert("host_sync")
    run = analyze_manifest(b.add(0, incident_traces["host_sync"]).write().manifest_uri)
    page = await render(tmp_path / "chromium-profile", run.report_uri, VERDICT_PROBES,
                        ready="document.querySelector('#verdict') !== null", clip_selector="#verdict")
    (tmp_path / "verdict.png").write_bytes(page.screenshot)
    assert page.errors == []
    assert page.screenshot[:8] == b"\x89PNG\r\n\x1a\n"
    v = page.values
    width, height = struct.unpack(">II", page.screenshot[16:24])   # PNG IHDR: the clipped section's size
    assert (width, height) == (round(v["clip"]["width"]), round(v["clip"]["height"])) and height > 150
    assert v["first_section"] == "verdict"
    assert v["heading"].startswith("Verdict on diagnosis host_sync") and v["heading"].endswith("supported")
    assert v["border"] == "rgb(26, 127, 55)"                      # the supported colour, not the neutral one
    assert "GPUWorkloadX" in v["alert"] and "demo/demo-trainer-0" in v["alert"]
    assert len(v["checks"]) == 5 and v["checks"][0].startswith("host_sync\tsupported")
    assert any(r.startswith("noisy_neighbor\tinconclusive") and "cannot exist" in r for r in v["checks"])


def test_gpu_traces_count_device_to_host_copies_and_kernel_time(builder, trace_filter):
    """Genuine GPU traces: device-to-host cudaMemcpyAsync calls count as host-blocking (host-to-device
    ones do not), kernel time exists, and nothing is listed as invisible."""
    b = builder()
    b.request = alert("noisy_neighbor")
    run = analyze_manifest(b.add(0, trace_filter[0]).add(1, trace_filter[1]).write().manifest_uri)
    v = run.summary["verdict"]
    assert v["trace_kind"] == "gpu"
    rank0 = next(r for r in run.summary["evidence"]["per_rank"] if r["rank"] == 0)
    assert rank0["kernel_us"] > 0 and rank0["gpu_idle_in_steps_pct"] is not None
    by_name = {x["name"]: x["count"] for x in rank0["host_blocking"]["by_name"]}
    raw = raw_events(trace_filter[0])
    dtoh = {e["args"]["correlation"] for e in raw if e.get("cat") == "gpu_memcpy" and "DtoH" in e["name"]}
    calls = [e for e in raw if e.get("cat") == "cuda_runtime" and e["name"] == "cudaMemcpyAsync"]
    assert 0 < by_name["cudaMemcpyAsync"] <= len([e for e in calls if e["args"]["correlation"] in dtoh]) < len(calls)
    assert all(c["cannot_see"] == [] for c in v["checks"].values())
    assert v["verdict"] == "inconclusive" and "no baseline" in v["why"]


def _iteration_capture(builder, trace: Path, capture_id: str, rank1: dict) -> dict:
    from dataclasses import replace
    b = builder(capture_id=capture_id)
    b.request = {"iterations": 5, "reason": {"kind": "manual"}}
    b.add(0, trace).add(1, trace)
    good = {"requested": 5, "roundup": 100, "first": 1100, "last": 1104, "optimizer_steps": 5, "stepped": True}
    b.artifacts = [replace(b.artifacts[0], iterations=good), replace(b.artifacts[1], iterations={**good, **rank1})]
    run = analyze_manifest(b.write().manifest_uri)
    schemas.validate("summary", run.summary)
    return run.summary


def test_analysis_flags_ranks_whose_iterations_differ(builder, incident_traces):
    trace = incident_traces["none"]
    same = _iteration_capture(builder, trace, "c-it-same", {})["iterations"]
    assert same["aligned"] and (same["first"], same["last"], same["roundup"]) == (1100, 1104, 100)
    assert same["misaligned_ranks"] == [] and "every archived rank traced iterations 1100..1104" == same["why"]
    shifted = _iteration_capture(builder, trace, "c-it-shift", {"first": 1200, "last": 1204})
    it = shifted["iterations"]
    assert not it["aligned"] and it["misaligned_ranks"] in ([0], [1]) and "other iterations" in it["why"]
    html = Path(shifted["outputs"]["report_uri"].removeprefix("file://")).read_text()
    assert "NOT aligned" in html
    idle = _iteration_capture(builder, trace, "c-it-nostep", {"stepped": False, "optimizer_steps": 0})["iterations"]
    assert not idle["aligned"] and idle["not_stepping_ranks"] == [1] and "never stepped" in idle["why"]
    late = _iteration_capture(builder, trace, "c-it-late", {"optimizer_steps": 17})["iterations"]  # time fallback
    assert not late["aligned"] and late["not_stepping_ranks"] == [1]
    plain = analysed(builder, trace, None, "c-it-plain")
    assert plain["iterations"] is None                         # a wall-clock capture has nothing to align


def test_incident_reports_compare_with_the_jobs_latest_baseline(builder, incident_traces, tmp_path):
    base_b = builder(capture_id="c-base")
    base_b.request = {"baseline": True, "reason": {"kind": "manual"}}
    base = analyze_manifest(base_b.add(0, incident_traces["none"]).write().manifest_uri).summary
    assert base["capture"]["baseline"] is True and base["verdict"]["baseline"] is None
    pointer = tmp_path / "archive" / "ns" / "train" / "baseline.json"
    assert json.loads(pointer.read_text())["capture_id"] == "c-base"

    sync = analysed(builder, incident_traces["host_sync"], "host_sync", "c-sync")
    v = sync["verdict"]
    assert v["baseline"]["capture_id"] == "c-base" and v["verdict"] == "supported"
    assert v["checks"]["host_sync"]["numbers"]["baseline_per_step_us"] < v["checks"]["host_sync"]["numbers"]["per_step_us"]
    top = v["regressions"][0]
    assert (top["kind"], top["name"]) in {("cpu_op", "aten::to"), ("cpu_op", "aten::_to_copy"), ("cpu_op", "aten::copy_")}
    assert top["delta_us"] > 1000 and top["unit"] == "step"
    html = Path(sync["outputs"]["report_uri"].removeprefix("file://")).read_text()
    assert "Compared with baseline capture <b>c-base</b>" in html and "<b>c-sync</b>" in html

    starved = analysed(builder, incident_traces["input_starvation"], "input_starvation", "c-starved2")
    c = starved["verdict"]["checks"]
    assert c["input_starvation"]["verdict"] == "supported" and c["input_starvation"]["numbers"]["growth"] >= 1.5
    assert c["host_sync"]["verdict"] == "not_supported"
    assert any(r["name"].startswith("enumerate(DataLoader)#") for r in starved["verdict"]["regressions"][:3])

    # an older baseline never replaces a newer one; an unreadable pointer only means "no baseline"
    old = builder(capture_id="c-old")
    old.request = {"baseline": True}
    cap = old.add(0, incident_traces["none"]).write()
    doc = json.loads(Path(cap.manifest_uri.removeprefix("file://")).read_text())
    doc["window"]["requested_at"] = 1.0
    Path(cap.manifest_uri.removeprefix("file://")).write_text(json.dumps(doc))
    analyze_manifest(cap.manifest_uri)
    assert json.loads(pointer.read_text())["capture_id"] == "c-base"
    pointer.write_text("{not json")
    lone = analysed(builder, incident_traces["host_sync"], "host_sync", "c-lone")
    assert lone["verdict"]["baseline"] is None and lone["verdict"]["verdict"] == "supported"


def test_a_loop_without_torch_profiler_is_aligned_by_the_hooks_step_numbers(builder, incident_traces):
    """Issue 31 (item 6) and 34: a plain loop has no ProfilerStep#N; the agent numbers the traced
    optimizer steps from the hook's counter, one start for every rank. Equal numbers are aligned,
    also when Kineto collected a step past the window on one rank (`collected_last`)."""
    counted = {"requested": 5, "roundup": 1, "start": 579, "numbering": "optimizer_step", "first": 581, "last": 585,
               "collected_last": 585, "optimizer_steps": 5, "stepped": True}
    same = _iteration_capture(builder, incident_traces["none"], "c-it-counted", {})  # markers: the old numbering
    assert same["iterations"]["aligned"]
    from dataclasses import replace
    b = builder(capture_id="c-it-plain-loop")
    b.request = {"iterations": 5, "reason": {"kind": "manual"}}
    b.add(0, incident_traces["none"]).add(1, incident_traces["none"])
    b.artifacts = [replace(b.artifacts[0], iterations=counted),
                   replace(b.artifacts[1], iterations={**counted, "collected_last": 587})]
    summary = analyze_manifest(b.write().manifest_uri).summary
    schemas.validate("summary", summary)
    it = summary["iterations"]
    assert it["aligned"] and (it["first"], it["last"], it["roundup"]) == (581, 585, 1), it
    assert it["why"] == "every archived rank traced iterations 581..585"


def test_alignment_with_a_rank_missing_says_every_archived_rank_and_names_the_missing(builder, incident_traces):
    """Issue 43: two archived ranks agree, the third was never archived. The summary must not say
    "every rank": it speaks for the archived ranks and names the one it could not compare."""
    from dataclasses import replace
    b = builder(capture_id="c-it-missing")
    b.request = {"iterations": 5, "reason": {"kind": "manual"}}
    trace = incident_traces["none"]
    b.add(0, trace).add(1, trace).expect(2).fail(2, "trace_timeout", "no file by the deadline")
    good = {"requested": 5, "roundup": 100, "first": 1100, "last": 1104, "optimizer_steps": 5, "stepped": True}
    b.artifacts = [replace(a, iterations=good) for a in b.artifacts]
    run = analyze_manifest(b.write().manifest_uri)
    schemas.validate("summary", run.summary)
    it = run.summary["iterations"]
    assert it["missing_ranks"] == [2] and it["misaligned_ranks"] == []
    assert it["why"].startswith("every archived rank traced iterations 1100..1104") and "rank(s) 2 not" in it["why"]
    assert "every rank traced" not in it["why"]
