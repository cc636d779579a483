"""Text for people: capture status tables, one-line events, and the verdict -> exit code rule."""

from __future__ import annotations

import time
from typing import Any

__all__ = ["EXIT_OK", "EXIT_FAILURES", "EXIT_COULD_NOT_RUN", "verdict", "format_status", "format_event",
           "format_list"]

EXIT_OK, EXIT_FAILURES, EXIT_COULD_NOT_RUN = 0, 3, 4


def verdict(status: dict[str, Any]) -> tuple[int, str]:
    """0: every rank archived; 3: converged, some ranks failed; 4: could not run (or unknown)."""
    phase = status.get("phase")
    if phase == "converged":
        if status.get("fully_succeeded"):
            return EXIT_OK, f"converged: all {status.get('expected', 0)} ranks archived"
        archived = (status.get("counts") or {}).get("archived", 0)
        return EXIT_FAILURES, (f"converged with failures: {archived}/{status.get('expected', 0)} ranks archived; "
                               f"missing ranks {status.get('missing_ranks', [])}")
    if phase == "failed":
        return EXIT_COULD_NOT_RUN, f"could not run: {status.get('error') or 'unknown error'}"
    if phase == "unknown":
        return EXIT_COULD_NOT_RUN, "unknown capture (its coordinator did not start it, or restarted since)"
    return EXIT_COULD_NOT_RUN, f"not finished (phase {phase})"


#: wire state -> what a person reads; `queued_by_dynolog` also covers the builtin endpoint's slot
_SHOWN = {"queued_by_dynolog": "queued"}


def _state(name: object) -> str:
    return _SHOWN.get(str(name), str(name))


def _when(ts: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts)) if ts else "-"


def format_status(status: dict[str, Any]) -> str:
    lines = [f"capture   {status.get('capture_id')}  {status.get('namespace')}/{status.get('job_id')} "
             f"attempt {status.get('attempt')}",
             f"phase     {status.get('phase')}" + (" (cancelled)" if status.get("cancelled") else "")
             + (f"  error: {status['error']}" if status.get("error") else ""),
             f"window    {status.get('duration_ms')} ms, requested {_when(status.get('requested_at'))}, "
             f"deadline {_when(status.get('deadline'))} (local time)"]
    reason = status.get("reason") or {}
    if reason.get("kind") == "alert":
        lines.append(f"reason    alert {reason.get('alertname')} ({reason.get('diagnosis') or 'no diagnosis'})")
    else:
        lines.append(f"reason    requested by {status.get('requested_by')}")
    if status.get("from_archive"):
        lines.append(f"note      {status.get('note') or 'read from the archive'}")
    if status.get("manifest_uri"):
        lines.append(f"manifest  {status['manifest_uri']}")
    report = status.get("report_url") or status.get("report_uri")   # the browser link when the server has one
    analysis = status.get("analysis") or {}
    if analysis.get("state") not in (None, "pending", "disabled"):
        lines.append(f"analysis  {analysis.get('state')}" + (f": {analysis['reason']}" if analysis.get("reason") else "")
                     + (f"  {report}" if report else ""))
    elif report:
        lines.append(f"report    {report}")
    if analysis.get("verdict"):
        lines.append(f"verdict   {analysis['verdict']}")
    if status.get("followed_by"):
        lines.append(f"window    {status['followed_by']}: every rank's Kineto window after this hang capture")
    annotation = status.get("annotation") or {}
    if annotation.get("state") not in (None, "disabled"):
        lines.append(f"annotation {annotation.get('state')} ({annotation.get('sink')})"
                     + (f": {annotation['error']}" if annotation.get("error") else ""))
    counts = status.get("counts") or {}
    lines.append("targets   " + (", ".join(f"{_state(k)} {v}" for k, v in counts.items()) or "none yet"))
    targets = status.get("targets") or []
    if targets:
        lines.append(f"  {'target':<10} {'pod':<24} {'node':<16} state")
        for t in targets:
            state = _state(t["state"]) + (f"({t['reason']})" if t.get("reason") else "")
            detail = f"  {t['detail']}" if t.get("detail") and t["state"] == "failed" else ""
            lines.append(f"  {t['target_id']:<10} {str(t.get('pod') or '-'):<24} {str(t.get('node') or '-'):<16} "
                         f"{state}{detail}")
    return "\n".join(lines)


def format_event(event: dict[str, Any]) -> str | None:
    kind = event.get("event")
    at = _when(event.get("at"))
    if kind == "target":
        reason = f"({event['reason']})" if event.get("reason") else ""
        detail = f"  {event['detail']}" if event.get("detail") and event.get("state") == "failed" else ""
        return f"{at} {event.get('target_id'):<10} {_state(event.get('state'))}{reason}{detail}"
    if kind == "phase":
        return f"{at} phase {event.get('phase')}" + (f": {event['error']}" if event.get("error") else "")
    if kind in ("cancel", "analysis", "alert_resolved"):
        extra = {k: v for k, v in event.items() if k not in ("event", "capture_id", "at")}
        return f"{at} {kind} " + " ".join(f"{k}={v}" for k, v in extra.items() if v is not None)
    return None


def format_list(captures: list[dict[str, Any]]) -> str:
    if not captures:
        return "no captures"
    rows = [f"{'capture':<28} {'job':<24} {'requested':<9} {'phase':<20} {'archived':<9} why"]
    for c in captures:
        counts = c.get("counts") or {}
        archived = f"{counts.get('archived', 0)}/{c.get('expected', '?')}" if "expected" in c else "-"
        reason = c.get("reason") or {}
        if reason.get("kind") == "alert":
            why = f"alert {reason.get('alertname') or '?'}"
        else:
            why = f"by {c.get('requested_by') or 'a person'}"
        phase = str(c.get("phase")) + (" cancelled" if c.get("cancelled") else "") + \
            (" (archive)" if c.get("from_archive") else "")
        rows.append(f"{c.get('capture_id', '?'):<28} {str(c.get('namespace', '?')) + '/' + str(c.get('job_id', '?')):<24} "
                    f"{_when(c.get('requested_at')):<9} {phase:<20} {archived:<9} {why}")
    return "\n".join(rows)
