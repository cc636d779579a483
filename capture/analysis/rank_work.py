"""The map step: one rank fetched, checksum-verified, parsed by HTA and analysed on its own.

Runs on a Dask worker (any process that can reach the archive): only this rank's trace is ever in
its memory, so the memory a worker needs is bounded by the largest single trace, never by the rank
count. The result is a small per-rank summary (capture/schemas/rank_summary.schema.json), written
next to the trace in the archive (or under --out) and returned to the driver, which reduces the
capture's answer from these summaries alone. A bad trace costs its own rank, reported with the
reason; this function raises only if the process itself fails (then Dask retries or gives up).
"""

from __future__ import annotations

import logging
import os
import re
import resource
import socket
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gpulens.capture import schemas
from gpulens.capture.archive import ArchiveError, open_archive
from gpulens.capture.archive.paths import under_prefix
from gpulens.capture.models import Artifact
from gpulens import __version__
from gpulens.ground.logs import EventLogger, get_logger, setup_logging

from .analyses.base import Analysis
from .exclusions import Exclusion
from .trace_inspection import InspectJob, inspect_trace

__all__ = ["RankJob", "analyse_rank", "rank_summary_key", "RANK_SUMMARY_SUFFIX"]

RANK_SUMMARY_SUFFIX = ".analysis.json"
_TRACE_SUFFIX = re.compile(r"(\.json)?(\.gz)?$")


@dataclass(frozen=True)
class RankJob:
    index: int                              # the artifact's position in the manifest
    artifact: Artifact
    capture_prefix: str
    archive_options: dict[str, Any]
    analyses: tuple[Analysis, ...]
    max_trace_bytes: int
    work_dir: str | None = None             # parent of this rank's temporary folder
    out_dir: str | None = None              # write the rank summary here, not next to the trace
    capture_id: str = ""
    log_level: str | None = None            # the driver's gpulens log level, if it logs (workers log alike)


def rank_summary_key(capture_prefix: str, artifact_uri: str) -> str | None:
    """`traces/rank-3.json[.gz]` -> `traces/rank-3.analysis.json`, relative to the capture; None
    for a URI outside the capture (its fetch is refused anyway)."""
    prefix = capture_prefix.rstrip("/") + "/"
    if not artifact_uri.startswith(prefix) or not under_prefix(capture_prefix, artifact_uri):
        return None
    return _TRACE_SUFFIX.sub("", artifact_uri[len(prefix):], count=1) + RANK_SUMMARY_SUFFIX


def analyse_rank(job: RankJob) -> dict[str, Any]:
    a = job.artifact
    if job.log_level and not logging.getLogger("gpulens").handlers:  # a fresh worker process
        setup_logging(job.log_level)
    log = get_logger("analysis").bind(capture_id=job.capture_id or None, rank=a.rank, target_id=a.target_id)
    seconds: dict[str, float] = {}
    out: dict[str, Any] = {
        "schema_version": 1, "rank": a.rank, "target_id": a.target_id, "artifact_uri": a.uri, "sha256": a.sha256,
        "status": "excluded", "reason": None, "detail": "", "facts": None, "contents": None, "analyses": {},
        "evidence": {"rank": None, "error": None}, "steps": None, "min_ts": None,
        "tool": {"gpulens": __version__, "hta": None}, "seconds": seconds}
    Path(job.work_dir).mkdir(parents=True, exist_ok=True) if job.work_dir else None
    peaks = {"start": _peak_rss()}
    with tempfile.TemporaryDirectory(prefix=f"gpulens-rank-{a.rank}-", dir=job.work_dir) as work:
        _map(job, Path(work), out, seconds, peaks, log)
    _release_memory()
    # the process's peak so far (a worker that ran a bigger rank before keeps that peak), and after each stage
    out["worker"] = {"host": socket.gethostname(), "pid": os.getpid(), "peak_rss_bytes": _peak_rss(),
                     "peak_rss_after": peaks}
    schemas.validate("rank_summary", out)
    _publish(job, out, log)
    return out


