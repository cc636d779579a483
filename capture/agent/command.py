"""`gpulens agent`: the node agent (flags: docs/ARCHITECTURE.md, "Command-line contract")."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from gpulens.ground.logs import get_logger

from ..archive import RetryPolicy

__all__ = ["configure", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", default="127.0.0.1:9451", metavar="HOST:PORT")
    parser.add_argument("--node", required=True, help="this node's name (goes into manifest entries)")
    parser.add_argument("--registry-dir", type=Path, required=True, help="where the trainer hook writes worker records")
    parser.add_argument("--trace-dir", type=Path, required=True,
                        help="the trainers' KINETO_ONDEMAND_TRACE_DIR as this process sees it")
    parser.add_argument("--state-dir", type=Path, required=True, help="target statuses persist here")
    parser.add_argument("--archive-root", required=True, metavar="URI", help="file:///path or s3://bucket/prefix")
    parser.add_argument("--s3-endpoint", metavar="URL", help="S3-compatible endpoint (default: AWS)")
    parser.add_argument("--trigger", default="auto", choices=["auto", "builtin", "dynolog"],
                        help="auto: dynolog if it answers at --dynolog-addr, else the builtin IPC endpoint")
    parser.add_argument("--dynolog-addr", default="127.0.0.1:1778", metavar="HOST:PORT")
    parser.add_argument("--socket-dir", help="builtin endpoint at <dir>/dynolog; must be the trainers' "
                                             "KINETO_IPC_SOCKET_DIR, character for character (default: abstract @dynolog)")
    parser.add_argument("--accepted-token-file", "--token-file", dest="token_file", type=Path, required=True,
                        help="file with the bearer token callers of this agent must present")
    parser.add_argument("--verify-workers", type=int, default=1, help="processes verifying traces in parallel")
    parser.add_argument("--archive-attempts", type=int, default=8, help="upload tries before archive_failed")
    parser.add_argument("--keep-local", action="store_true", help="keep trace files after they are archived")
    parser.add_argument("--stale-grace-s", type=float, default=120.0,
                        help="remove a record this long after its process is gone")
    parser.add_argument("--compress-level", type=int, default=1, choices=range(0, 10), metavar="0-9",
                        help="gzip level of the archived copy, written while verifying (0: archive the raw JSON)")
    parser.add_argument("--min-free-mb", type=int, default=1024,
                        help="refuse a capture whose budget would leave less free on the trace or staging disk")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def run(args: argparse.Namespace) -> int:
    from .runtime import AgentOptions, serve

    log = get_logger("agent")
    host, _, port = args.listen.rpartition(":")
    if not port.isdigit():
        print(f"gpulens agent: --listen must be HOST:PORT, got {args.listen!r}", file=sys.stderr)
        return 2
    try:
        token = args.token_file.read_text().strip()
    except OSError as exc:
        print(f"gpulens agent: cannot read --token-file: {exc}", file=sys.stderr)
        return 2
    if not token:
        print(f"gpulens agent: --token-file {args.token_file} is empty", file=sys.stderr)
        return 2
    if args.verify_workers < 1 or args.archive_attempts < 1:
        print("gpulens agent: --verify-workers and --archive-attempts must be >= 1", file=sys.stderr)
        return 2
    opts = AgentOptions(host=host.strip("[]") or "127.0.0.1", port=int(port), node=args.node,
                        registry_dir=args.registry_dir, trace_dir=args.trace_dir, state_dir=args.state_dir,
                        archive_root=args.archive_root, token=token, trigger=args.trigger,
                        dynolog_addr=args.dynolog_addr, socket_dir=args.socket_dir, s3_endpoint=args.s3_endpoint,
                        verify_workers=args.verify_workers, keep_local=args.keep_local,
                        stale_grace_s=args.stale_grace_s, archive_policy=RetryPolicy(attempts=args.archive_attempts),
                        compress_level=args.compress_level, min_free_mb=args.min_free_mb)
    try:
        return asyncio.run(serve(opts))
    except OSError as exc:
        log.error("agent.start_failed", error=str(exc))
        print(f"gpulens agent: {exc}", file=sys.stderr)
        return 1
