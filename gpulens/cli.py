"""The `gpulens` command: one entry point, one subcommand per process kind.

Each subcommand lives in its component as a module with `configure(parser)` and `run(args) -> int`
and is imported only when chosen, so `gpulens exporter` never imports HTA and `gpulens --help`
imports nothing heavy.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

from . import __version__
from .ground.helptext import HelpFormatter

__all__ = ["main", "SUBCOMMANDS"]

#: name -> (module with configure/run, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "up": ("gpulens.up.command", "run the whole loop on this machine (embedded default, no Kubernetes)"),
    "exporter": ("gpulens.exporter.command", "serve per-pod GPU demand, back-pressure and contention metrics"),
    "agent": ("gpulens.capture.agent.command", "node agent: trigger Kineto, observe, verify, archive, record manifest entries"),
    "coordinator": ("gpulens.capture.coordinator.command", "per-job capture coordinator (HTTP API)"),
    "gateway": ("gpulens.capture.gateway.command", "Alertmanager webhook and manual capture requests -> coordinators"),
    "operator": ("gpulens.capture.operator.command", "Kubernetes operator: one coordinator per armed (job, attempt)"),
    "analyze": ("gpulens.capture.analysis.command", "analyse a capture manifest with HolisticTraceAnalysis"),
    "capture": ("gpulens.capture.client.command", "start, watch, list and cancel captures"),
    "hook-path": (None, "print the folder to put on a trainer's PYTHONPATH to arm it"),
    "version": (None, "print the gpulens version"),
}


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (and exit 2) instead of the usage block."""

    def error(self, message: str):  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message} (see '{self.prog} --help')\n")
        raise SystemExit(2)


def _top_parser() -> _Parser:
    epilog = "commands:\n" + "\n".join(f"  {n:<12} {h}" for n, (_, h) in SUBCOMMANDS.items())
    p = _Parser(prog="gpulens", description="GPU observability and on-demand multi-rank capture for training jobs.",
                epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"gpulens {__version__}")
    p.add_argument("command", metavar="COMMAND", choices=list(SUBCOMMANDS), help="one of: " + ", ".join(SUBCOMMANDS))
    return p


#: one example per subcommand, shown under its --help (capture and up add their own, longer ones)
EXAMPLES: dict[str, str] = {
    "exporter": "sudo gpulens exporter --listen 0.0.0.0:9450 --node \"$(hostname)\" --dcgm-url http://127.0.0.1:9400/metrics",
    "agent": "gpulens agent --listen 0.0.0.0:9451 --node \"$(hostname)\" --registry-dir /var/lib/gpulens/registry "
             "--trace-dir /var/lib/gpulens/traces --archive-root file:///archive --accepted-token-file /etc/gpulens/agent.token",
    "coordinator": "gpulens coordinator --job train --attempt 0 --namespace ml --discovery local --registry-dir "
                   "/var/lib/gpulens/registry --agent-url http://127.0.0.1:9451 --archive-root file:///archive "
                   "--accepted-token-file coordinator.token --agent-token-file agent.token",
    "gateway": "gpulens gateway --listen 0.0.0.0:9453 --accepted-token-file gateway.token --route ml/train=http://127.0.0.1:9452 "
               "--coordinator-token-file coordinator.token",
    "operator": "gpulens operator --config /etc/gpulens/operator.yaml",
    "analyze": "gpulens analyze file:///archive/ml/train/0/<capture_id>/manifest.json",
    "hook-path": "export PYTHONPATH=$(gpulens hook-path)${PYTHONPATH:+:$PYTHONPATH}",
    "version": "gpulens version",
}


def build_subparser(name: str):
    module_name, help_text = SUBCOMMANDS[name]
    example = EXAMPLES.get(name)
    parser = _Parser(prog=f"gpulens {name}", description=help_text, formatter_class=HelpFormatter,
                     epilog=f"example:\n  {example}" if example else None)
    if module_name is None:
        return parser, None
    module = importlib.import_module(module_name)
    module.configure(parser)
    return parser, module


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    top = _top_parser()
    if not argv or argv[0] in ("-h", "--help"):
        top.print_help()
        return 0 if argv else 2
    if argv[0] == "--version":
        top.parse_args(argv)
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        top.error(f"unknown command '{name}'")
    parser, module = build_subparser(name)
    args = parser.parse_args(rest)
    if name == "version":
        print(f"gpulens {__version__}")
        return 0
    if name == "hook-path":
        from gpulens.hooks import hook_path
        print(hook_path())
        return 0
    from .ground.logs import setup_logging
    setup_logging(getattr(args, "log_level", "info"))
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
