"""What a capture annotation says: built from the coordinator's capture status, labels escaped."""

from __future__ import annotations

import html
from typing import Any

from gpulens.capture.archive import under_prefix

from .model import Annotation

__all__ = ["capture_annotation", "report_link", "capture_tags"]


def report_link(uri: str | None, archive_root: str, base_url: str | None) -> str | None:
    """A browser URL for an archive URI: `base_url` + its path under the archive root, when given."""
    if not uri:
        return None
    if base_url and under_prefix(archive_root, uri):
        return base_url.rstrip("/") + "/" + uri[len(archive_root.rstrip("/")):].lstrip("/")
    return uri


def capture_tags(status: dict[str, Any]) -> tuple[str, ...]:
    reason = status.get("reason") or {}
    tags = ["gpulens", f"capture:{status['capture_id']}", f"job:{status['job_id']}", f"namespace:{status['namespace']}"]
    if reason.get("diagnosis"):
        tags.append(f"diagnosis:{reason['diagnosis']}")
    if reason.get("alertname"):
        tags.append(f"alert:{reason['alertname']}")
    if status.get("kind") == "hang":
        tags.append("hang")
    if status.get("alert_resolved_at"):
        tags.append("resolved")
    return tuple(tags)


def _ms(seconds: float | None) -> int | None:
    return None if seconds is None else int(round(seconds * 1000))


def capture_annotation(status: dict[str, Any], *, archive_root: str, base_url: str | None = None) -> Annotation:
    e = html.escape
    reason = status.get("reason") or {}
    why = (f"alert {e(reason.get('alertname') or '?')}" + (f" ({e(reason['diagnosis'])})" if reason.get("diagnosis") else "")
           if reason.get("kind") == "alert" else f"requested by {e(str(status.get('requested_by') or 'someone'))}")
    parts = [f"<b>gpulens capture</b> <code>{e(status['capture_id'])}</code> of "
             f"{e(status['namespace'])}/{e(status['job_id'])} attempt {int(status['attempt'])}: {why}."]
    phase = status.get("phase")
    expected = int(status.get("expected") or 0)
    archived = int((status.get("counts") or {}).get("archived", 0))
    if phase == "converged":
        verdict = "all ranks archived" if status.get("fully_succeeded") else \
            f"{archived}/{expected} ranks archived; missing ranks {e(str(status.get('missing_ranks') or []))}"
        parts.append(f"Converged: {verdict}.")
    elif phase == "failed":
        parts.append(f"Could not run: {e(str(status.get('error') or 'unknown error'))}.")
    elif status.get("kind") == "hang":
        parts.append(f"Reading the Flight Recorder and stacks of {expected} ranks …")
    else:
        parts.append(f"Capturing {int(status.get('duration_ms') or 0)} ms on {expected} ranks …")
    analysis = status.get("analysis") or {}
    if analysis.get("verdict"):
        parts.append(f"<b>{e(str(analysis['verdict']))}</b>")
    report = report_link(status.get("report_uri"), archive_root, base_url)
    if report:
        parts.append(f'<a href="{e(report, quote=True)}" target="_blank">report</a>')
    elif analysis.get("state") in ("failed", "skipped"):
        parts.append(f"Analysis {e(analysis['state'])}: {e(str(analysis.get('reason') or ''))}.")
    manifest = report_link(status.get("manifest_uri"), archive_root, base_url)
    if manifest:
        parts.append(f'<a href="{e(manifest, quote=True)}" target="_blank">manifest</a>')
    if status.get("alert_resolved_at"):
        parts.append(f"Alert resolved at {e(str(status['alert_resolved_at']))}.")
    end = status.get("converged_at") if phase in ("converged", "failed") else None
    return Annotation(time_ms=_ms(status["requested_at"]), time_end_ms=_ms(end), tags=capture_tags(status),
                      text=" ".join(parts))
