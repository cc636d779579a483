"""report.html of a hang capture: the verdict line first, then per process group who is where.

Rendered from the `hang_summary` document alone; every string from a dump, a stack or a manifest
(frames, pod names, reasons) is HTML-escaped. No script at all, and a Content-Security-Policy
that forbids every fetch: the page reads the same from a Grafana link or the archive.
"""

from __future__ import annotations

import datetime as dt
from html import escape
from typing import Any

__all__ = ["render_hang_report"]

_CSP = "default-src 'none'; style-src 'unsafe-inline'"
_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:0 auto;max-width:1200px;padding:12px 24px;color:#222}
h1{font-size:22px}h2{font-size:18px;margin:24px 0 8px}
section.verdict{border:2px solid #c62828;border-radius:6px;padding:8px 16px;margin:16px 0;font-size:15px}
table{border-collapse:collapse;margin:8px 0;font-size:13px}th,td{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f0f0f0}tr.suspect{background:#fde2e1}code{font-size:12px}.why{color:#666}
"""


def _e(value: Any) -> str:
    return escape("" if value is None else str(value))


def _group(g: dict, suspects: set[int]) -> str:
    rows = []
    for r, v in sorted(g["ranks"].items(), key=lambda kv: int(kv[0])):
        cls = ' class="suspect"' if int(r) in suspects else ""
        state = ("waits in it" if int(r) in g["waiting"] else "never entered it" if int(r) in g["behind"] else "")
        rows.append(f"<tr{cls}><td>{_e(r)}</td><td>{_e(v['last_entered'])}</td><td>{_e(v['last_completed'])}</td>"
                    f"<td>{_e(v['op'])}</td><td>{_e(state)}</td><td><code>{_e(v['frame'])}</code></td>"
                    f"<td><code>{_e(v['now_at'])}</code></td></tr>")
    mism = "".join(
        f"<li>collective_seq_id {_e(m['seq'])}: "
        + "; ".join(f"rank {_e(r)} calls {_e(c['op'])} {_e(c['input_sizes'])}" for r, c in m["calls"].items())
        + "</li>" for m in g["mismatches"])
    return (f"<h2>Process group {_e(g['group'])}: frontier collective_seq_id {_e(g['frontier_seq'])} "
            f"({_e(g['op'])})</h2>"
            "<table><tr><th>rank</th><th>last entered</th><th>last completed</th><th>its last collective</th>"
            "<th>at the frontier</th><th>called from</th><th>where it is now (its stacks)</th></tr>"
            + "".join(rows) + "</table>"
            + (f"<p>The ranks called different collectives at one sequence id:</p><ul>{mism}</ul>" if mism else ""))


def render_hang_report(summary: dict[str, Any]) -> str:
    c, v = summary["capture"], summary["verdict"]
    hang = summary.get("hang") or {}
    suspects = {s["rank"] for s in v["suspects"]}
    when = dt.datetime.fromtimestamp(c["requested_at"], dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    mark = ' class="suspect"'
    ranks = "".join(
        f"<tr{mark if r['rank'] in suspects else ''}><td>{_e(r['rank'])}</td><td>{_e(r.get('pod'))}</td>"
        f"<td>{_e(r.get('node'))}</td><td>{_e(r['status'])}</td>"
        f"<td class=\"why\">{_e(r.get('dump') or ('read' if r['status'] == 'analysed' else ''))}</td>"
        f"<td class=\"why\">{_e(r.get('stacks') or ('read' if r['status'] == 'analysed' else ''))}</td>"
        f"<td class=\"why\">{_e(r['reason'] or '')} {_e(r['detail'])}</td></tr>" for r in summary["ranks"])
    groups = "".join(_group(g, suspects) for g in hang.get("groups") or [])
    return (f"<!doctype html><html><head><meta charset=\"utf-8\">"
            f"<meta http-equiv=\"Content-Security-Policy\" content=\"{_CSP}\">"
            f"<title>gpulens hang report {_e(c['capture_id'])}</title><style>{_CSS}</style></head><body>"
            f"<h1>Hang report: {_e(c['job_id'])} attempt {_e(c['attempt'])}, capture {_e(c['capture_id'])}</h1>"
            f"<section class=\"verdict\"><b>{_e(v['line'])}</b></section>"
            f"<p>Requested {_e(when)}; {summary['counts']['analysed']} of {summary['counts']['expected']} ranks' "
            f"evidence read (Flight Recorder dump and every thread's stack).</p>"
            f"{groups}<h2>Ranks</h2><table><tr><th>rank</th><th>pod</th><th>node</th><th>evidence</th>"
            f"<th>Flight Recorder</th><th>stacks</th><th>detail</th></tr>{ranks}</table>"
            f"<p class=\"why\">gpulens {_e(summary['tool']['gpulens'])}; manifest {_e(c['manifest_uri'])}</p>"
            "</body></html>")
