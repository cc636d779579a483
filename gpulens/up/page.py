"""The local page `gpulens up` serves when there is no Grafana: captures, their reports and the
annotations a coordinator would have posted, plus the archive itself (read-only, static)."""

from __future__ import annotations

import html
import json
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web

from gpulens.alertrules import RUNBOOKS_DIR

if TYPE_CHECKING:
    from .host import UpHost

__all__ = ["Page", "list_captures"]


def list_captures(archive_dir: Path) -> list[dict]:
    """Every manifest under the archive, newest first, with its report when analysis wrote one."""
    out = []
    for manifest in archive_dir.rglob("manifest.json"):
        try:
            doc = json.loads(manifest.read_text())
        except (OSError, ValueError):
            continue
        folder = manifest.parent
        report = folder / "analysis" / "report.html"
        request = doc.get("request") if isinstance(doc.get("request"), dict) else {}
        reason = request.get("reason") if isinstance(request.get("reason"), dict) else {}
        if reason.get("kind") == "alert":
            why = f"alert {reason.get('alertname') or '?'}" + (f" ({reason['diagnosis']})" if reason.get("diagnosis") else "")
        else:
            why = f"by {request.get('requested_by') or 'a person'}" + (f": {reason['text']}" if reason.get("text") else "")
        failures = doc.get("failures", [])
        hang = request.get("kind") == "hang"
        verdict = None
        if hang and report.exists():      # a hang report's first line: the rank that holds the others up
            try:
                verdict = json.loads((folder / "analysis" / "summary.json").read_text())["verdict"]["line"]
            except (OSError, ValueError, KeyError, TypeError):
                verdict = None
        out.append({
            "kind": "hang" if hang else "trace", "verdict": verdict,
            "reason": why, "requested_at": doc.get("requested_at"),
            "cancelled": any(f.get("reason") == "cancelled" for f in failures if isinstance(f, dict)),
            "capture_id": doc.get("capture_id"), "job_id": doc.get("job_id"), "attempt": doc.get("attempt"),
            "created_at": doc.get("created_at", 0), "fully_succeeded": doc.get("fully_succeeded"),
            "archived": len(doc.get("artifacts", [])), "expected": len(doc.get("expected_targets", [])),
            "failures": [f"{f.get('target_id')}: {f.get('reason')}" for f in doc.get("failures", [])],
            "manifest": str(manifest.relative_to(archive_dir)),
            "report": str(report.relative_to(archive_dir)) if report.exists() else None,
        })
    return sorted(out, key=lambda c: c["created_at"], reverse=True)


#: the runbooks an alert's runbook_url points at (served here under `gpulens up`)
RUNBOOK_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}\.md")


def runbooks() -> list[Path]:
    return sorted(p for p in RUNBOOKS_DIR.glob("*.md") if RUNBOOK_NAME.fullmatch(p.name))


def _annotations(path: Path) -> list[dict]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    items = doc.get("annotations", doc) if isinstance(doc, dict) else doc
    return [a for a in items if isinstance(a, dict)] if isinstance(items, list) else []


