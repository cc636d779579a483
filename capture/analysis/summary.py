"""Assemble summary.json: the machine-readable result, validated against summary.schema.json.

The report is rendered from this document alone, so everything a reader sees is also here for
tools (the coordinator, Grafana links, scripts). NaN never reaches the file: numbers HTA could not
compute are null.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from gpulens.capture import schemas
from gpulens import __version__

from .contents import TraceContents
from .manifest_reading import ManifestInput
from .rank_selection import RankEntry, RankPlan
from .replicas import affected_evidence, as_baseline, compare
from .running import OK, AnalysisResult

__all__ = ["Evidence", "build_summary", "summary_json", "analysed_something", "SCHEMA_VERSION"]

#: 2: adds `cross_rank` (stragglers across ranks), the `unanalysable` exclusion and where the ranks
#: were analysed (`analysed_on`, each rank's `worker`); 1 is still read (baselines)
SCHEMA_VERSION = 2


@dataclass(frozen=True)
class Evidence:
    """What `evidence.measure` found per rank, or why it could not measure."""
    per_rank: list[dict[str, Any]] | None
    error: str | None = None


def _rank(entry: RankEntry, worker_of: dict[int, str]) -> dict[str, Any]:
    out: dict[str, Any] = {"rank": entry.rank, "target_id": entry.target_id, "status": entry.status,
                           "reason": entry.reason, "detail": entry.detail}
    a = entry.artifact
    if a is not None:
        out.update(node=a.node, pod=a.pod, pid=a.pid, uri=a.uri, size=a.size, sha256=a.sha256)
        if id(a) in worker_of:
            out["worker"] = worker_of[id(a)]
    elif entry.placement is not None:
        out.update(node=entry.placement[0], pod=entry.placement[1])
    out["trace"] = entry.facts.to_dict() if entry.facts is not None else None
    if a is not None and a.iterations is not None:
        out["iterations"] = a.iterations
    if a is not None and a.sizes is not None:
        out["sizes"] = a.sizes      # issue 27: budget, estimate, uncompressed, stored, stopped early
    return out


def _alignment(m, plan: RankPlan) -> dict[str, Any] | None:
    """Iteration-based captures: did every analysed rank trace the same iterations? The first and
    last step per rank come from the agent's verification pass (the manifest). Ranks the capture
    expected but cannot compare (not archived, excluded) are named, never counted as agreeing."""
    requested = m.request.get("iterations") if isinstance(m.request, dict) else None
    if not requested:
        return None
    per_rank = []
    for e in plan.with_status("analysed"):
        it = e.artifact.iterations if e.artifact is not None else None
        per_rank.append({"rank": e.rank, "first": (it or {}).get("first"), "last": (it or {}).get("last"),
                         "stepped": bool((it or {}).get("stepped")), "optimizer_steps": (it or {}).get("optimizer_steps")})
    # a trace with another number of optimizer steps than asked is Kineto's time fallback of a
    # process that began stepping only after the request arrived: not the requested iterations
    not_stepping = [r["rank"] for r in per_rank if not r["stepped"] or r["optimizer_steps"] != int(requested)]
    marked = [r for r in per_rank if r["rank"] not in not_stepping and r["first"] is not None]
    spans = Counter((r["first"], r["last"]) for r in marked)
    common = spans.most_common(1)[0][0] if spans else None
    misaligned = [r["rank"] for r in marked if (r["first"], r["last"]) != common]
    unmarked = [r["rank"] for r in per_rank if r["rank"] not in not_stepping and r["first"] is None]
    # expected ranks this comparison cannot speak for (not archived, or excluded from analysis)
    missing = sorted(e.rank for status in ("missing", "excluded") for e in plan.with_status(status))
    if not_stepping:
        why = (f"rank(s) {', '.join(map(str, not_stepping))} did not trace {int(requested)} optimizer steps (never "
               "stepped when the request arrived): Kineto traced a short time window instead of iterations")
    elif misaligned:
        why = (f"rank(s) {', '.join(map(str, misaligned))} traced other iterations than the rest "
               f"({common[0]}..{common[1]}): compare them with care")
    elif unmarked:
        why = f"rank(s) {', '.join(map(str, unmarked))} have no step numbers (neither the hook's optimizer-step count nor ProfilerStep#N markers) to check the iterations by"
    else:
        why = f"every archived rank traced iterations {common[0]}..{common[1]}" if common else "no rank to check"
    if missing:
        why += f"; rank(s) {', '.join(map(str, missing))} not archived or not analysed, so not compared"
    roundups = sorted({a.iterations["roundup"] for a in m.artifacts if a.iterations})
    return {"requested": int(requested), "roundup": roundups[0] if len(roundups) == 1 else None,
            "aligned": bool(marked) and not (not_stepping or misaligned or unmarked),
            "first": common[0] if common else None, "last": common[1] if common else None,
            "misaligned_ranks": misaligned, "not_stepping_ranks": not_stepping, "unmarked_ranks": unmarked,
            "missing_ranks": missing,
            "per_rank": per_rank, "why": why}


def analysed_something(results: list[AnalysisResult]) -> bool:
    return any(r.status == OK for r in results)


def _verdict(reason: dict | None, contents: TraceContents | None, evidence: Evidence | None,
             baseline: dict[str, Any] | None) -> dict[str, Any]:
    from .verdicts import INCONCLUSIVE, judge
    if evidence is not None and evidence.per_rank is not None:
        return judge(reason, evidence.per_rank, contents.kind if contents else None, baseline)
    why = (f"the trace evidence could not be measured: {evidence.error}" if evidence is not None
           else "no rank's trace could be analysed")
    out = judge(reason, [], contents.kind if contents else None, None)
    if out["diagnosis"]:
        out["verdict"], out["why"] = INCONCLUSIVE, why
    out["checks"] = {}
    return out


def build_summary(source: ManifestInput, plan: RankPlan, contents: TraceContents | None,
                  results: list[AnalysisResult], hta_version: str, summary_uri: str, report_uri: str, *,
                  evidence: Evidence | None = None, baseline: dict[str, Any] | None = None,
                  cross_rank: dict[str, Any] | None = None, analysed_on: dict[str, Any] | None = None,
                  workers: list[str | None] | None = None) -> dict[str, Any]:
    """`analysed_on`: the Dask scheduler the ranks were submitted to and its workers; `workers`:
    the host each manifest artifact was analysed on (its worker's hostname, a pod's name in
    Kubernetes), in the manifest's order, None where no worker finished it."""
    m = source.manifest
    capture: dict[str, Any] = {"capture_id": m.capture_id, "job_id": m.job_id, "attempt": m.attempt,
                               "manifest_uri": source.uri, "requested_at": m.requested_at,
                               "duration_ms": m.duration_ms, "fully_succeeded": m.fully_succeeded}
    if isinstance(m.request.get("reason"), dict):
        capture["reason"] = m.request["reason"]
    capture["baseline"] = m.request.get("baseline") is True
    worker_of = {id(a): w for a, w in zip(m.artifacts, workers or []) if w}
    ranks = [_rank(e, worker_of) for e in plan.entries]
    # A serving capture (issue 30): the named replica is judged against the healthy peer captured
    # with it, in the same window, rather than against the job's baseline.
    per_rank = evidence.per_rank if evidence is not None else None
    replicas = compare(m.request, ranks, per_rank)
    peer = as_baseline(m.request, ranks, per_rank, m.capture_id, summary_uri)
    judged, against = evidence, baseline
    if peer is not None and evidence is not None and per_rank is not None:
        judged, against = Evidence(affected_evidence(m.request, ranks, per_rank), evidence.error), peer
    summary = {
        "schema_version": SCHEMA_VERSION,
        "status": "analysed" if analysed_something(results) else "nothing_analysed",
        "capture": capture,
        "generated_at": time.time(),
        "tool": {"gpulens": __version__, "hta": hta_version},
        "trace_kind": contents.kind if contents is not None else None,
        "counts": {"expected": len(m.expected_targets), "archived": len(m.artifacts),
                   "analysed": len(plan.with_status("analysed")), "excluded": len(plan.with_status("excluded")),
                   "missing": len(plan.with_status("missing"))},
        "ranks": ranks,
        "analyses": {r.name: r.to_dict() for r in results},
        "verdict": _verdict(capture.get("reason"), contents, judged, against),
        "iterations": _alignment(m, plan),
        "evidence": {"per_rank": evidence.per_rank if evidence is not None else None,
                     "error": evidence.error if evidence is not None else None},
        "outputs": {"summary_uri": summary_uri, "report_uri": report_uri},
    }
    if analysed_on is not None:
        summary["analysed_on"] = analysed_on
    if cross_rank is not None:
        summary["cross_rank"] = cross_rank
    if replicas is not None:
        summary["replicas"] = replicas
    return schemas.validate("summary", summary)


def summary_json(summary: dict[str, Any]) -> bytes:
    """allow_nan=False: a NaN that slipped through is a bug to see here, not invalid JSON downstream."""
    return json.dumps(summary, indent=1, allow_nan=False).encode()
