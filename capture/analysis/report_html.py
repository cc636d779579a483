"""report.html: one self-contained page (plotly.js inlined, no network) rendered from summary.json.

Everything from a trace or a manifest (kernel names, pod names, error text) is HTML-escaped here;
figure data goes through plotly's JSON encoder, which escapes `<` and `/`. A Content-Security-Policy
forbids any network fetch, so the page renders the same offline, in a Grafana link or an archive.
"""

from __future__ import annotations

import datetime as dt
from html import escape
from typing import Any

import plotly.io as pio
import plotly.offline

from .report_figures import figures_for

__all__ = ["render_report"]

_CSP = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
        "img-src data: blob:; font-src data:")

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#222;background:#fafafa}
header,main,footer{max-width:1200px;margin:0 auto;padding:12px 24px}
header{border-bottom:1px solid #ddd;background:#fff;max-width:none}
h1{font-size:22px;margin:8px 0}h2{font-size:18px;margin:24px 0 8px}
dl{display:grid;grid-template-columns:max-content 1fr;gap:2px 16px;margin:8px 0}dt{color:#666}dd{margin:0;word-break:break-all}
table{border-collapse:collapse;background:#fff;margin:8px 0;font-size:13px}
th,td{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}th{background:#f0f0f0}
td.num{text-align:right;font-variant-numeric:tabular-nums}
tr.analysed td.status{color:#1a7f37}tr.excluded td.status{color:#b35900;font-weight:600}
tr.missing td.status{color:#c62828;font-weight:600}tr.missing,tr.excluded{background:#fff6f0}
.badge{font-size:12px;padding:1px 8px;border-radius:10px;margin-left:8px;vertical-align:middle}
.ok{background:#dff3e4;color:#1a7f37}.not_applicable{background:#eee;color:#555}.failed{background:#fde2e1;color:#c62828}
.analysed{background:#dff3e4;color:#1a7f37}.nothing_analysed{background:#fde2e1;color:#c62828}
section.analysis,section.cross-rank{background:#fff;border:1px solid #e3e3e3;border-radius:6px;padding:4px 16px 12px;margin:16px 0}
p.reason{color:#555}.detail{color:#666;font-size:12px;max-width:480px}
section.verdict{background:#fff;color:#222;border:2px solid #bbb;border-radius:6px;padding:4px 16px 12px;margin:16px 0}
section.verdict.supported{border-color:#1a7f37}section.verdict.not_supported{border-color:#b35900}
.supported{background:#dff3e4;color:#1a7f37}.not_supported{background:#fff0e0;color:#b35900}
.inconclusive{background:#eee;color:#555}p.why{font-size:15px}td.cannot{color:#b35900;font-size:12px}
"""

# analysis name -> (list key in result, [(column title, dotted key)])
_TABLES: dict[str, tuple[str, list[tuple[str, str]]]] = {
    "temporal_breakdown": ("per_rank", [("rank", "rank"), ("idle %", "idle_pct"), ("compute %", "compute_pct"),
                                        ("non-compute %", "non_compute_pct"), ("kernel span µs", "kernel_us")]),
    "kernel_breakdown": ("by_type", [("kernel type", "kernel_type"), ("total µs", "total_us"), ("%", "pct")]),
    "comm_comp_overlap": ("per_rank", [("rank", "rank"), ("overlap %", "overlap_pct")]),
    "idle_time": ("per_stream", [("rank", "rank"), ("stream", "stream"), ("host wait µs", "host_wait_us"),
                                 ("kernel wait µs", "kernel_wait_us"), ("other µs", "other_us"), ("idle µs", "idle_us")]),
    "kernel_launch_stats": ("per_rank", [("rank", "rank"), ("launches", "launches"),
                                         ("launch call median µs", "cpu_duration_us.median"),
                                         ("launch delay median µs", "launch_delay_us.median"),
                                         ("launch delay p95 µs", "launch_delay_us.p95"),
                                         ("calls > cutoff", "long_runtime_calls"),
                                         ("delays > cutoff", "long_launch_delays")]),
    "stragglers": ("late_start_counts", [("rank", "rank"), ("late-start iterations", "count")]),
    "iteration_times": ("per_rank", [("rank", "rank"), ("steps", "steps"), ("mean µs", "mean_us"),
                                     ("median µs", "median_us"), ("min µs", "min_us"), ("max µs", "max_us")]),
    "cpu_op_breakdown": ("top_ops", [("rank", "rank"), ("op", "name"), ("count", "count"),
                                     ("total µs", "total_us"), ("mean µs", "mean_us")]),
    "user_annotation_breakdown": ("top", [("rank", "rank"), ("annotation", "name"), ("total µs", "total_us"),
                                          ("mean µs", "mean_us"), ("max µs", "max_us")]),
}
_MAX_TABLE_ROWS = 60


def _when(epoch: float | None) -> str:
    if epoch is None:
        return "—"
    return dt.datetime.fromtimestamp(epoch, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _cell(value: Any) -> str:
    if value is None:
        return '<td class="num">—</td>'
    if isinstance(value, bool):
        return f"<td>{'yes' if value else 'no'}</td>"
    if isinstance(value, int):
        return f'<td class="num">{value:,}</td>'
    if isinstance(value, float):
        return f'<td class="num">{value:,.2f}</td>'
    return f"<td>{escape(str(value))}</td>"


def _get(row: dict, dotted: str) -> Any:
    for part in dotted.split("."):
        row = row.get(part) if isinstance(row, dict) else None
    return row


def _table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    head = "".join(f"<th>{escape(t)}</th>" for t, _ in columns)
    body = "".join("<tr>" + "".join(_cell(_get(r, k)) for _, k in columns) + "</tr>" for r in rows[:_MAX_TABLE_ROWS])
    more = f"<p class=\"reason\">{len(rows) - _MAX_TABLE_ROWS} more rows in summary.json</p>" if len(rows) > _MAX_TABLE_ROWS else ""
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{more}"


def _identity(summary: dict) -> str:
    c, n = summary["capture"], summary["counts"]
    reason = c.get("reason") or {}
    items = [("capture", c["capture_id"]), ("job", f"{c['job_id']} (attempt {c['attempt']})"),
             ("requested", f"{_when(c['requested_at'])}, window {c['duration_ms']} ms"),
             ("manifest", c["manifest_uri"]),
             ("ranks", f"{n['analysed']} analysed, {n['excluded']} excluded, {n['missing']} missing "
                       f"of {n['expected']} expected ({n['archived']} archived)"),
             ("traces", {"gpu": "GPU activity", "cpu_only": "CPU only (no GPU activity)"}.get(summary["trace_kind"], "—"))]
    if reason:
        items.append(("reason", ", ".join(f"{k}={v}" for k, v in reason.items())))
    if c.get("baseline"):
        items.append(("baseline", "this capture is the job's healthy baseline: later captures are compared with it"))
    items += _sizes(summary["ranks"])
    it = summary.get("iterations")
    if it:
        items.append(("iterations", f"{it['requested']} requested (round-up {it['roundup'] or '—'}): "
                                    f"{'aligned' if it['aligned'] else 'NOT aligned'}: {it['why']}"))
    return "<dl>" + "".join(f"<dt>{escape(k)}</dt><dd>{escape(str(v))}</dd>" for k, v in items) + "</dl>"


def _sizes(ranks: list[dict]) -> list[tuple[str, str]]:
    """Issue 27: how big the traces were against their budget, and which Kineto stopped early."""
    sized = [r for r in ranks if r.get("sizes")]
    if not sized:
        return []
    mib = lambda n: f"{n / (1 << 20):.1f} MiB"  # noqa: E731
    big = max(sized, key=lambda r: r["sizes"]["uncompressed"])
    s = big["sizes"]
    text = (f"largest rank {big['rank']}: {mib(s['uncompressed'])} of trace JSON"
            + (f" (budget {mib(s['budget'])} per rank, estimated {mib(s['estimate'] or 0)})" if s.get("budget") else "")
            + f", {mib(s['stored'])} stored ({s['encoding']}); all ranks {mib(sum(r['sizes']['stored'] for r in sized))} stored")
    out = [("trace size", text)]
    early = [f"rank {r['rank']}: {r['sizes']['stopped_early']}" for r in sized if r["sizes"].get("stopped_early")]
    if early:
        out.append(("stopped early", "; ".join(early)))
    return out


def _ranks(summary: dict) -> str:
    rows = []
    for r in summary["ranks"]:
        t = r.get("trace") or {}
        rank = "—" if r["rank"] is None else str(r["rank"])
        why = f"{r['reason']}: {r['detail']}" if r["reason"] else ""
        rows.append(
            f'<tr class="{escape(r["status"])}"><td class="num">{escape(rank)}</td><td>{escape(r["target_id"])}</td>'
            f'<td class="status">{escape(r["status"])}</td><td>{escape(r.get("node", "—"))}</td>'
            f'<td>{escape(r.get("pod", "—"))}</td>{_cell(r.get("pid"))}{_cell(r.get("size"))}'
            f'{_cell(t.get("complete_events"))}{_cell(t.get("kernels"))}{_cell(t.get("profiler_steps"))}'
            f'<td class="detail">{escape(why)}</td></tr>')
    head = "".join(f"<th>{h}</th>" for h in ("rank", "target", "status", "node", "pod", "pid", "bytes", "events",
                                             "GPU kernels", "steps", "reason"))
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _analysis(name: str, a: dict, summary: dict) -> str:
    status = a["status"]
    parts = [f'<section class="analysis" id="analysis-{escape(name)}"><h2>{escape(a["title"])}'
             f'<span class="badge {escape(status)}">{escape(status.replace("_", " "))}</span></h2>']
    if status != "ok":
        parts.append(f'<p class="reason">{escape(a["reason"] or "")}</p>')
    else:
        try:
            figures = figures_for(name, a["result"], summary)
        except Exception as exc:  # noqa: BLE001 - a chart bug must not cost the report its tables
            figures = []
            parts.append(f'<p class="reason">chart unavailable: {escape(type(exc).__name__)}: {escape(str(exc))}</p>')
        for i, fig in enumerate(figures):
            parts.append(pio.to_html(fig, full_html=False, include_plotlyjs=False, div_id=f"fig-{name}-{i}",
                                     config={"displaylogo": False, "responsive": True}))
        if name in _TABLES:
            key, columns = _TABLES[name]
            parts.append(_table(a["result"].get(key, []), columns))
        if name == "stragglers":
            parts.append(f'<p>Candidates: <b>{escape(", ".join(map(str, a["result"]["candidates"])) or "none")}</b> '
                         f'(HTA reports its top {a["result"]["num_candidates"]}; compare the counts).</p>')
    parts.append("</section>")
    return "".join(parts)


_VERDICT_WORDS = {"supported": "supported", "not_supported": "not supported", "inconclusive": "inconclusive"}


def _badge(verdict: str | None) -> str:
    if verdict is None:
        return ""
    return f'<span class="badge {escape(verdict)}">{escape(_VERDICT_WORDS.get(verdict, verdict))}</span>'


def _verdict(summary: dict) -> str:
    """The section the report opens with: the alert's question, the trace's answer, the numbers."""
    v = summary.get("verdict")
    if not v:
        return ""
    a = v.get("alert")
    head = (f"Verdict on diagnosis {escape(v['diagnosis'])}{_badge(v['verdict'])}" if v["diagnosis"]
            else "Evidence by diagnosis (manual capture)")
    parts = [f'<section class="verdict {escape(v["verdict"] or "none")}" id="verdict"><h2>{head}</h2>']
    if a:
        items = [("alert", a.get("alertname")), ("diagnosis", a.get("diagnosis")), ("workload", a.get("workload")),
                 ("alert started", a.get("starts_at")), ("summary", a.get("text"))]
        parts.append("<dl>" + "".join(f"<dt>{escape(k)}</dt><dd>{escape(str(x))}</dd>" for k, x in items if x) + "</dl>")
    parts.append(f'<p class="why">{escape(v["why"])}</p>')
    if v["trace_kind"] == "cpu_only":
        parts.append('<p class="reason">CPU-only trace: no GPU events were recorded, so GPU-side evidence is listed '
                     'as not visible, not as zero.</p>')
    rows = []
    for name, c in v["checks"].items():
        cannot = "; ".join(c["cannot_see"])
        rows.append(f'<tr class="check-{escape(name)}"><td>{escape(name)}</td><td>{_badge(c["verdict"])}</td>'
                    f'<td>{escape(c["why"])}</td><td class="cannot">{escape(cannot) or "—"}</td></tr>')
    if rows:
        parts.append('<table class="checks"><thead><tr><th>diagnosis</th><th>verdict</th><th>evidence</th>'
                     f'<th>not visible in this trace</th></tr></thead><tbody>{"".join(rows)}</tbody></table>')
    sites = (v["checks"].get("host_sync") or {}).get("numbers", {}).get("call_sites") or []
    if sites:
        parts.append("<h3>Host-blocking call sites</h3>" + _table(sites, [("call site (innermost first)", "site"),
                                                                          ("calls", "count"), ("total µs", "total_us")]))
    b = v.get("baseline")
    if b:
        parts.append(f'<p>Compared with baseline capture <b>{escape(b["capture_id"])}</b> (this capture: '
                     f'<b>{escape(summary["capture"]["capture_id"])}</b>).</p>')
        if v["regressions"]:
            parts.append("<h3>Top regressions against the baseline</h3>" + _table(v["regressions"], [
                ("rank", "rank"), ("kind", "kind"), ("name", "name"), ("per", "unit"), ("µs now", "us"),
                ("µs baseline", "baseline_us"), ("+µs", "delta_us"), ("ratio", "ratio")]))
        else:
            parts.append('<p class="reason">Nothing takes longer than in the baseline.</p>')
    else:
        parts.append('<p class="reason">No baseline capture of this job to compare with.</p>')
    parts.append("</section>")
    return "".join(parts)


def _replicas(summary: dict) -> str:
    """Serving captures (issue 30): the affected replica against the healthy peer of the same window."""
    x = summary.get("replicas")
    if not x:
        return ""
    parts = ['<section class="replicas" id="replicas"><h2>Affected replica against its healthy peer</h2>',
             f'<p class="why">{escape(x["why"])}</p>']
    if x["pairs"]:
        parts.append(_table(x["pairs"], [("rank", "rank"), ("pod", "pod"), ("peer rank", "peer_rank"),
                                         ("peer pod", "peer_pod"), ("GPU kernel µs", "kernel_us"),
                                         ("peer GPU kernel µs", "peer_kernel_us"), ("ratio", "kernel_ratio"),
                                         ("host-blocking µs", "host_blocking_us"),
                                         ("peer host-blocking µs", "peer_host_blocking_us")]))
    if x["operators"]:
        parts.append("<h3>Operators and kernels, largest difference first</h3>" + _table(x["operators"], [
            ("rank", "rank"), ("kind", "kind"), ("name", "name"), ("per", "unit"), ("µs", "us"),
            ("peer µs", "peer_us"), ("+µs", "delta_us"), ("calls", "calls"), ("peer calls", "peer_calls"),
            ("µs per call", "us_per_call"), ("peer µs per call", "peer_us_per_call"),
            ("per-call ratio", "per_call_ratio")]))
    parts.append("</section>")
    return "".join(parts)


def _cross_rank(summary: dict) -> str:
    """Stragglers across ranks: who holds the others back, by how much, how often, and what differs."""
    x = summary.get("cross_rank")
    if not x:
        return ""
    status = x["status"]
    parts = [f'<section class="cross-rank" id="cross-rank"><h2>Stragglers across ranks'
             f'<span class="badge {escape(status)}">{escape(status.replace("_", " "))}</span></h2>',
             f'<p class="why">{escape(x["why"])}</p>']
    for s in x["stragglers"]:
        how = "consistently" if s["consistent"] else "not consistently"
        parts.append(f'<h3>rank {s["rank"]}: {escape(_ms_text(s["more_us_per_step"]))} more own work per step '
                     f'({s["more_pct_of_step"] or 0:.0f} % of a step), slow in {s["slow_iterations"]} of '
                     f'{s["of_iterations"]} iterations ({how})</h3>')
        if s["differs"]:
            parts.append(_table(s["differs"], [("what differs", "what"), ("µs per step", "us_per_step"),
                                               ("other ranks' median µs", "others_median_us"), ("+µs", "delta_us")]))
    if x["per_rank"]:
        parts.append(_table(x["per_rank"], [("rank", "rank"), ("step median µs", "step_median_us"),
                                            ("own work median µs", "own_work_median_us"),
                                            ("in collectives median µs", "collective_median_us"),
                                            ("more than the others µs", "more_than_others_us")]))
        parts.append('<p class="reason">Own work: step time minus time inside collectives (in a synchronous job '
                     'the other ranks wait for a straggler there, so step times alone look alike).</p>')
    parts.append("</section>")
    return "".join(parts)


def _ms_text(us: float | None) -> str:
    return "—" if us is None else f"{us / 1000:.2f} ms"


def _analysed_on(summary: dict) -> str:
    """Where the ranks ran: the Dask cluster (and each rank's worker), or one `gpulens analyze` started."""
    on = summary.get("analysed_on")
    if not on:
        return ""
    where = ("a local Dask cluster" if on["scheduler"] == "local"
             else f"the Dask cluster {escape(on['scheduler'])}")
    hosts = ", ".join(f"{escape(str(r['rank']))} on {escape(r['worker'])}" for r in summary["ranks"] if r.get("worker"))
    n = on["workers"]
    return f"Ranks analysed on {where} ({n} worker{'' if n == 1 else 's'}){': ' + hosts if hosts else ''}. "


def render_report(summary: dict[str, Any]) -> str:
    c = summary["capture"]
    title = f"gpulens capture {c['capture_id']} · {c['job_id']}"
    analyses = "".join(_analysis(n, a, summary) for n, a in summary["analyses"].items())
    if not summary["analyses"]:
        analyses = '<p class="reason">No analysis ran: no rank could be analysed (see the table above).</p>'
    status = summary["status"]
    return (
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<meta http-equiv=\"Content-Security-Policy\" content=\"{_CSP}\">"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
        f"<title>{escape(title)}</title><style>{_CSS}</style>"
        "<script>window.PlotlyConfig = {MathJaxConfig: 'local'};</script>"
        f"<script>{plotly.offline.get_plotlyjs()}</script></head><body>"
        f"<header><h1>{escape(title)}<span class=\"badge {escape(status)}\">{escape(status.replace('_', ' '))}</span></h1>"
        f"{_identity(summary)}</header><main>{_verdict(summary)}{_replicas(summary)}<h2>Ranks</h2>{_ranks(summary)}{_cross_rank(summary)}{analyses}</main>"
        f"<footer><p class=\"reason\">Generated {escape(_when(summary['generated_at']))} by gpulens "
        f"{escape(summary['tool']['gpulens'])} with HolisticTraceAnalysis {escape(summary['tool']['hta'])}. "
        f"{_analysed_on(summary)}Machine-readable: {escape(summary['outputs']['summary_uri'])}</p></footer></body></html>\n")
