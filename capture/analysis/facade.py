"""`analyze_manifest`: manifest in, summary.json + report.html out. The one entry point.

Map per rank, reduce across ranks. The driver reads and validates the manifest (refusing empty
or artifact-less ones), then submits one task per archived artifact to Dask (`dask_map`): each
worker fetches that trace, verifies its checksum, parses it with HTA on its own and runs every
analysis over it, writing a small per-rank summary next to the trace (`rank_work`). The driver
reduces the capture's answer from those summaries alone (`reduce`): which ranks count, merged
analyses, verdict evidence, baseline comparison, iteration alignment. It writes report.html, then
summary.json, next to the manifest (or to --out). Its memory grows with the summaries only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from gpulens.capture.archive import REPORT_KEY, SUMMARY_KEY, join_uri
from gpulens.ground.logs import EventLogger, get_logger

from .analyses import DEFAULT_ANALYSES, Analysis
from .exclusions import Exclusion
from .manifest_reading import ManifestInput, read_manifest
from .rank_work import RankJob
from .summary import build_summary, summary_json
from .trace_inspection import DEFAULT_MAX_TRACE_BYTES

__all__ = ["AnalyzeOptions", "AnalysisRun", "analyze_manifest", "SUMMARY_KEY", "REPORT_KEY"]



@dataclass(frozen=True)
class AnalyzeOptions:
    out_dir: Path | None = None        # write the outputs here instead of next to the manifest
    s3_endpoint: str | None = None     # for s3:// archives served by MinIO, moto, ...
    jobs: int = 2                      # local Dask workers: ranks analysed at once (each holds one trace)
    work_dir: Path | None = None       # parent of the workers' temporary folders for fetched copies
    max_trace_bytes: int = DEFAULT_MAX_TRACE_BYTES
    scheduler: str | None = None       # tcp://host:port of an existing Dask cluster; None: a local one
    worker_memory: int | None = None   # bytes per local worker; None: sized from the largest trace


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
    """Raises ManifestRefused before doing any work when the manifest names nothing to analyse, and
    OSError when the given Dask scheduler cannot be reached."""
    log = log or get_logger("analysis")
    archive_options = {"endpoint_url": options.s3_endpoint} if options.s3_endpoint and manifest_uri.startswith("s3://") else {}
    source = read_manifest(manifest_uri, **archive_options)
    m = source.manifest
    log = log.bind(capture_id=m.capture_id)
    log.info("manifest.read", uri=manifest_uri, expected=len(m.expected_targets), artifacts=len(m.artifacts),
             failures=len(m.failures))
    summary_uri, report_uri = _output_uris(source, options)
    from .hang_analysis import is_hang_capture
    if is_hang_capture(source):
        return _analyze_hang(source, options, summary_uri, report_uri, log)
    analyses = list(analyses)
    from . import baselines
    is_baseline = baselines.is_baseline(m.request)
    baseline = None if is_baseline else baselines.latest(source.capture_prefix, m.capture_id, log, **archive_options)

    summaries, analysed_on = _map(source, options, archive_options, tuple(analyses), log)
    from .reduce import reduce_ranks
    reduced = reduce_ranks(m, summaries, analyses, log)
    hta = reduced.hta
    if hta is None:  # no rank reached HTA: name the version this installation would use
        from .hta_loading import hta_version
        hta = hta_version()
    summary = build_summary(source, reduced.plan, reduced.contents, reduced.results, hta, summary_uri, report_uri,
                            evidence=reduced.evidence, baseline=baseline, cross_rank=reduced.cross_rank,
                            analysed_on=analysed_on,
                            workers=[(s.get("worker") or {}).get("host") for s in summaries])

    from .report_html import render_report
    _write(source, options, REPORT_KEY, render_report(summary).encode(), "text/html; charset=utf-8")
    _write(source, options, SUMMARY_KEY, summary_json(summary), "application/json")
    if is_baseline and options.out_dir is None:
        baselines.record(source.capture_prefix, summary, log, **archive_options)
    log.info("analysis.written", status=summary["status"], report_uri=report_uri, summary_uri=summary_uri,
             analysed_ranks=summary["counts"]["analysed"])
    return AnalysisRun(summary, summary_uri, report_uri)


def _analyze_hang(source: ManifestInput, options: AnalyzeOptions, summary_uri: str, report_uri: str,
                  log: EventLogger) -> AnalysisRun:
    """A hang capture: every rank's evidence document, reduced to who holds the others up (issue 45)."""
    from .hang_analysis import hang_summary
    from .hang_report_html import render_hang_report
    summary = hang_summary(source, summary_uri, report_uri, log)
    _write(source, options, REPORT_KEY, render_hang_report(summary).encode(), "text/html; charset=utf-8")
    _write(source, options, SUMMARY_KEY, summary_json(summary), "application/json")
    log.info("analysis.written", status=summary["status"], report_uri=report_uri, summary_uri=summary_uri,
             analysed_ranks=summary["counts"]["analysed"], kind="hang")
    return AnalysisRun(summary, summary_uri, report_uri)


def _map(source: ManifestInput, options: AnalyzeOptions, archive_options: dict, analyses: tuple[Analysis, ...],
         log: EventLogger) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One rank summary per manifest artifact, in its order (a rank Dask gave up on is
    `unanalysable`), and where they ran: the scheduler (`local`: a cluster of this process) and
    its worker count when the map began."""
    from .dask_map import LOST, dask_client, map_ranks, plan_cluster

    m = source.manifest
    root = logging.getLogger("gpulens")
    level = logging.getLevelName(root.level).lower() if root.handlers else None
    jobs = [RankJob(i, a, source.capture_prefix, archive_options, analyses, options.max_trace_bytes,
                    str(options.work_dir) if options.work_dir else None,
                    str(Path(options.out_dir).resolve()) if options.out_dir is not None else None,
                    m.capture_id, level)
            for i, a in enumerate(m.artifacts)]
    plan = plan_cluster(m.artifacts, options.jobs, options.scheduler, options.worker_memory)
    out: dict[int, dict[str, Any]] = {}
    with dask_client(plan, log) as client:
        analysed_on = {"scheduler": plan.scheduler or "local", "workers": len(client.scheduler_info()["workers"])}
        for index, result in map_ranks(client, jobs, plan, log):
            if isinstance(result, tuple) and result[0] == LOST:
                a = m.artifacts[index]
                result = {"rank": a.rank, "status": "excluded", "reason": Exclusion.UNANALYSABLE.value,
                          "detail": result[1], "facts": None, "tool": {}}
            out[index] = result
    return [out[i] for i in range(len(jobs))], analysed_on


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
