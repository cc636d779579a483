"""`gpulens analyze` on a hang capture (issue 45): every rank's evidence read, checked, reduced.

A hang capture's manifest names one `hang_evidence` document per archived rank (the Flight
Recorder dump and every thread's stack, capture/agent/hang_evidence.py). Each is fetched, its
size and sha256 checked against the manifest, parsed within its limit, checked against its schema
and against the artifact it claims to be (capture, target, rank); a document that fails any check
is excluded with its reason, never read. hang.py reduces the rest to the report, and the verdict
names each suspect rank's pod and node from the manifest. Small documents, no HTA, no Dask: this
runs in the analysing process itself, in well under a second per rank.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

from gpulens import __version__
from gpulens.capture import schemas
from gpulens.capture.archive import ArchiveError
from gpulens.capture.wire import limits
from gpulens.ground.logs import EventLogger

from .hang import evidence_report
from .manifest_reading import ManifestInput

__all__ = ["is_hang_capture", "hang_summary"]


def is_hang_capture(source: ManifestInput) -> bool:
    return source.manifest.request.get("kind") == "hang"


def _read(source: ManifestInput, a, log: EventLogger) -> tuple[dict | None, str | None, str]:
    """(document, None, "") or (None, reason, detail)."""
    if a.kind != "hang_evidence":
        return None, "not_hang_evidence", f"{a.uri} is a trace, not a hang_evidence document"
    try:
        raw = source.store.get_bytes(a.uri)
    except ArchiveError as exc:
        return None, "fetch_failed", f"{a.uri}: {exc}"
    if len(raw) != a.size or hashlib.sha256(raw).hexdigest() != a.sha256:
        return None, "checksum_mismatch", (f"{a.uri} is {len(raw)} bytes with sha256 {hashlib.sha256(raw).hexdigest()[:12]}; "
                                           f"the manifest says {a.size} bytes, sha256 {a.sha256[:12]}")
    try:
        doc = limits.loads(raw, limits.HANG_EVIDENCE_FILE)
        schemas.validate("hang_evidence", doc)
    except (ValueError, schemas.SchemaError) as exc:
        return None, "invalid", f"{a.uri}: {str(exc)[:300]}"
    claimed = (doc["capture_id"], doc["target_id"], doc["rank"])
    if claimed != (source.manifest.capture_id, a.target_id, a.own_rank):
        return None, "not_this_rank", (f"{a.uri} says capture {claimed[0]} target {claimed[1]} rank {claimed[2]}; "
                                       f"the manifest names it capture {source.manifest.capture_id} target "
                                       f"{a.target_id} rank {a.own_rank}")
    log.info("hang.rank_read", rank=a.rank, target_id=a.target_id, bytes=len(raw))
    return doc, None, ""


def hang_summary(source: ManifestInput, summary_uri: str, report_uri: str, log: EventLogger) -> dict[str, Any]:
    """The `hang_summary` document of this capture."""
    m = source.manifest
    docs, ranks = [], []
    places = {a.own_rank: (a.pod, a.node) for a in m.artifacts}
    places.update({t.rank: (t.pod, t.node) for t in m.expected_targets if t.rank not in places})
    for a in m.artifacts:
        doc, reason, detail = _read(source, a, log)
        entry: dict[str, Any] = {"rank": a.own_rank, "target_id": a.target_id, "pod": a.pod, "node": a.node}
        if doc is None:
            log.warning("hang.rank_excluded", rank=a.rank, target_id=a.target_id, reason=reason, detail=detail[:300])
            ranks.append(entry | {"status": "excluded", "reason": reason, "detail": detail})
            continue
        docs.append(doc)
        fr, st = doc["flight_recorder"], doc["stacks"]
        ranks.append(entry | {"status": "analysed", "reason": None, "detail": f"read from {a.uri}",
                              "dump": None if fr["dump"] is not None else f"{fr['reason']}: {fr['detail'] or ''}",
                              "stacks": None if st["doc"] is not None else f"{st['reason']}: {st['detail'] or ''}"})
    archived = {a.target_id for a in m.artifacts}
    for f in m.failures:
        if f.target_id not in archived:
            pod, node = places.get(f.rank, (None, None)) if f.rank is not None else (None, None)
            ranks.append({"rank": f.rank if f.rank is not None else 0, "target_id": f.target_id, "pod": pod,
                          "node": node, "status": "missing", "reason": f.reason, "detail": f.detail})
    world = len(m.expected_targets) or None
    where = {r: f"pod {pod} on node {node}" for r, (pod, node) in places.items()}
    if docs:
        report = evidence_report(docs, world_size=world, where=where)
        finding = report["finding"]
        verdict = {"line": report["verdict"], "kind": finding["kind"], "group": finding["group"],
                   "op": finding["op"], "seq": finding["seq"], "ops": finding["ops"],
                   "suspects": [{"rank": r, "pod": places.get(r, (None, None))[0], "node": places.get(r, (None, None))[1],
                                 "frame": finding["frames"].get(str(r)), "now_at": finding["now_at"].get(str(r))}
                                for r in finding["ranks"]]}
    else:
        report = {}
        verdict = {"line": "no rank's hang evidence could be read: see each rank's reason", "kind": "no_evidence",
                   "group": None, "op": None, "seq": None, "ops": None, "suspects": []}
    analysed = sum(1 for r in ranks if r["status"] == "analysed")
    summary = {
        "schema_version": 1, "kind": "hang", "status": "analysed" if analysed else "nothing_analysed",
        "capture": {"capture_id": m.capture_id, "job_id": m.job_id, "attempt": m.attempt, "manifest_uri": source.uri,
                    "requested_at": m.requested_at, "fully_succeeded": m.fully_succeeded,
                    "reason": m.request.get("reason") or {}},
        "generated_at": round(time.time(), 3), "tool": {"gpulens": __version__},
        "counts": {"expected": len(m.expected_targets), "archived": len(m.artifacts), "analysed": analysed,
                   "excluded": sum(1 for r in ranks if r["status"] == "excluded"),
                   "missing": sum(1 for r in ranks if r["status"] == "missing")},
        "verdict": verdict, "ranks": sorted(ranks, key=lambda r: r["rank"]), "hang": report,
        "outputs": {"summary_uri": summary_uri, "report_uri": report_uri},
    }
    schemas.validate("hang_summary", summary)
    log.info("hang.verdict", kind=verdict["kind"], suspects=",".join(str(s["rank"]) for s in verdict["suspects"]) or None,
             line=verdict["line"][:500])
    return summary
