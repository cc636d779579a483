"""`gpulens analyze MANIFEST_URI [--out DIR]`: analyse one capture, print the report URI.

stdout carries exactly one line, the report URI (the coordinator links it from Grafana); progress
and problems go to stderr as logfmt lines. Exit codes:
  0  something was analysed (report and summary written)
  2  refused: bad arguments, or a manifest that is unreadable, invalid, empty or without artifacts
  3  nothing could be analysed (every rank excluded, or every analysis failed); report still written
  1  any other failure (for example the archive refused the outputs)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

EXIT_OK, EXIT_ERROR, EXIT_REFUSED, EXIT_NOTHING_ANALYSED = 0, 1, 2, 3
MAX_JOBS = 64
_MIN_WORKER_MEMORY = 256 << 20


def _parse_bytes(text: str) -> int:
    """`4GiB`, `512MB`, `1e9` -> bytes (Dask's own parser), refusing what no worker could run in."""
    from dask.utils import parse_bytes
    try:
        value = int(parse_bytes(text))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"not a size: {text!r}") from exc
    if value < _MIN_WORKER_MEMORY:
        raise ValueError(f"{text!r} is below {_MIN_WORKER_MEMORY >> 20} MiB: no worker could import HTA in it")
    return value


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("manifest_uri", metavar="MANIFEST_URI",
                        help="the capture's manifest.json: file:///... or s3://bucket/...")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR",
                        help="write summary.json and report.html to this local folder instead of next to the "
                             "manifest in the archive")
    parser.add_argument("--s3-endpoint", default=os.environ.get("GPULENS_S3_ENDPOINT"), metavar="URL",
                        help="S3-compatible endpoint for s3:// URIs (credentials: the usual AWS_* variables)")
    parser.add_argument("--jobs", type=int, default=2, metavar="N",
                        help="workers of the local Dask cluster, i.e. ranks analysed at once (1-64, default 2); "
                             "each holds one trace: up to ~12-16x its uncompressed JSON at peak")
    parser.add_argument("--scheduler", default=os.environ.get("GPULENS_DASK_SCHEDULER") or None, metavar="URL",
                        help="tcp://host:port of an existing Dask cluster to run the per-rank work on (default: "
                             "start a local cluster of --jobs workers); its workers must reach the archive")
    parser.add_argument("--worker-memory", default=None, metavar="BYTES",
                        help="memory limit per local worker, e.g. 4GiB (default: sized from the largest trace); "
                             "a rank whose worker crosses it is retried once, then reported unanalysable")
    parser.add_argument("--work-dir", type=Path, default=None, metavar="DIR",
                        help="where to put the temporary local copies of the traces (default: the system temp dir)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def run(args: argparse.Namespace) -> int:
    from gpulens.capture.archive import ArchiveError
    from gpulens.ground.logs import get_logger

    from .facade import AnalyzeOptions, analyze_manifest
    from .manifest_reading import ManifestRefused

    log = get_logger("analysis")
    if not 1 <= args.jobs <= MAX_JOBS:
        print(f"gpulens analyze: --jobs must be between 1 and {MAX_JOBS}, not {args.jobs}", file=sys.stderr)
        return EXIT_REFUSED
    if args.scheduler and not args.scheduler.startswith(("tcp://", "tls://")):
        print(f"gpulens analyze: --scheduler must be tcp://host:port or tls://host:port, not {args.scheduler!r}",
              file=sys.stderr)
        return EXIT_REFUSED
    worker_memory = None
    if args.worker_memory is not None:
        try:
            worker_memory = _parse_bytes(args.worker_memory)
        except ValueError as exc:
            print(f"gpulens analyze: --worker-memory: {exc}", file=sys.stderr)
            return EXIT_REFUSED
    options = AnalyzeOptions(out_dir=args.out, s3_endpoint=args.s3_endpoint, jobs=args.jobs, work_dir=args.work_dir,
                             scheduler=args.scheduler, worker_memory=worker_memory)
    try:
        result = analyze_manifest(args.manifest_uri, options, log=log)
    except ManifestRefused as exc:
        log.error("manifest.refused", uri=args.manifest_uri, reason=exc.code, detail=str(exc))
        print(f"gpulens analyze: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    except (ArchiveError, OSError) as exc:  # the archive (or --out) refused the outputs, no temp space, no scheduler
        log.error("analysis.write_failed", uri=args.manifest_uri, error=str(exc))
        print(f"gpulens analyze: {exc}", file=sys.stderr)
        return EXIT_ERROR
    print(result.report_uri, flush=True)
    if not result.analysed:
        counts = result.summary["counts"]
        print(f"gpulens analyze: nothing was analysed ({counts['analysed']} of {counts['archived']} archived ranks "
              f"usable; see {result.report_uri})", file=sys.stderr)
        return EXIT_NOTHING_ANALYSED
    return EXIT_OK
