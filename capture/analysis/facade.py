"""`analyze_manifest`: manifest in, summary.json + report.html out. The one entry point.

Steps, each logged as one line on stderr so long runs show progress:
read and validate the manifest (refuse empty / artifact-less ones) -> fetch only the artifacts it
names -> verify each checksum and stage an HTA-ready copy (bounded worker pool) -> keep the ranks
that share one clock, account for every other one -> load them into HTA with an explicit
{rank: file} map and bounded parallelism -> choose analyses by what the traces contain and run
each in isolation -> write report.html, then summary.json, next to the manifest (or to --out).
"""

from __future__ import annotations

import multiprocessing as mp
import tempfile
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

from capture.archive import join_uri
from gpulens.logs import EventLogger, get_logger

from .analyses import DEFAULT_ANALYSES, Analysis
from .exclusions import Exclusion
from .fetching import Fetched, fetch_artifacts
from .manifest_reading import ManifestInput, read_manifest
from .rank_selection import RankPlan, plan_ranks
from .running import FAILED, AnalysisResult, run_analyses
from .summary import Evidence, build_summary, summary_json
from .trace_inspection import DEFAULT_MAX_TRACE_BYTES, InspectJob, Inspected, inspect_trace

__all__ = ["AnalyzeOptions", "AnalysisRun", "analyze_manifest", "SUMMARY_KEY", "REPORT_KEY"]

SUMMARY_KEY = "analysis/summary.json"
REPORT_KEY = "analysis/report.html"


@dataclass(frozen=True)
class AnalyzeOptions:
    out_dir: Path | None = None        # write the outputs here instead of next to the manifest
    s3_endpoint: str | None = None     # for s3:// archives served by MinIO, moto, ...
    jobs: int = 2                      # traces parsed at once: bounds memory (each costs ~5x its JSON size)
    work_dir: Path | None = None       # parent of the temporary folder for fetched copies
    max_trace_bytes: int = DEFAULT_MAX_TRACE_BYTES


@dataclass(frozen=True)
class AnalysisRun:
    summary: dict[str, Any]
    summary_uri: str
    report_uri: str

    @property
    def analysed(self) -> bool:
        return self.summary["status"] == "analysed"


def analyze_manifest(manifest_uri: str, options: AnalyzeOptions = AnalyzeOptions(), *,
                     log: EventLogger | None = None, analyses: Iterable[Analysis] = DEFAULT_ANALYSES) -> AnalysisRun:
    """Raises ManifestRefused before doing any work when the manifest names nothing to analyse."""
    log = log or get_logger("analysis")
    archive_options = {"endpoint_url": options.s3_endpoint} if options.s3_endpoint and manifest_uri.startswith("s3://") else {}
    source = read_manifest(manifest_uri, **archive_options)
    m = source.manifest
    log = log.bind(capture_id=m.capture_id)
    log.info("manifest.read", uri=manifest_uri, expected=len(m.expected_targets), artifacts=len(m.artifacts),
             failures=len(m.failures))
    summary_uri, report_uri = _output_uris(source, options)
    analyses = list(analyses)
    from . import baselines
    is_baseline = baselines.is_baseline(m.request)
    baseline = None if is_baseline else baselines.latest(source.capture_prefix, m.capture_id, log, **archive_options)

    from .hta_loading import hta_version  # HTA is imported only once there is something to analyse
    with tempfile.TemporaryDirectory(prefix="gpulens-analyze-", dir=options.work_dir) as work:
        fetched = fetch_artifacts(source.store, m.artifacts, Path(work) / "fetched", log)
        inspected = _inspect_all(fetched, Path(work) / "hta", options, log)
        plan = plan_ranks(m, inspected)
        for e in plan.with_status("excluded"):
            log.warning("rank.excluded", rank=e.rank, target_id=e.target_id, reason=e.reason, detail=e.detail)
        for e in plan.with_status("missing"):
            log.warning("rank.missing", rank=e.rank, target_id=e.target_id, reason=e.reason)
        contents, results, evidence = None, [], None
        if plan.analysed:
            plan, contents, results, evidence = _analyse(plan, str(Path(work) / "hta"), options.jobs, analyses, log)
        summary = build_summary(source, plan, contents, results, hta_version(), summary_uri, report_uri,
                                evidence=evidence, baseline=baseline)

    from .report_html import render_report
    _write(source, options, REPORT_KEY, render_report(summary).encode(), "text/html; charset=utf-8")
    _write(source, options, SUMMARY_KEY, summary_json(summary), "application/json")
    if is_baseline and options.out_dir is None:
        baselines.record(source.capture_prefix, summary, log, **archive_options)
    log.info("analysis.written", status=summary["status"], report_uri=report_uri, summary_uri=summary_uri,
             analysed_ranks=summary["counts"]["analysed"])
    return AnalysisRun(summary, summary_uri, report_uri)


