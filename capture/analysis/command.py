"""CLI entry for this component: `configure(parser)` adds its options, `run(args)` runs it."""

from __future__ import annotations

import argparse
import sys


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def run(args: argparse.Namespace) -> int:
    print(f"{sys.argv[0]}: this component is not built yet", file=sys.stderr)
    return 1
