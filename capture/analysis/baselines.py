"""The job's healthy baseline: which capture it is, and its evidence for an incident's comparison.

A capture requested with `"baseline": true` is analysed like any other; once its summary is
written, `record` points the job's folder at it: `<root>/<namespace>/<job>/baseline.json`
(capture id, manifest and summary URIs, request time; a newer baseline replaces an older one, an
older one never replaces a newer one). The baseline capture itself, manifest and traces, stays in
its own folder like every capture. An incident capture's analysis reads the pointer and the
baseline's summary.json (its `evidence.per_rank`) with `latest`: nothing is re-parsed, and a
missing, unreadable or invalid baseline only means "no baseline", said in the log.
"""

from __future__ import annotations

import json
from typing import Any

from gpulens.capture import schemas
from gpulens.capture.wire import limits
from gpulens.capture.archive import ArchiveError, join_uri, open_archive
from gpulens.ground.logs import EventLogger

__all__ = ["POINTER", "job_prefix", "is_baseline", "latest", "record"]

POINTER = "baseline.json"
_POINTER_LIMIT = limits.JsonLimit("baseline pointer", 64 << 10)
_SUMMARY_LIMIT = limits.JsonLimit("baseline summary", 64 << 20)


def job_prefix(capture_prefix: str) -> str:
    """`.../<namespace>/<job>/<attempt>/<capture_id>` -> `.../<namespace>/<job>`."""
    return capture_prefix.rstrip("/").rsplit("/", 2)[0]


def is_baseline(request: dict[str, Any]) -> bool:
    return isinstance(request, dict) and request.get("baseline") is True


def _read(store, uri: str, limit: limits.JsonLimit) -> Any:
    return limits.loads(store.get_bytes(uri), limit)


def latest(capture_prefix: str, capture_id: str, log: EventLogger, **archive_options: Any) -> dict[str, Any] | None:
    """{"capture_id", "summary_uri", "evidence"} of the job's latest analysed baseline, or None."""
    prefix = job_prefix(capture_prefix)
    uri = join_uri(prefix, POINTER)
    try:
        store = open_archive(prefix, **archive_options)
        if not store.exists(uri):
            log.info("baseline.none", job_prefix=prefix)
            return None
        pointer = _read(store, uri, _POINTER_LIMIT)
        if pointer.get("capture_id") == capture_id:
            return None
        summary = schemas.validate("summary", _read(store, pointer["summary_uri"], _SUMMARY_LIMIT))
    except (ArchiveError, ValueError, KeyError, AttributeError, TypeError) as exc:
        log.warning("baseline.unreadable", job_prefix=prefix, error=f"{type(exc).__name__}: {exc}"[:300])
        return None
    evidence = (summary.get("evidence") or {}).get("per_rank")
    if not evidence:
        log.warning("baseline.no_evidence", baseline_id=summary["capture"]["capture_id"])
        return None
    log.info("baseline.found", baseline_id=summary["capture"]["capture_id"])
    return {"capture_id": summary["capture"]["capture_id"], "summary_uri": pointer["summary_uri"], "evidence": evidence}


def record(capture_prefix: str, summary: dict[str, Any], log: EventLogger, **archive_options: Any) -> str | None:
    """Point the job at this baseline (unless a newer one is recorded); the pointer URI, or None."""
    c = summary["capture"]
    if summary["status"] != "analysed" or not (summary.get("evidence") or {}).get("per_rank"):
        log.warning("baseline.not_recorded", reason="nothing was measured in this baseline capture")
        return None
    prefix = job_prefix(capture_prefix)
    uri = join_uri(prefix, POINTER)
    store = open_archive(prefix, **archive_options)
    try:
        if store.exists(uri) and float(_read(store, uri, _POINTER_LIMIT).get("requested_at", 0)) > c["requested_at"]:
            log.info("baseline.kept_newer", job_prefix=prefix)
            return None
    except (ArchiveError, ValueError, AttributeError, TypeError):
        pass  # an unreadable pointer is replaced
    pointer = {"capture_id": c["capture_id"], "manifest_uri": c["manifest_uri"],
               "summary_uri": summary["outputs"]["summary_uri"], "requested_at": c["requested_at"]}
    try:
        store.put_bytes(json.dumps(pointer).encode(), POINTER, "application/json")
    except ArchiveError as exc:  # the report is written; only later comparisons lose this baseline
        log.warning("baseline.record_failed", baseline_id=c["capture_id"], error=str(exc)[:300])
        return None
    log.info("baseline.recorded", baseline_id=c["capture_id"], pointer=uri)
    return uri