class Page:
    def __init__(self, runner: "UpHost", port: int):
        self.runner, self.port = runner, port
        self._site_runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/", self.index)
        app.router.add_get("/api/captures", self.api_captures)
        app.router.add_get("/api/annotations", self.api_annotations)
        app.router.add_static("/archive/", self.runner.layout.archive_dir, show_index=False)
        app.router.add_get("/runbooks/", self.runbook_index)
        app.router.add_get("/runbooks/{name}", self.runbook)
        return app

    async def runbook_index(self, request: web.Request) -> web.Response:
        e = html.escape
        items = "".join(f'<li><a href="/runbooks/{e(p.name)}">{e(p.stem)}</a></li>' for p in runbooks())
        return web.Response(text=f"<!doctype html><title>gpulens runbooks</title><h1>Runbooks</h1><ul>{items}</ul>",
                            content_type="text/html")

    async def runbook(self, request: web.Request) -> web.Response:
        """alertrules/runbooks/<diagnosis>.md as the alert's runbook_url names it (plain text, read-only)."""
        name = request.match_info["name"]
        if not RUNBOOK_NAME.fullmatch(name):
            raise web.HTTPNotFound(text=f"no runbook {name!r}: see /runbooks/")
        path = RUNBOOKS_DIR / name
        if not path.is_file():
            raise web.HTTPNotFound(text=f"no runbook {name!r}: see /runbooks/")
        return web.Response(text=path.read_text(encoding="utf-8"), content_type="text/plain", charset="utf-8")

    async def start(self) -> None:
        self._site_runner = web.AppRunner(self.app(), access_log=None)
        await self._site_runner.setup()
        await web.TCPSite(self._site_runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self._site_runner:
            await self._site_runner.cleanup()

    async def api_captures(self, request: web.Request) -> web.Response:
        return web.json_response({"captures": list_captures(self.runner.layout.archive_dir)})

    async def api_annotations(self, request: web.Request) -> web.Response:
        return web.json_response({"annotations": _annotations(self.runner.layout.annotations_file)})

    async def index(self, request: web.Request) -> web.Response:
        e = html.escape
        rows = []
        for c in list_captures(self.runner.layout.archive_dir):
            report = f'<a href="/archive/{e(c["report"])}">report</a>' if c["report"] else "(analysis pending)"
            state = "all ranks" if c["fully_succeeded"] else "incomplete: " + e("; ".join(c["failures"]) or "-")
            if c["cancelled"]:
                state += " — cancelled"
            requested = c["requested_at"] if isinstance(c["requested_at"], (int, float)) else c["created_at"]
            rows.append(f"<tr><td>{e(time.strftime('%H:%M:%S', time.localtime(requested)))}</td>"
                        f"<td>{e(time.strftime('%H:%M:%S', time.localtime(c['created_at'])))}</td>"
                        f"<td>{e(str(c['job_id']))}/{e(str(c['attempt']))}</td><td><code>{e(str(c['capture_id']))}</code></td>"
                        f"<td>{e(c['reason'])}</td><td>{c['archived']}/{c['expected']} ({state})</td>"
                        f'<td><a href="/archive/{e(c["manifest"])}">manifest</a> {report}</td></tr>')
        notes = []
        for a in _annotations(self.runner.layout.annotations_file):
            text = a.get("text", "")  # coordinator-generated HTML (a link to the report)
            when = a.get("time", 0) / 1000 if isinstance(a.get("time"), (int, float)) else 0
            notes.append(f"<li>{e(time.strftime('%H:%M:%S', time.localtime(when)))} "
                         f"[{e(', '.join(map(str, a.get('tags', []))))}] {text}</li>")
        links = "".join(f'<li>{e(name)}: <a href="{e(url)}">{e(url)}</a></li>' for name, url in self.runner.urls.items())
        runbook_links = "".join(f'<li><a href="/runbooks/{e(p.name)}">{e(p.stem)}</a></li>' for p in runbooks())
        body = f"""<!doctype html><html><head><meta charset="utf-8"><title>gpulens up</title>
<meta http-equiv="refresh" content="5"><style>body{{font-family:sans-serif;margin:2em}}
td,th{{padding:.2em .8em;text-align:left}}tr:nth-child(even){{background:#f3f3f3}}</style></head><body>
<h1>gpulens up</h1><ul>{links}</ul>
<h2>Captures</h2><table><tr><th>requested (local time)</th><th>manifest written</th><th>job/attempt</th>
<th>capture</th><th>why</th><th>ranks archived</th><th></th></tr>
{''.join(rows) or '<tr><td colspan=7>none yet</td></tr>'}</table>
<h2>Runbooks</h2><ul>{runbook_links}</ul>
<h2>Annotations</h2><ul>{''.join(notes) or '<li>none yet</li>'}</ul></body></html>"""
        return web.Response(text=body, content_type="text/html")
