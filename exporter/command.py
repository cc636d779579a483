"""`gpulens exporter`: per-pod GPU demand, back-pressure and contention on /metrics."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
from pathlib import Path

__all__ = ["configure", "run", "config_from_args"]


def configure(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument("--listen", default="127.0.0.1:9450", help="HOST:PORT to serve /metrics and /healthz on")
    parser.add_argument("--node", default=env("NODE_NAME") or socket.gethostname(),
                        help="this node's name (label `node`; Kubernetes field selector)")
    parser.add_argument("--proc-root", default="/proc", help="the host's /proc (mounted with hostPID)")
    parser.add_argument("--library-glob", action="append", metavar="GLOB",
                        help="driver library file name (or /absolute/path glob) to probe; repeatable "
                             "(default: libcuda.so*)")
    parser.add_argument("--no-ebpf", action="store_true", help="don't load probes (NVML/DCGM only)")
    parser.add_argument("--registry-dir", help="registration records of trainer processes (no-Kubernetes attribution)")
    k8s = parser.add_mutually_exclusive_group()
    k8s.add_argument("--kubernetes", dest="kubernetes", action="store_true", default=None,
                     help="look pods up in the Kubernetes API (default: when running in a cluster)")
    k8s.add_argument("--no-kubernetes", dest="kubernetes", action="store_false")
    parser.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster service account)")
    parser.add_argument("--nvml", default="auto", help="auto (pynvml), off, or stub:DIR (CUDA stand-in state dir)")
    parser.add_argument("--dcgm-url", help="node-local dcgm-exporter /metrics URL to re-expose device fields from")
    parser.add_argument("--dcgm-interval", type=float, default=10.0, metavar="S")
    parser.add_argument("--no-dcgm-discovery", action="store_true",
                        help="without --dcgm-url, don't look for the dcgm-exporter pod on this node")
    parser.add_argument("--dcgm-namespace", action="append", metavar="NS",
                        help="look for dcgm-exporter pods only in this namespace; repeatable (default: all)")
    parser.add_argument("--scan-interval", type=float, default=2.0, metavar="S",
                        help="seconds between discovery passes (new processes, library files, exits)")
    parser.add_argument("--rescan-interval", type=float, default=5.0, metavar="S",
                        help="seconds before a known process's maps are read again")
    parser.add_argument("--max-processes", type=int, default=16384, help="BPF map size: processes tracked at once")
    parser.add_argument("--max-inflight", type=int, default=65536, help="BPF map size: threads blocked at once")
    parser.add_argument("--attribution-grace", type=float, default=10.0, metavar="S",
                        help="how long a new process's labels may wait for its pod or GPU to become known")
    parser.add_argument("--retired-ttl", type=float, default=900.0, metavar="S",
                        help="how long series of exited processes are kept after their last process exits")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def config_from_args(args: argparse.Namespace):
    from .config import DEFAULT_LIBRARY_GLOBS, ExporterConfig, parse_listen

    host, port = parse_listen(args.listen)
    kubernetes = args.kubernetes
    if kubernetes is None:
        kubernetes = bool(os.environ.get("KUBERNETES_SERVICE_HOST")) or bool(args.kubeconfig)
    if args.nvml not in ("auto", "off") and not args.nvml.startswith("stub:"):
        raise ValueError(f"--nvml must be auto, off or stub:DIR, not {args.nvml!r}")
    # Discovery asks the API whenever there is one, even with --no-kubernetes (no pod attribution):
    # in a cluster the chart may grant only the dcgm-exporter's namespaces.
    api = bool(os.environ.get("KUBERNETES_SERVICE_HOST")) or bool(args.kubeconfig) or bool(args.kubernetes)
    discovery, off = False, ""
    if args.dcgm_url:
        off = "--dcgm-url given"
    elif args.no_dcgm_discovery:
        off = "no --dcgm-url given, discovery off (--no-dcgm-discovery)"
    elif not api:
        off = "no --dcgm-url given, and no Kubernetes API to find dcgm-exporter in"
    else:
        discovery = True
    return ExporterConfig(
        node=args.node, listen_host=host, listen_port=port, proc_root=Path(args.proc_root),
        library_globs=tuple(args.library_glob or DEFAULT_LIBRARY_GLOBS), ebpf=not args.no_ebpf,
        max_processes=args.max_processes, max_inflight=args.max_inflight, scan_interval_s=args.scan_interval,
        rescan_interval_s=args.rescan_interval, attribution_grace_s=args.attribution_grace,
        retired_ttl_s=args.retired_ttl, registry_dir=Path(args.registry_dir) if args.registry_dir else None,
        kubernetes=kubernetes, kubeconfig=args.kubeconfig, nvml=args.nvml, dcgm_url=args.dcgm_url,
        dcgm_interval_s=args.dcgm_interval, dcgm_discovery=discovery, dcgm_discovery_off=off,
        dcgm_namespaces=tuple(args.dcgm_namespace or ()))


async def serve(config, stop: asyncio.Event | None = None) -> int:
    from aiohttp import web

    from gpulens.ground.logs import get_logger

    from .server import make_app
    from .service import Exporter

    log = get_logger("exporter")
    stop = stop or asyncio.Event()
    exporter = Exporter(config)
    await asyncio.to_thread(exporter.start)
    runner = web.AppRunner(make_app(exporter), access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, config.listen_host, config.listen_port)
        await site.start()
    except OSError as exc:
        log.error("exporter.listen_failed", listen=f"{config.listen_host}:{config.listen_port}", error=str(exc))
        await runner.cleanup()
        await asyncio.to_thread(exporter.close)
        return 1
    bound = runner.addresses[0] if runner.addresses else (config.listen_host, config.listen_port)
    log.info("exporter.listening", address=f"{bound[0]}:{bound[1]}")
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
    try:
        await exporter.run_background(stop)
    finally:
        await runner.cleanup()
        await asyncio.to_thread(exporter.close)
        log.info("exporter.stopped")
    return 0


def run(args: argparse.Namespace) -> int:
    import sys

    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"gpulens exporter: error: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(serve(config))
