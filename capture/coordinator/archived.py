"""Captures a coordinator finished before it restarted: read back from the archive, marked as such.

The coordinator keeps no live state across a restart (DESIGN.md), but a finished capture's
manifest is in the archive at a path derived from the capture id, so `status` can still answer
with what the manifest says instead of `unknown`. Listing uses the per-capture copies that
`--state-dir` keeps (the archive store cannot list). Every such answer carries
`"from_archive": true` and a `note`; live events are over for it.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any, Callable

from gpulens.capture.archive import ArchiveError, ArchiveStore

from .manifests import capture_prefix

__all__ = ["CAPTURE_ID", "ARCHIVE_NOTE", "status_from_manifest", "read_archived", "list_kept"]

#: the capture_request schema's pattern; full-match before an id becomes part of a path or key
CAPTURE_ID = re.compile(r"[a-z0-9][a-z0-9-]{7,62}")
ARCHIVE_NOTE = "read from the archive: this coordinator has restarted since the capture finished"


def status_from_manifest(doc: dict[str, Any], namespace: str, manifest_uri: str,
                         report_uri: str | None) -> dict[str, Any]:
    """The status fields a person reads (render.format_status), from a manifest document."""
    request = doc.get("request") if isinstance(doc.get("request"), dict) else {}
    window = doc.get("window") if isinstance(doc.get("window"), dict) else {}
    archived = {a.get("target_id"): a for a in doc.get("artifacts", []) if isinstance(a, dict)}
    failed = {f.get("target_id"): f for f in doc.get("failures", []) if isinstance(f, dict)}
    targets = []
    for t in doc.get("expected_targets", []):
        tid = t.get("target_id")
        f = failed.get(tid) or {}
        targets.append({"target_id": tid, "rank": t.get("rank"), "pod": t.get("pod"), "node": t.get("node"),
                        "state": "archived" if tid in archived else "failed", "reason": f.get("reason"),
                        "detail": f.get("detail")})
    reason = request.get("reason") if isinstance(request.get("reason"), dict) else {}
    return {
        "capture_id": doc.get("capture_id"), "namespace": namespace, "job_id": doc.get("job_id"),
        "attempt": doc.get("attempt"), "phase": "converged", "from_archive": True, "note": ARCHIVE_NOTE,
        "cancelled": any(f.get("reason") == "cancelled" for f in failed.values()),
        "fully_succeeded": bool(doc.get("fully_succeeded")), "requested_at": window.get("requested_at"),
        "duration_ms": window.get("duration_ms"), "deadline": window.get("deadline"),
        "converged_at": window.get("converged_at"), "manifest_uri": manifest_uri, "report_uri": report_uri,
        "reason": reason, "requested_by": request.get("requested_by"), "expected": len(targets),
        "counts": {"archived": len(archived), "failed": len(targets) - len(archived)},
        "missing_ranks": sorted(t["rank"] for t in targets if t["state"] != "archived" and t["rank"] is not None),
        "targets": targets,
    }


async def read_archived(capture_id: str, *, archive_root: str, namespace: str, job_id: str, attempt: int,
                        open_store: Callable[[str], ArchiveStore]) -> dict[str, Any] | None:
    """The archived status of `capture_id` of this job attempt, or None (not there, or unreadable)."""
    if not CAPTURE_ID.fullmatch(capture_id):
        return None
    prefix = capture_prefix(archive_root, namespace, job_id, attempt, capture_id)
    manifest_uri, report = f"{prefix}/manifest.json", f"{prefix}/analysis/report.html"

    def read() -> tuple[bytes, bool]:
        store = open_store(prefix)
        return store.get_bytes(manifest_uri), store.exists(report)
    try:
        body, has_report = await asyncio.to_thread(read)
        doc = json.loads(body)
    except (ArchiveError, OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("capture_id") != capture_id:
        return None
    return status_from_manifest(doc, namespace, manifest_uri, report if has_report else None)


def list_kept(state_dir: Path | None, skip: set[str]) -> list[dict[str, Any]]:
    """Finished captures kept under `<state dir>/captures/` that are not in memory, newest first."""
    if state_dir is None:
        return []
    out = []
    for path in (Path(state_dir) / "captures").glob("*.json"):
        if path.stem in skip or not CAPTURE_ID.fullmatch(path.stem):
            continue
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and doc.get("capture_id") == path.stem:
            doc.pop("targets", None)
            doc.pop("request", None)
            out.append(dict(doc, from_archive=True, note=ARCHIVE_NOTE))
    return sorted(out, key=lambda d: d.get("requested_at") or 0, reverse=True)
