"""`gpulens gateway`: Alertmanager webhook + manual capture requests -> the job's coordinator.

Flags follow docs/ARCHITECTURE.md ("Command-line contract"); see docs/gateway.md.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from gpulens.ground.argtypes import host_port as _host_port
from gpulens.ground.lifecycle import serve_until_stopped
from gpulens.ground.logs import get_logger

log = get_logger("gateway")

#: Alert-started captures trace this many optimizer steps by default, so every rank's trace covers
#: the same iterations and "rank 3 is slower" compares like with like ...
ALERT_ITERATIONS = 10
#: ... within this much time (the bound `capture start --iterations` uses too).
ALERT_ITERATIONS_BOUND_MS = 30_000




def configure(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--listen", type=_host_port, default=("127.0.0.1", 9453), metavar="HOST:PORT", help="default 127.0.0.1:9453")
    a("--accepted-token-file", "--token-file", dest="token_file", type=Path, required=True,
      help="file with the bearer token Alertmanager and people must present")
    a("--basic-auth-file", type=Path, help="'user:password' lines also accepted (Alertmanager basic_auth)")
    a("--route", action="append", default=[], metavar="NAMESPACE/JOB=URL", help="a job's coordinator (repeatable)")
    a("--routes-file", type=Path, help="JSON routes kept up to date by someone else (gpulens up)")
    a("--coordinator-url-template", help="e.g. 'http://{service}.{namespace}.svc:9452' ({namespace}, {job}, {service})")
    a("--coordinator-token-file", type=Path, required=True, help="bearer token for the coordinators")
    a("--cooldown-s", type=float, default=600.0, help="per job: no alert starts a capture sooner after the last one")
    a("--iterations", type=int, default=ALERT_ITERATIONS, metavar="N",
      help="alert-started captures trace N optimizer steps, every rank from the same iteration (a process that "
           "never steps gets a short time trace, marked so); 0: wall-clock windows of --duration-ms")
    a("--iteration-roundup", type=int, metavar="R",
      help="with --iterations: start at a multiple of R (default: the coordinator's, 100)")
    a("--duration-ms", type=int, default=None,
      help="window of alert-started captures (default 2000), or with --iterations the most time they may take "
           "(default 30000)")
    a("--serving-peers", type=int, default=1, metavar="N",
      help="alerts on a serving workload (gpulens_workload Deployment/..., StatefulSet/..., LeaderWorkerSet/...): "
           "capture the alerted pod plus N healthy replicas of its revision to compare with (0..16)")
    a("--serving-duration-ms", type=int, default=2000, help="wall-clock window of serving captures started by alerts")
    a("--activities", help="comma list of Kineto activity types for alert-started captures "
                           "(default: CPU ops plus the GPU timeline: kernels, copies, runtime calls)")
    a("--state-dir", type=Path, help="persist handled alert episodes here (repeats stay repeats after a restart)")
    a("--log-level", default="info", choices=["debug", "info", "warning", "error"])


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> int:
    import aiohttp
    from aiohttp import web

    from gpulens.capture.client.api import CaptureApi
    from gpulens.capture.wire.auth import Credentials, SecretFile

    from gpulens.capture.activities import unknown_activities

    from .handling import ALERT_ACTIVITIES, Gateway, GatewaySettings
    from .ledger import Ledger
    from .routing import Router, parse_route
    from .server import make_app

    credentials = Credentials(tokens=(SecretFile.required(args.token_file),),
                              basic=SecretFile.required(args.basic_auth_file) if args.basic_auth_file else None)
    coordinator_token = SecretFile.required(args.coordinator_token_file)
    router = Router(static=dict(parse_route(r) for r in args.route), routes_file=args.routes_file,
                    template=args.coordinator_url_template)
    ledger = Ledger.open(args.state_dir)
    activities = tuple(a.strip() for a in args.activities.split(",") if a.strip()) if args.activities else ALERT_ACTIVITIES
    if not activities or unknown_activities(activities):
        raise ValueError(f"--activities: not Kineto activity types every Kineto knows: {unknown_activities(activities)}")
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, limit_per_host=16)) as session:
        def api_for(url: str) -> CaptureApi:
            return CaptureApi(session, url, coordinator_token.read(), timeout_s=5.0)
        gateway = Gateway(GatewaySettings(cooldown_s=args.cooldown_s, duration_ms=args.duration_ms,
                                          activities=activities, iterations=args.iterations,
                                          iteration_roundup=args.iteration_roundup,
                                          serving_peers=args.serving_peers,
                                          serving_duration_ms=args.serving_duration_ms), router, ledger, api_for)
        runner = web.AppRunner(make_app(gateway, credentials, api_for), access_log=None)
        await runner.setup()
        host, port = args.listen
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as exc:
            log.error("gateway.listen_failed", listen=f"{host}:{port}", error=str(exc))
            await runner.cleanup()
            return 1
        log.info("gateway.ready", listen=f"{host}:{port}", routes=len(router.static),
                 routes_file=str(args.routes_file) if args.routes_file else None,
                 template=args.coordinator_url_template)
        try:
            await stop.wait()
        finally:
            await runner.cleanup()
    return 0


def run(args: argparse.Namespace) -> int:
    if not (args.route or args.routes_file or args.coordinator_url_template):
        print("gpulens gateway: give --route, --routes-file or --coordinator-url-template", file=sys.stderr)
        return 2
    if not 0 <= args.iterations <= 10_000 or (args.iteration_roundup is not None and not 1 <= args.iteration_roundup <= 1_000_000):
        print("gpulens gateway: --iterations takes 0..10000 (0: wall-clock windows), --iteration-roundup 1..1000000",
              file=sys.stderr)
        return 2
    if not 0 <= args.serving_peers <= 16 or not 100 <= args.serving_duration_ms <= 600_000:
        print("gpulens gateway: --serving-peers takes 0..16, --serving-duration-ms 100..600000", file=sys.stderr)
        return 2
    if args.duration_ms is None:
        args.duration_ms = ALERT_ITERATIONS_BOUND_MS if args.iterations else 2000

    return serve_until_stopped(lambda stop: serve(args, stop), prog="gpulens gateway")
