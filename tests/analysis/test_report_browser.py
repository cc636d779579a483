"""report.html renders in headless Chromium with no console errors, offline, with every rank visible.

The page is loaded from file:// with networking features off, and its Content-Security-Policy
forbids any fetch: a chart that needed the network would show up here as a logged error.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from gpulens.capture.analysis import analyze_manifest

from .browser import CHROMIUM, render
from tests.conftest import requires

pytestmark = requires(None if Path(CHROMIUM).exists() else "chromium is not installed")

HOSTILE = '<img src=x onerror="window.__pwned=1"></script><script>window.__pwned=2</script>'

PROBES = {
    "plots": "document.querySelectorAll('.js-plotly-plot .main-svg').length",
    "figures": "document.querySelectorAll('.js-plotly-plot').length",
    "pwned": "typeof window.__pwned",
    "missing_rows": "[...document.querySelectorAll('tr.missing')].map(r => r.innerText)",
    "excluded_rows": "[...document.querySelectorAll('tr.excluded')].map(r => r.innerText)",
    "badges": "[...document.querySelectorAll('section.analysis .badge')].map(b => b.innerText)",
    "axis_labels": "[...document.querySelectorAll('#fig-temporal_breakdown-0 .xtick text')].map(t => t.textContent)",
    "external": "performance.getEntriesByType('resource').map(e => e.name)",
}


@pytest.fixture
def profile(tmp_path):
    d = tmp_path / "chromium-profile"
    yield d
    shutil.rmtree(d, ignore_errors=True)


async def test_gpu_report_renders_cleanly(builder, trace_filter, tmp_path, profile):
    capture = (builder().add(0, trace_filter[0], pod=HOSTILE).add(1, trace_filter[1]).add(3, trace_filter[1])
               .expect(2).fail(2, "agent_unreachable", HOSTILE).write())
    run = analyze_manifest(capture.manifest_uri)
    ok = [n for n, a in run.summary["analyses"].items() if a["status"] == "ok"]
    assert len(ok) == 9

    page = await render(profile, run.report_uri, PROBES, ready=f"{PROBES['figures']} >= 10")
    shot = tmp_path / "report-gpu.png"
    shot.write_bytes(page.screenshot)
    assert page.errors == []
    assert page.screenshot[:8] == b"\x89PNG\r\n\x1a\n" and len(page.screenshot) > 50_000
    v = page.values
    assert v["pwned"] == "undefined"  # hostile manifest strings stayed text
    assert v["figures"] >= 10 and v["plots"] >= v["figures"]
    assert len(v["missing_rows"]) == 1 and "missing" in v["missing_rows"][0] and "agent_unreachable" in v["missing_rows"][0]
    assert "trainer-1" in v["missing_rows"][0]  # where the missing rank was expected to run
    assert len(v["excluded_rows"]) == 1 and "rank_mismatch" in v["excluded_rows"][0]  # rank 3 holds rank 1's file
    assert v["badges"] == ["ok"] * 9
    assert v["axis_labels"] == ["rank 0", "rank 1", "rank 2 (missing)", "rank 3 (excluded)"]
    assert v["external"] == []  # nothing fetched: plotly.js and data are inline


async def test_cpu_only_report_says_what_does_not_apply(builder, torch_traces, profile, tmp_path):
    capture = builder().add(0, torch_traces / "stepped-rank0.json").add(1, torch_traces / "stepped-rank1.json").write()
    run = analyze_manifest(capture.manifest_uri)
    page = await render(profile, run.report_uri, PROBES, ready=f"{PROBES['figures']} >= 3")
    (tmp_path / "report-cpu.png").write_bytes(page.screenshot)
    assert page.errors == []
    assert sorted(page.values["badges"]) == ["not applicable"] * 6 + ["ok"] * 3
    assert page.values["figures"] == 3


async def test_the_harness_sees_errors(tmp_path, profile):
    """The checks above can fail: a page with a script error, a console.error and a blocked fetch."""
    bad = tmp_path / "bad.html"
    bad.write_text("<!doctype html><meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; "
                   "script-src 'unsafe-inline'\"><img src=\"http://127.0.0.1:9/x.png\">"
                   "<script>console.error('boom'); undefinedFunction();</script><p>done</p>")
    page = await render(profile, bad.as_uri(), {}, ready="document.readyState === 'complete'")
    text = "\n".join(page.errors)
    assert "console.error: boom" in text
    assert "undefinedFunction" in text
    assert "Content Security Policy" in text or "x.png" in text