def _analyse(plan: RankPlan, trace_dir: str, jobs: int, analyses: list[Analysis], log: EventLogger):
    from .contents import describe
    from .hta_loading import facade, load_trace
    try:
        loaded = load_trace(plan.analysed, trace_dir, jobs, log)
        plan = plan.excluding(loaded.failed, Exclusion.HTA_PARSE_FAILED)
        if loaded.trace is None:
            return plan, None, [], None
        contents = describe(loaded.trace)
    except Exception as exc:  # noqa: BLE001 - HTA raises bare builtins; the report must still say why
        error = f"loading the traces into HTA failed: {type(exc).__name__}: {exc}"[:500]
        log.error("traces.load_failed", error=error)
        return plan, None, [AnalysisResult(a.name, a.title, FAILED, error) for a in analyses], None
    log.info("traces.described", kind=contents.kind, ranks=len(contents.ranks), gpu_ranks=len(contents.gpu_ranks),
             comm_ranks=len(contents.comm_ranks), profiler_steps=len(contents.profiler_steps))
    results = run_analyses(facade(loaded.trace), contents, analyses, log)
    return plan, contents, results, _measure(loaded.trace, contents, log)


def _measure(trace, contents, log: EventLogger) -> Evidence:
    """The verdicts' numbers; a failure here costs the verdict, never the analyses."""
    from .evidence import measure
    try:
        per_rank = measure(trace, contents.gpu_ranks)["per_rank"]
    except Exception as exc:  # noqa: BLE001 - pandas/HTA raise bare builtins; record why and go on
        error = f"{type(exc).__name__}: {exc}"[:500]
        log.warning("evidence.failed", error=error)
        return Evidence(None, error)
    log.info("evidence.measured", ranks=len(per_rank))
    return Evidence(per_rank, None)


def _inspect_all(fetched: list[Fetched], hta_dir: Path, options: AnalyzeOptions, log: EventLogger) -> list[Inspected]:
    hta_dir.mkdir(parents=True, exist_ok=True)
    results: dict[int, Inspected] = {}
    jobs = []
    for i, f in enumerate(fetched):
        a = f.artifact
        if f.path is None:
            results[i] = Inspected(a.rank, a.target_id, exclusion=Exclusion.FETCH_FAILED, detail=f.error)
        else:
            # one staged name per artifact index: a duplicate rank must not overwrite the first one's copy
            sub = hta_dir / f"{i:05d}"
            sub.mkdir()
            jobs.append((i, InspectJob(a.rank, a.target_id, str(f.path), a.sha256, a.size, str(sub),
                                       options.max_trace_bytes)))
    for n, (i, result) in enumerate(_inspect_in_workers(jobs, options.jobs), 1):
        results[i] = result
        if result.exclusion is None:
            log.info("artifact.verified", target_id=result.target_id, rank=result.rank,
                     progress=f"{n}/{len(jobs)}", events=result.facts.complete_events,
                     gpu_events=result.facts.gpu_events, rank_inserted=result.facts.rank_inserted)
        else:
            log.warning("artifact.rejected", target_id=result.target_id, rank=result.rank,
                        progress=f"{n}/{len(jobs)}", reason=result.exclusion.value, detail=result.detail)
    return [results[i] for i in range(len(fetched))]


def _inspect_in_workers(jobs: list[tuple[int, InspectJob]], workers: int) -> Iterator[tuple[int, Inspected]]:
    """Fork workers parse one trace each (several times its size in memory); the parent stays small.

    A worker that dies (the OOM killer, a crash in a C extension) breaks its pool: every job it
    took down is retried alone in a fresh one-worker pool, so only the file that kills its worker
    is excluded, and nothing waits forever for a result that will never come.
    """
    if not jobs:
        return
    retry: list[tuple[int, InspectJob]] = []
    with ProcessPoolExecutor(max(1, min(workers, len(jobs))), mp_context=mp.get_context("fork")) as pool:
        futures = {pool.submit(inspect_trace, job): (i, job) for i, job in jobs}
        for fut in as_completed(futures):
            i, job = futures[fut]
            try:
                yield i, fut.result()
            except BrokenProcessPool:
                retry.append((i, job))
    for i, job in sorted(retry, key=lambda r: r[0]):
        with ProcessPoolExecutor(1, mp_context=mp.get_context("fork")) as pool:
            try:
                yield i, pool.submit(inspect_trace, job).result()
            except BrokenProcessPool:
                yield i, Inspected(job.rank, job.target_id, exclusion=Exclusion.UNREADABLE,
                                   detail="the worker inspecting this trace died (killed, e.g. out of memory)")


def _output_uris(source: ManifestInput, options: AnalyzeOptions) -> tuple[str, str]:
    if options.out_dir is not None:
        out = Path(options.out_dir).resolve()
        return (out / "summary.json").as_uri(), (out / "report.html").as_uri()
    return join_uri(source.capture_prefix, SUMMARY_KEY), join_uri(source.capture_prefix, REPORT_KEY)


def _write(source: ManifestInput, options: AnalyzeOptions, key: str, data: bytes, content_type: str) -> None:
    if options.out_dir is not None:
        out = Path(options.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f".{Path(key).name}.part"
        tmp.write_bytes(data)
        tmp.replace(out / Path(key).name)
        return
    source.store.put_bytes(data, key, content_type)