def _peak_rss() -> int:
    """This worker process's peak RSS so far, in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _map(job: RankJob, work: Path, out: dict[str, Any], seconds: dict[str, float], peaks: dict[str, int],
         log: EventLogger) -> None:
    a = job.artifact
    t0 = time.monotonic()
    local = work / "fetched.trace"
    try:
        open_archive(job.capture_prefix, **job.archive_options).download(a.uri, local)
    except (ArchiveError, OSError) as exc:
        log.warning("artifact.fetch_failed", uri=a.uri, error=str(exc), reason=Exclusion.FETCH_FAILED.value)
        out.update(reason=Exclusion.FETCH_FAILED.value, detail=str(exc)[:500])
        return
    seconds["fetch"] = round(time.monotonic() - t0, 3)
    peaks["fetch"] = _peak_rss()
    log.info("artifact.fetched", bytes=local.stat().st_size)

    t0 = time.monotonic()
    (work / "hta").mkdir()
    inspected = inspect_trace(InspectJob(a.rank, a.target_id, str(local), a.sha256, a.size, str(work / "hta"),
                                         job.max_trace_bytes))
    seconds["inspect"] = round(time.monotonic() - t0, 3)
    peaks["inspect"] = _peak_rss()
    if inspected.facts is not None:
        out["facts"] = asdict(inspected.facts)
    if inspected.exclusion is not None:
        log.warning("artifact.rejected", reason=inspected.exclusion.value, detail=inspected.detail)
        out.update(reason=inspected.exclusion.value, detail=inspected.detail)
        return
    local.unlink()  # the staged copy is what HTA reads (a hard link, or a patched copy)
    log.info("artifact.verified", events=inspected.facts.complete_events, gpu_events=inspected.facts.gpu_events,
             rank_inserted=inspected.facts.rank_inserted)

    from .hta_loading import hta_version, load_rank
    out["tool"]["hta"] = hta_version()
    t0 = time.monotonic()
    try:
        trace = load_rank(a.rank, inspected.hta_path, str(work / "hta"), log)
    except Exception as exc:  # noqa: BLE001 - HTA's parser raises bare builtins
        error = f"HTA could not parse it: {type(exc).__name__}: {exc}"[:500]
        log.warning("trace.parse_failed", error=error)
        out.update(reason=Exclusion.HTA_PARSE_FAILED.value, detail=error)
        return
    seconds["load"] = round(time.monotonic() - t0, 3)
    peaks["load"] = _peak_rss()
    out.update(status="analysed", min_ts=int(trace.min_ts))

    t0 = time.monotonic()
    _analyse(trace, job, out, log)
    seconds["analyse"] = round(time.monotonic() - t0, 3)
    peaks["analyse"] = _peak_rss()


def _analyse(trace, job: RankJob, out: dict[str, Any], log: EventLogger) -> None:
    from .contents import describe
    from .evidence import measure
    from .hta_loading import facade
    from .running import run_analyses

    try:
        contents = describe(trace)
    except Exception as exc:  # noqa: BLE001 - the analyses cannot be chosen; say why for each
        error = f"describing the trace failed: {type(exc).__name__}: {exc}"[:500]
        out["analyses"] = {a.name: {"title": a.title, "status": "failed", "reason": error, "seconds": 0.0,
                                    "result": None} for a in job.analyses}
        out["evidence"]["error"] = error
        return
    out["contents"] = contents.to_dict()
    results = run_analyses(facade(trace), contents, job.analyses, log)
    out["analyses"] = {r.name: r.to_dict() for r in results}
    first = _first_optimizer_step(job.artifact)
    try:
        from .cross_rank import rank_steps
        out["steps"] = rank_steps(trace, first)
    except Exception as exc:  # noqa: BLE001 - the cross-rank section then leaves this rank out
        log.warning("steps.failed", error=f"{type(exc).__name__}: {exc}"[:300])
    try:
        out["evidence"]["rank"] = measure(trace, contents.gpu_ranks, {job.artifact.rank: first})["per_rank"][0]
    except Exception as exc:  # noqa: BLE001 - pandas/HTA raise bare builtins; the verdict says why
        out["evidence"]["error"] = f"{type(exc).__name__}: {exc}"[:500]
        log.warning("evidence.failed", error=out["evidence"]["error"])


def _first_optimizer_step(artifact) -> int | None:
    """The trace's first optimizer step by the hook's count, where the manifest has it (an
    iteration capture of a process that publishes its steps): numbers the steps of a trace
    without ProfilerStep#N markers the same on every rank."""
    it = artifact.iterations or {}
    first = it.get("first") if it.get("numbering") == "optimizer_step" else None
    return int(first) if isinstance(first, int) else None


def _release_memory() -> None:
    """Give the freed frames back to the OS: the next rank on this worker starts from a small RSS
    (the worker's memory limit is checked against RSS, which glibc would otherwise keep high)."""
    import ctypes
    import gc
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _publish(job: RankJob, out: dict[str, Any], log: EventLogger) -> None:
    """Next to the trace (or under --out): a lost write costs only the copy, never the analysis."""
    from .summary import summary_json

    data = summary_json(out)
    try:
        if job.out_dir is not None:
            dest = Path(job.out_dir) / "ranks" / f"rank-{job.artifact.rank}-{job.index:05d}{RANK_SUMMARY_SUFFIX}"
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(f".{dest.name}.{os.getpid()}.part")
            tmp.write_bytes(data)
            tmp.replace(dest)
            uri = dest.resolve().as_uri()
        else:
            key = rank_summary_key(job.capture_prefix, job.artifact.uri)
            if key is None:
                return
            uri = open_archive(job.capture_prefix, **job.archive_options).put_bytes(data, key, "application/json")
    except (ArchiveError, OSError) as exc:
        log.warning("rank_summary.write_failed", error=str(exc)[:300])
        return
    log.info("rank_summary.written", uri=uri, bytes=len(data))
