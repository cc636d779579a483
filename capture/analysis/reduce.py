"""The reduce step: the capture's answer from the per-rank summaries alone (no trace, no HTA frame).

Which ranks count is decided here, across ranks, exactly as before the map/reduce split (one
clock, one world size, inside the window, no duplicate: `rank_selection.plan_ranks`, from each
rank's facts); then the analysed ranks' per-rank results are merged per analysis (`Analysis.merge`)
and their evidence is collected for the verdicts.
"""

from __future__ import annotations

from typing import Any

from gpulens.capture.models import Manifest
from gpulens.ground.logs import EventLogger

from .analyses.base import Analysis
from .contents import TraceContents, combine_contents
from .exclusions import Exclusion
from .rank_selection import RankPlan, plan_ranks
from .running import FAILED, NOT_APPLICABLE, OK, AnalysisResult
from .summary import Evidence
from .trace_inspection import Inspected, TraceFacts

__all__ = ["Reduced", "reduce_ranks"]

_MAPPED = "mapped"   # hta_path stand-in: the rank was analysed on a worker (plan_ranks only tests it is set)


class Reduced:
    def __init__(self, plan: RankPlan, contents: TraceContents | None, results: list[AnalysisResult],
                 evidence: Evidence | None, hta: str | None, cross_rank: dict[str, Any] | None = None):
        self.plan, self.contents, self.results, self.evidence, self.hta = plan, contents, results, evidence, hta
        self.cross_rank = cross_rank


def _inspected(artifact, s: dict[str, Any]) -> Inspected:
    facts = TraceFacts(**s["facts"]) if s.get("facts") else None
    if s["status"] == "analysed":
        return Inspected(artifact.rank, artifact.target_id, facts=facts, hta_path=_MAPPED)
    return Inspected(artifact.rank, artifact.target_id, facts=facts, exclusion=Exclusion(s["reason"]),
                     detail=s["detail"])


def reduce_ranks(manifest: Manifest, summaries: list[dict[str, Any]], analyses: list[Analysis],
                 log: EventLogger) -> Reduced:
    """`summaries`: one per manifest artifact, in its order (a lost rank: status excluded, reason unanalysable)."""
    plan = plan_ranks(manifest, [_inspected(a, s) for a, s in zip(manifest.artifacts, summaries)])
    for e in plan.with_status("excluded"):
        log.warning("rank.excluded", rank=e.rank, target_id=e.target_id, reason=e.reason, detail=e.detail)
    for e in plan.with_status("missing"):
        log.warning("rank.missing", rank=e.rank, target_id=e.target_id, reason=e.reason)
    by_artifact = {id(a): s for a, s in zip(manifest.artifacts, summaries)}
    used = sorted((by_artifact[id(e.artifact)] for e in plan.with_status("analysed")), key=lambda s: s["rank"])
    hta = next((s["tool"]["hta"] for s in summaries if s["tool"].get("hta")), None)
    if not used:
        return Reduced(plan, None, [], None, hta)
    described = [s for s in used if s["contents"] is not None]
    contents = combine_contents([TraceContents.from_dict(s["contents"]) for s in described])
    log.info("traces.described", kind=contents.kind, ranks=len(contents.ranks), gpu_ranks=len(contents.gpu_ranks),
             comm_ranks=len(contents.comm_ranks), profiler_steps=len(contents.profiler_steps))
    results = [_combine(a, contents, used, log) for a in analyses]
    evidence = _evidence(used)
    from .cross_rank import stragglers
    section = stragglers({s["rank"]: s.get("steps") or [] for s in used}, evidence.per_rank)
    log.info("cross_rank.reduced", status=section["status"], stragglers=[s["rank"] for s in section["stragglers"]])
    return Reduced(plan, contents, results, evidence, hta, section)


def _combine(analysis: Analysis, contents: TraceContents, used: list[dict], log: EventLogger) -> AnalysisResult:
    reason = analysis.applies(contents)
    if reason is not None:
        return AnalysisResult(analysis.name, analysis.title, NOT_APPLICABLE, reason)
    ok, failed, skipped, seconds = [], [], [], 0.0
    for s in used:
        r = s["analyses"].get(analysis.name)
        if r is None:
            failed.append((s["rank"], "the rank's analysis did not run (describing its trace failed)"))
            continue
        seconds += r["seconds"]
        {OK: ok, FAILED: failed, NOT_APPLICABLE: skipped}[r["status"]].append(
            (s["rank"], r["result"] if r["status"] == OK else r["reason"]))
    if not ok:
        if not failed:
            return AnalysisResult(analysis.name, analysis.title, NOT_APPLICABLE,
                                  skipped[0][1] if skipped else "no analysed rank")
        return AnalysisResult(analysis.name, analysis.title, FAILED, _failures(failed), seconds)
    try:
        merged = analysis.combine([res for _, res in ok], contents)
    except Exception as exc:  # noqa: BLE001 - HTA's cross-rank metric raises bare builtins too
        error = f"combining the ranks failed: {type(exc).__name__}: {exc}"[:500]
        log.warning("analysis.failed", analysis=analysis.name, error=error)
        return AnalysisResult(analysis.name, analysis.title, FAILED, error, seconds)
    partial = f"failed on {len(failed)} rank(s): {_failures(failed)}"[:500] if failed else None
    return AnalysisResult(analysis.name, analysis.title, OK, partial, seconds, merged)


def _failures(failed: list[tuple[int, str]]) -> str:
    errors = {e for _, e in failed}
    if len(errors) == 1:
        return next(iter(errors))
    return "; ".join(f"rank {r}: {e}" for r, e in failed)[:500]


def _evidence(used: list[dict]) -> Evidence:
    per_rank = [s["evidence"]["rank"] for s in used if s["evidence"]["rank"] is not None]
    errors = [s["evidence"]["error"] for s in used if s["evidence"]["error"]]
    if errors and not per_rank:
        return Evidence(None, errors[0])
    return Evidence(per_rank, None)
