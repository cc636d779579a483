"""`gpulens up`: the whole loop on one machine, supervised, in the foreground.

Starts the exporter, the node agent, the gateway, Prometheus and Alertmanager (system packages,
generated configs with the project's rules and the gateway as webhook receiver), a coordinator
per (job, attempt) that registers, and a local page listing captures and annotations (or posts
annotations to Grafana with --grafana-url). `--demo` adds a two-rank PyTorch CPU trainer driving
the CUDA driver stand-in, and `--incident X` induces one of the four incidents after a warm-up.
`--demo --serving` runs a serving workload instead: two replicas of a PyTorch CPU model answering
requests, each on its own stand-in GPU, where `--incident noisy_neighbor` lands on one replica.
Ctrl-C stops everything it started; the archive stays.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

from gpulens.ground.helptext import HelpFormatter

__all__ = ["configure", "run"]

INCIDENTS = ("host_sync", "noisy_neighbor", "input_starvation", "hang")
SERVING_INCIDENTS = ("noisy_neighbor",)   # the serving demo's incident: a neighbour on one replica's GPU


EPILOG = """examples:
  gpulens up --demo --incident host_sync          # the whole loop: an alert, a capture, a report in ~2.5 min
  gpulens up --demo --incident hang               # a rank stops before a collective: the stalled alert, a hang
                                                  # capture, and a report naming that rank
  gpulens up --demo --serving --incident noisy_neighbor   # a serving workload: one replica against its peer
  gpulens up --demo --exit-after-s 120            # a scripted run that stops by itself
  gpulens up --work-dir /srv/gpulens --port-base 19450 --grafana-url http://grafana:3000

old spellings kept as aliases for one release: --workdir, --exit-after, --incident-after, --status-interval"""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.epilog, parser.formatter_class = EPILOG, HelpFormatter
    parser.add_argument("--work-dir", "--workdir", dest="workdir", type=Path, default=Path(".gpulens"),
                        help="where registry, traces, archive, logs and generated configs live")
    parser.add_argument("--port-base", type=int, default=9450,
                        help="first port; exporter +0, agent +1, gateway +3, page +5, Prometheus +10, "
                             "Alertmanager +11, coordinators +20..")
    parser.add_argument("--demo", action="store_true",
                        help="also run a sample trainer (torchrun, 2 ranks, PyTorch CPU) armed by the hook")
    parser.add_argument("--serving", action="store_true",
                        help="with --demo: a serving workload instead of the trainer (Deployment demo/demo-serve, "
                             "two replicas answering requests, one stand-in GPU each)")
    parser.add_argument("--incident", choices=INCIDENTS, help="induce this incident in the demo after --incident-after-s")
    parser.add_argument("--incident-after-s", "--incident-after", dest="incident_after", type=float, default=100.0,
                        metavar="S", help="seconds of normal training before the incident (the rules need a baseline)")
    parser.add_argument("--time-scale", type=float, default=1 / 30,
                        help="alert-rule windows are multiplied by this (1/30: 30 minutes of baseline become 60 s)")
    parser.add_argument("--grafana-url", help="post capture annotations to this Grafana and link its dashboards from "
                                              "alerts (default: none; annotations on the captures page)")
    parser.add_argument("--grafana-token-file", type=Path, help="file with the Grafana API token (with --grafana-url)")
    parser.add_argument("--trigger", default="auto", choices=["auto", "builtin", "dynolog"],
                        help="how the agent reaches Kineto: a dynolog daemon if one answers, else its own IPC endpoint")
    parser.add_argument("--dynolog-addr", default="127.0.0.1:1778",
                        help="HOST:PORT of a dynolog daemon (used by --trigger auto|dynolog)")
    parser.add_argument("--no-prometheus", action="store_true", help="don't start Prometheus and Alertmanager")
    parser.add_argument("--exit-after-s", "--exit-after", dest="exit_after", type=float, metavar="S",
                        help="stop by itself after S seconds (for scripts; default: run until Ctrl-C)")
    parser.add_argument("--status-interval-s", "--status-interval", dest="status_interval", type=float, default=5.0,
                        metavar="S", help="how often the status lines are refreshed")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                        help="log level of gpulens up itself (children log to their files)")


def run(args: argparse.Namespace) -> int:
    if args.incident and not args.demo:
        print("gpulens up: --incident needs --demo (it is induced in the demo trainer)", file=sys.stderr)
        return 2
    if args.serving and not args.demo:
        print("gpulens up: --serving needs --demo (it chooses which demo runs)", file=sys.stderr)
        return 2
    if args.serving and args.incident not in (None, *SERVING_INCIDENTS):
        print(f"gpulens up: the serving demo induces {', '.join(SERVING_INCIDENTS)} (on one replica's GPU), "
              f"not {args.incident}", file=sys.stderr)
        return 2
    from .runner import Runner

    runner = Runner(args)
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        return loop.run_until_complete(runner.run(stop))
    finally:
        loop.close()
